"""What a speedrunner's edits meet: `--kernels` picks each plain function or its fused twin, a fused kernel whose plain
function was edited refuses to run with a message naming `--kernels plain`, and the four usual edits (an MLP
activation, a gate, a schedule shape, orthogonalizer coefficients) train on the plain path (a tiny model on the CPU)
while the fused path runs them or refuses them with that message."""
import dataclasses
import importlib.util
import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import train_gpt as tg
from optimizer_plans import optimizer_plan
from dist_utils import runtime_for
from proxy_shards import build_shards
from test_cli_and_errors import main, refused  # noqa: F401  (main: a fixture)

PLAIN = {name: kernel.plain for name, kernel in tg.FUSED_KERNELS.items()}
# 32 wide, one micro-batch of 64 tokens a step: a training step in well under a second on one CPU core
TINY = ["--smoke", "--device", "cpu", "--seed", "0", "--model-dim", "32", "--num-heads", "2", "--head-dim", "16",
        "--block-size", "16", "--train-max-seq-len", "64", "--train-bs-schedule", "64,64,64",
        "--train-bs-extension", "64", "--val-batch-size", "64", "--val-tokens", "64"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # the tiny model's steps are launch-bound: on two shared cores one thread runs them several times faster than two
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("edits") / "data"
    build_shards(folder, train_shards=1, tokens_per_train_shard=30_000, val_tokens=2_000)
    return folder


def tiny_args(data, tmp_path, *flags):
    return tg.parse_args([*TINY, "--data-path", str(data), "--log-dir", str(tmp_path / "logs"), "--run-id", "edit",
                          *flags])


def build(args):
    """The trainer run() builds, with one micro-batch a step (as on 8 GPUs): the same train_step, an eighth of the
    CPU time."""
    runtime = dataclasses.replace(runtime_for(args), grad_accum_steps=1)
    return tg.build_trainer(args, runtime, tg.log_path(args, args.run_id))


def liven(model, seed=0):
    """Small random values in the zero-initialised matrices (lm_head, output projections, gates) and the smear
    lambda, so that the first step's gradients reach every parameter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if torch.count_nonzero(p) == 0:
                p.copy_(torch.randn(p.shape, generator=g).mul(0.02))
            elif name.endswith("qkvo_w"):
                d = p.size(1)
                p[3 * d:] = torch.randn(d, d, generator=g).mul(0.02)
        model.scalars[5 * len(model.blocks)] = 0.3


def train_steps(trainer, steps=2):
    """`steps` training steps of the first stage (step 0: NorMuon; step 1: DistAdam and NorMuon). Returns the losses
    and the names of the parameters they changed."""
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    stage = tg.stages(trainer.args)[0]
    trainer.model.yarn.set_window(stage.ws_long)
    batches = trainer.new_batches(stage.batch_size)
    losses = [trainer.train_step(step, batches, None, stage.ws_short, stage.ws_long, 1).item() for step in range(steps)]
    changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[name])}
    return losses, changed


def assert_trains(trainer, steps=2):
    liven(trainer.model)
    losses, changed = train_steps(trainer, steps)
    assert all(math.isfinite(loss) for loss in losses), losses
    assert changed == {name for name, _ in trainer.model.named_parameters()}


# ----------------------------------------------------------------------------------------------------
# --kernels: the plain functions, their fused twins, and the fingerprints that tie them
# ----------------------------------------------------------------------------------------------------

CPU_NOTE = "kernels: no fused kernel runs on the cpu: the plain functions, as --kernels plain"


def test_on_the_cpu_kernels_fused_runs_every_plain_function_with_one_note_and_plain_with_none():
    assert tg.resolve_kernels("fused", "cpu", fp8=False) == (PLAIN, [CPU_NOTE])
    assert tg.resolve_kernels("plain", "cpu", fp8=False) == (PLAIN, [])
    runtime = runtime_for(tg.parse_args(["--smoke", "--device", "cpu"]))
    assert runtime.kernels == PLAIN and runtime.kernel_notes == (CPU_NOTE,) and runtime.fused == "none"


@pytest.mark.parametrize("name", list(tg.FUSED_KERNELS))
def test_a_listed_fused_kernel_that_cannot_run_here_is_a_one_line_error_naming_it(name):
    with pytest.raises(tg.ConfigError) as e:
        runtime_for(tg.parse_args(["--smoke", "--device", "cpu", "--kernels", name]))
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"--kernels: the fused {name} kernel cannot run here (RuntimeError: it needs a CUDA GPU)")
    assert message.endswith("leave it out of --kernels, use --kernels plain, or ./run.sh setup-gpu for "
                            "FlashAttention-4 and quack")


def test_kernels_takes_fused_plain_or_a_list_of_the_fused_kernels_names():
    assert tg.parse_kernels("fused") == set(tg.FUSED_KERNELS) and tg.parse_kernels("plain") == set()
    assert tg.parse_kernels("mlp, lm_head_loss") == {"mlp", "lm_head_loss"}
    for bad in ("", "fa4", "mlp,fa4", ",", "Plain"):
        assert tg.parse_kernels(bad) is None, bad
    with pytest.raises(tg.ConfigError, match="--kernels must be fused, plain or a comma-separated list of attention, "
                                             "mlp, attention_output, lm_head_loss; got 'mlp,fa4'"):
        tg.parse_args(["--kernels", "mlp,fa4"])


def test_a_kernels_request_that_cannot_run_exits_2_with_one_line(main, tmp_path):
    # through main() in this process (test_cli_and_errors.py runs such refusals as a script too)
    line = refused(main(["--smoke", "--device", "cpu", "--kernels", "mlp", "--check-flags"]))
    assert line == ("error: --kernels: the fused mlp kernel cannot run here (RuntimeError: it needs a CUDA GPU); leave "
                    "it out of --kernels, use --kernels plain, or ./run.sh setup-gpu for FlashAttention-4 and quack")
    assert list(tmp_path.iterdir()) == []


def test_the_pinned_fingerprints_are_those_of_the_current_plain_functions():
    # The pinned value is the specification of what each fused kernel computes: the code of these plain functions,
    # as they were when the kernel was last checked against them (the kernel tests in test_model.py, test_fp8.py and
    # test_mlp_kernels.py compare each fused twin with its plain function). Changing a plain function is changing the
    # specification: update the fused kernel, check it against the new function, then pin the new fingerprint.
    for name, kernel in tg.FUSED_KERNELS.items():
        assert kernel.plain in kernel.follows, name
        assert tg.code_fingerprint(*kernel.follows) == kernel.fingerprint, name
    assert [fn.__name__ for fn in tg.FUSED_KERNELS["attention"].follows] == ["attention", "rotary", "norm",
                                                                              "flash_attention", "scale_and_window"]
    assert [fn.__name__ for fn in tg.FUSED_KERNELS["lm_head_loss"].follows] == ["lm_head_loss", "softcap",
                                                                                 "lm_head_fp8"]


def load_module(path, source):
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_comment_docstring_or_layout_edit_keeps_the_fingerprint_and_a_code_edit_changes_it(tmp_path):
    header = "import torch.nn.functional as F\nfrom torch import Tensor\n\n\n"
    restyled = load_module(tmp_path / "restyled.py", header + (
        "def mlp(x: Tensor, w_fc: Tensor,\n"
        "        w_proj: Tensor) -> Tensor:\n"
        "    '''Another docstring.'''\n"
        "    # a comment, and the expression split over lines\n"
        "    return (F.relu(F.linear(x, w_fc))\n"
        "            .square() @ w_proj)\n"))
    edited = load_module(tmp_path / "edited.py", header + (
        "def mlp(x: Tensor, w_fc: Tensor, w_proj: Tensor) -> Tensor:\n"
        "    return F.gelu(F.linear(x, w_fc)) @ w_proj\n"))
    assert tg.code_fingerprint(restyled.mlp) == tg.FUSED_KERNELS["mlp"].fingerprint
    assert tg.code_fingerprint(edited.mlp) != tg.FUSED_KERNELS["mlp"].fingerprint


def runs_here(kernel: tg.FusedKernel) -> tg.FusedKernel:
    """The kernel as on a GPU that runs it in full (faked): its check passes and it has no note for the log."""
    return dataclasses.replace(kernel, check_here=lambda fp8: None, note_here=None)


@pytest.mark.parametrize("name", list(tg.FUSED_KERNELS))
def test_an_edited_plain_function_makes_fused_and_a_list_naming_it_refuse_where_the_kernel_would_run(monkeypatch,
                                                                                                     name):
    """Where the fused kernel runs (a GPU that passes its check, faked), fused and a list naming it refuse the edit
    with the --kernels plain message; where it cannot run, the edit is no reason to refuse: fused takes the plain
    functions (on the CPU with its one note, on a GPU with the kernel's), a list naming it says it cannot run here."""
    kernel = tg.FUSED_KERNELS[name]
    monkeypatch.setitem(tg.FUSED_KERNELS, name, dataclasses.replace(runs_here(kernel), fingerprint="000000000000"))
    edited = ", ".join(fn.__name__ for fn in kernel.follows)
    for requested in ("fused", name):
        with pytest.raises(tg.ConfigError) as e:
            tg.resolve_kernels(requested, "cuda", fp8=True)
        message = str(e.value)
        assert "\n" not in message
        assert message.startswith(f"the fused {name} kernel computes {edited} as written when it was made, and "
                                  f"that code has changed: run with --kernels plain (or leave {name} out of "
                                  f"--kernels), or update the fused kernel and FUSED_KERNELS['{name}'].fingerprint"), \
            message
    assert tg.resolve_kernels("fused", "cpu", fp8=True) == (PLAIN, [CPU_NOTE])
    with pytest.raises(tg.ConfigError, match=f"the fused {name} kernel cannot run here \\(RuntimeError: it needs a "
                                             "CUDA GPU\\)"):
        tg.resolve_kernels(name, "cpu", fp8=True)

    def cannot(fp8):
        raise RuntimeError("not on this GPU")

    monkeypatch.setitem(tg.FUSED_KERNELS, name, dataclasses.replace(tg.FUSED_KERNELS[name], check_here=cannot))
    chosen, notes = tg.resolve_kernels("fused", "cuda", fp8=True)
    assert chosen[name] is kernel.plain and f"kernels: plain {name} (not on this GPU)" in notes
    assert tg.resolve_kernels("plain", "cpu", fp8=False) == (PLAIN, [])
    others = [n for n in tg.FUSED_KERNELS if n != name]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for n in others:  # the other fused kernels stay available where they can run
        monkeypatch.setitem(tg.FUSED_KERNELS, n, runs_here(tg.FUSED_KERNELS[n]))
    chosen, notes = tg.resolve_kernels(",".join(others), "cuda", fp8=True)
    assert chosen == dict({n: tg.FUSED_KERNELS[n].fused for n in others}, **{name: kernel.plain}) and notes == []


def test_where_the_gpu_runs_every_fused_kernel_fused_chooses_them_all(monkeypatch):
    for name, kernel in tg.FUSED_KERNELS.items():
        monkeypatch.setitem(tg.FUSED_KERNELS, name, runs_here(kernel))
    chosen, notes = tg.resolve_kernels("fused", "cuda", fp8=True)
    assert chosen == {name: kernel.fused for name, kernel in tg.FUSED_KERNELS.items()} and notes == []
    assert chosen == {"attention": tg.fused_attention, "mlp": tg.fused_mlp,
                      "attention_output": tg.fused_attention_output, "lm_head_loss": tg.fused_lm_head_loss}


def test_a_fused_kernel_that_runs_in_a_lesser_way_says_so_in_one_line(monkeypatch):
    """FlashAttention-4 of another version than the one whose backward preprocess the attention gate's backward
    does: the fused attention still runs, FA4 runs its own preprocess, and the log says so once, naming both."""
    for name, kernel in tg.FUSED_KERNELS.items():
        monkeypatch.setitem(tg.FUSED_KERNELS, name, runs_here(kernel))
    monkeypatch.setitem(tg.FUSED_KERNELS, "attention",
                        dataclasses.replace(tg.FUSED_KERNELS["attention"], note_here=tg.fa4_preprocess_note))
    monkeypatch.setattr(tg, "fa4_preprocess_replaceable", lambda: False)
    import importlib.metadata
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "4.0.0b99")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (10, 0))
    chosen, notes = tg.resolve_kernels("fused", "cuda", fp8=True)
    assert chosen["attention"] is tg.fused_attention
    assert notes == ["kernels: attention: FlashAttention-4 runs its own backward preprocess (the attention gate's "
                     f"backward does its work for {tg.FA4_PREPROCESS_VERSION} on Hopper only; this is 4.0.0b99, "
                     "compute capability 10.0)"], notes
    monkeypatch.setattr(tg, "fa4_preprocess_replaceable", lambda: True)
    assert tg.resolve_kernels("fused", "cuda", fp8=True)[1] == []


def test_where_the_gpu_cannot_run_a_fused_kernel_fused_keeps_its_plain_function_and_says_why(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    kernel = tg.FUSED_KERNELS["mlp"]
    monkeypatch.setitem(tg.FUSED_KERNELS, "mlp", runs_here(kernel))
    chosen, notes = tg.resolve_kernels("fused", "cuda", fp8=False)  # the fused head is the FP8 one
    assert chosen["mlp"] is tg.fused_mlp and chosen["lm_head_loss"] is tg.lm_head_loss
    assert any(note.startswith("kernels: plain lm_head_loss (") and "--fp8" in note for note in notes), notes


# ----------------------------------------------------------------------------------------------------
# (a) a new MLP activation
# ----------------------------------------------------------------------------------------------------

def gelu_mlp(x, w_fc, w_proj):
    """A speedrunner's edit of `mlp`: GELU instead of ReLU²."""
    return F.gelu(F.linear(x, w_fc)) @ w_proj


@pytest.fixture
def edited_mlp(monkeypatch):
    # What editing `def mlp` in train_gpt.py does: the module's mlp, the plain function FUSED_KERNELS holds and the
    # code its fused kernel follows all become the new function; the pinned fingerprint stays the old one.
    monkeypatch.setattr(tg, "mlp", gelu_mlp)
    kernel = tg.FUSED_KERNELS["mlp"]
    monkeypatch.setitem(tg.FUSED_KERNELS, "mlp", dataclasses.replace(kernel, plain=gelu_mlp, follows=(gelu_mlp,)))


def test_a_new_mlp_activation_trains_with_the_plain_functions_and_fused_refuses_it_where_it_would_run(
        edited_mlp, data, tmp_path, monkeypatch):
    for n, k in tg.FUSED_KERNELS.items():  # a GPU that runs every fused kernel (faked)
        monkeypatch.setitem(tg.FUSED_KERNELS, n, runs_here(k))
    for requested in ("fused", "mlp,lm_head_loss"):
        with pytest.raises(tg.ConfigError, match=r"the fused mlp kernel computes gelu_mlp as written when it was made, "
                                                 r"and that code has changed: run with --kernels plain"):
            tg.resolve_kernels(requested, "cuda", fp8=True)
    runtime = runtime_for(tiny_args(data, tmp_path))  # --kernels fused on the CPU: the plain functions, the edit too
    assert runtime.kernels["mlp"] is gelu_mlp and runtime.kernel_notes == (CPU_NOTE,)
    trainer = build(tiny_args(data, tmp_path, "--kernels", "plain"))
    assert trainer.model.kernels["mlp"] is gelu_mlp
    outputs = []

    def check(module, inputs, out):
        x = inputs[0]
        outputs.append(torch.allclose(out, F.gelu(F.linear(x, module.c_fc.type_as(x))) @ module.c_proj.type_as(x)))

    hooks = [block.mlp.register_forward_hook(check) for block in trainer.model.blocks if block.mlp is not None]
    assert_trains(trainer)
    for hook in hooks:
        hook.remove()
    assert len(outputs) == 2 * 11 and all(outputs)  # every MLP of both steps computed GELU
    assert " kernels=plain fused=none " in trainer.log.path.read_text()


# ----------------------------------------------------------------------------------------------------
# (b) a new gate
# ----------------------------------------------------------------------------------------------------

class InputGatedAttention(tg.CausalSelfAttention):
    """A speedrunner's new gate: a sigmoid per head and token, read off the block input's first GATE_INPUTS channels
    as attn_gate is, scaling that head's slice of the attention's input. `label` and `treatment` are what the edit
    passes to set_optimizer_label (label None: it forgot to)."""
    label, treatment = None, "gate"

    def __init__(self, dim, num_heads, head_dim):
        super().__init__(dim, num_heads, head_dim)
        self.input_gate = nn.Linear(tg.GATE_INPUTS, num_heads, bias=False)
        nn.init.zeros_(self.input_gate.weight)
        if self.label is not None:
            tg.set_optimizer_label(self.input_gate.weight, self.label, self.treatment)

    def forward(self, x, *rest):
        T = x.size(0)
        gate = 2 * torch.sigmoid(F.linear(tg.gate_input(x), self.input_gate.weight))  # (T, heads): 1 at init
        return super().forward((x.view(T, self.num_heads, -1) * gate.unsqueeze(-1)).view(T, -1), *rest)


def with_gate(monkeypatch, label, treatment="gate"):
    monkeypatch.setattr(tg, "CausalSelfAttention",
                        type("Edited", (InputGatedAttention,), dict(label=label, treatment=treatment)))


def test_a_new_parameter_without_an_optimizer_label_is_one_line_naming_it_and_every_treatment(monkeypatch, data,
                                                                                             tmp_path):
    with_gate(monkeypatch, None)
    args = tiny_args(data, tmp_path)
    with pytest.raises(tg.ConfigError) as e:
        build(args)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("parameter blocks.1.attn.input_gate.weight has no optimizer label: give it both where "
                              "it is made, set_optimizer_label(p, LABEL, TREATMENT), LABEL naming its group and "
                              "TREATMENT one of matrix (")
    assert all(f"{treatment} ({what})" in message for treatment, what in tg.TREATMENTS.items())
    assert not tg.log_path(args, "edit").exists()  # a model that cannot be built writes no log


@pytest.mark.parametrize("label,treatment,other", [("mlp", "gate", ("blocks.1.mlp.c_fc", "matrix")),
                                                   ("attn_gate", "matrix", ("blocks.1.attn.attn_gate.weight", "gate"))])
def test_a_new_gate_under_a_label_that_has_another_treatment_is_refused_naming_it(monkeypatch, data, tmp_path, label,
                                                                                  treatment, other):
    """A label is one group with one treatment: one line naming the gate and the first parameter met with the label
    (in named_parameters' order) and their treatments, which asks for a label of its own; never to make the label's
    other parameters gates, or the gates matrices. No log is written."""
    with_gate(monkeypatch, label, treatment)
    args = tiny_args(data, tmp_path)
    with pytest.raises(tg.ConfigError) as e:
        build(args)
    message = str(e.value)
    found = re.fullmatch(rf"parameter (\S+) has label '{label}' as (\w+), but (\S+) has it as (\w+): a label is one "
                         r"group with one treatment; give one of them another label", message)
    assert found, message
    assert {found.group(1, 2), found.group(3, 4)} == {("blocks.1.attn.input_gate.weight", treatment), other}
    assert "NORMUON_GATE_LABELS" not in message and "add it there" not in message
    assert not tg.log_path(args, "edit").exists()


def test_a_new_gate_declared_a_matrix_under_its_own_label_is_normalised_as_a_wide_matrix(monkeypatch, data, tmp_path):
    """Its name says gate, but the treatment decides: one second moment per column of the wide (heads, 12) matrix."""
    with_gate(monkeypatch, "input_gate", "matrix")
    trainer = build(tiny_args(data, tmp_path))
    plan = optimizer_plan(trainer.model, 1)
    assert plan["blocks.1.attn.input_gate.weight"] == ("NorMuon input_gate", "matrix, second moment per column")
    assert plan["blocks.1.attn.attn_gate.weight"] == ("NorMuon attn_gate", "gate, second moment per row")
    dims = {group["label"]: layout["reduce_dim"] for group, layout in zip(trainer.muon.param_groups,
                                                                          trainer.muon._layout)}
    assert dims["input_gate"] == -2 and dims["attn_gate"] == -1


@pytest.mark.parametrize("label", ["attn_gate", "input_gate"])
def test_a_labelled_new_gate_trains_and_normuon_logs_how_it_groups_the_matrices(monkeypatch, data, tmp_path, label):
    """A gate labelled attn_gate, or under a new label of its own, treated as a gate, trains with the default
    --kernels fused (the gate sits outside every fused kernel), one second moment per row; the matrices now differ
    from the record's, and NorMuon's grouping note, in the log, says how they are grouped."""
    with_gate(monkeypatch, label)
    trainer = build(tiny_args(data, tmp_path))
    gates = [b.attn.input_gate.weight for b in trainer.model.blocks if b.attn is not None]
    assert len(gates) == 10 and all(p.label == label and p.treatment == "gate" for p in gates)
    note = trainer.muon.grouping_note
    assert note.startswith("NorMuon: the matrices differ from the record's (")
    assert ("attn_gate 20" if label == "attn_gate" else "input_gate 10") in note  # the counts here
    assert ("attn_gate (20)" if label == "attn_gate" else "input_gate (10)") in note  # and the groups
    assert note in trainer.log.path.read_text().splitlines()
    for group, layout in zip(trainer.muon.param_groups, trainer.muon._layout):
        if any(p is gates[0] for p in group["params"]):
            assert layout["reduce_dim"] == -1  # a gate's statistics: one per row
    assert_trains(trainer)


# ----------------------------------------------------------------------------------------------------
# (c) a schedule shape
# ----------------------------------------------------------------------------------------------------

def test_a_four_stage_schedule_warms_up_and_trains_through_every_stage(data, tmp_path):
    args = tiny_args(data, tmp_path, "--train-bs-schedule", "64,64,128,128", "--ws-schedule", "2,4,6,8",
                     "--lr-plateaus", "1,1.2,1.4,1.5", "--lr-plateau-starts", "0,0.25,0.5,0.75",
                     "--train-bs-extension", "128", "--ws-final", "10", "--ws-validate-post-yarn-ext", "12",
                     "--num-scheduled-iterations", "8", "--num-extension-iterations", "1", "--val-loss-every", "0")
    table = [(s.name, s.first_step, s.batch_size, s.ws_short, s.ws_long) for s in tg.stages(args)]
    assert table == [("stage 1", 0, 64, 1, 2), ("stage 2", 2, 64, 2, 4), ("stage 3", 4, 128, 3, 6),
                     ("stage 4", 6, 128, 4, 8), ("extension", 8, 128, 5, 10)]
    trainer = build(args)
    trainer.warm_up_kernels()
    assert [label for label, _ in trainer.warm_up_times] == \
        [f"train eager batch {bs} window {long}" for _, _, bs, _, long in table] + \
        [f"eval windows {short},{long}" for short, long in [(1, 2), (2, 4), (3, 6), (4, 8), (5, 10), (5, 12)]]
    result = trainer.train()
    assert result.steps == 9 and math.isfinite(result.val_loss)
    log = trainer.log.path.read_text().splitlines()
    for name, first, bs, short, long in table:
        assert any(line.startswith(f"schedule: step {first} {name}: batch {bs} windows ({short}, {long}) ")
                   for line in log), name
    assert log[-1].startswith("step:9/9 val_loss:")


# ----------------------------------------------------------------------------------------------------
# (d) new orthogonalizer coefficients
# ----------------------------------------------------------------------------------------------------

def test_turbo_muons_coefficients_are_polar_expresss_after_the_iterations_aol_replaces(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "2000")  # --help unwrapped
    assert tg.TURBO_MUON_COEFFS == tg.POLAR_EXPRESS_COEFFS[tg.TURBO_SKIPPED_ITERATIONS:]
    with pytest.raises(SystemExit):
        tg.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert (f"Polar Express ({len(tg.POLAR_EXPRESS_COEFFS)} steps) or Turbo-Muon ({len(tg.TURBO_MUON_COEFFS)})"
            in text)


def test_new_orthogonalizer_coefficients_reach_both_orthogonalizers_help_and_a_training_step(
        monkeypatch, capsys, data, tmp_path):
    monkeypatch.setenv("COLUMNS", "2000")  # --help unwrapped
    # Editing POLAR_EXPRESS_COEFFS in train_gpt.py changes Turbo-Muon's table too (it is derived at import): one more
    # iteration, the quintic p(s) = 1.875s - 1.25s³ + 0.375s⁵ that pulls every singular value towards 1.
    coeffs = tg.POLAR_EXPRESS_COEFFS + ((1.875, -1.25, 0.375),)
    G = torch.randn(6, 32, 96, generator=torch.Generator().manual_seed(0))
    before = [torch.linalg.svdvals(tg.polar_express(G, turbo).double()) for turbo in (False, True)]
    monkeypatch.setattr(tg, "POLAR_EXPRESS_COEFFS", coeffs)
    monkeypatch.setattr(tg, "TURBO_MUON_COEFFS", coeffs[tg.TURBO_SKIPPED_ITERATIONS:])
    after = [torch.linalg.svdvals(tg.polar_express(G, turbo).double()) for turbo in (False, True)]
    for old, new in zip(before, after):
        assert (old - 1).abs().max() > 0.05 and (new - 1).abs().max() < 0.02
    with pytest.raises(SystemExit):
        tg.parse_args(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Polar Express (6 steps) or Turbo-Muon (5)" in help_text
    for orthogonalizer in ("polar", "turbo"):
        trainer = build(tiny_args(data, tmp_path, "--orthogonalizer", orthogonalizer, "--run-id", orthogonalizer))
        assert trainer.muon.turbo == (orthogonalizer == "turbo")
        assert_trains(trainer)


def test_the_fused_head_refuses_a_softcap_its_log_sum_exp_cannot_hold(monkeypatch):
    # The fused forward sums exp(SOFTCAP * s) over 50304 logits without a max pass: past SOFTCAP 60 that sum can
    # overflow fp32, so the fused head refuses, and --kernels fused falls back to (or a list names) the plain head.
    monkeypatch.setattr(tg.torch.cuda, "is_available", lambda: True)
    check = tg.FUSED_KERNELS["lm_head_loss"].check_here
    check(True)  # the record's SOFTCAP 30 runs
    monkeypatch.setattr(tg, "SOFTCAP", 100.0)
    with pytest.raises(RuntimeError, match="overflows fp32 past SOFTCAP 60 \\(it is 100.0\\)"):
        check(True)
