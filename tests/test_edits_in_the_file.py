"""A speedrunner's edits made to the text of train_gpt.py itself: each edit is a list of (old, new) replacements, one
per place touched, applied to a copy of the file that is then imported. Each edited model trains two steps at W=1 on
the CPU and passes --check as rank 0 of 2 and of 8 processes, and every parameter it shares with the record keeps its
optimizer treatment and statistics (optimizer_plan), and its group unless the log says why it changed, so no edit
changes a treatment silently."""
import dataclasses
import importlib.util
import io
import math
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

import train_gpt as tg
from optimizer_plans import optimizer_plan
from dist_utils import launcher_env
from proxy_shards import build_shards
from test_speedrunner_edits import TINY as EDITS_TINY, one_thread  # noqa: F401  (one_thread: an autouse fixture)

SOURCE = Path(tg.__file__).read_text()
TINY = [*EDITS_TINY, "--num-scheduled-iterations", "6", "--num-extension-iterations", "0"]  # --check: data for 6 steps

C_PROJ = '        self.c_proj = set_optimizer_label(nn.Parameter(torch.zeros(4 * dim, dim)), "mlp", "matrix", ' \
    'lr_mul=2.0)\n'

# Each edit: (name, replacements, flags). A replacement's old text must occur exactly once in the file.
NEW_GATE = ("a new gate per block (the MLP's output, per token)", [
    (C_PROJ, C_PROJ +
     '        self.out_gate = set_optimizer_label(nn.Parameter(torch.zeros(1, GATE_INPUTS)), "mlp_gate", "gate")\n'),
    ('        return kernels["mlp"](x, self.c_fc.type_as(x), self.c_proj.type_as(x))\n',
     '        gate = 2 * torch.sigmoid(F.linear(gate_input(x), self.out_gate.type_as(x)))\n'
     '        return gate * kernels["mlp"](x, self.c_fc.type_as(x), self.c_proj.type_as(x))\n'),
], [])
BLOCK_SCALAR = ("a new scalar per block (the MLP's output scale)", [
    (C_PROJ, C_PROJ +
     '        self.scale = set_optimizer_label(nn.Parameter(torch.ones(1)), "mlp_scale", "adam", 5.0)\n'),
    ('        return kernels["mlp"](x, self.c_fc.type_as(x), self.c_proj.type_as(x))\n',
     '        return self.scale.type_as(x) * kernels["mlp"](x, self.c_fc.type_as(x), self.c_proj.type_as(x))\n'),
], [])
RENAMED_GATE = ("the attention gate renamed", [
    ("        self.attn_gate = nn.Linear(GATE_INPUTS, num_heads, bias=False)\n"
     "        nn.init.zeros_(self.attn_gate.weight)\n"
     '        set_optimizer_label(self.attn_gate.weight, "attn_gate", "gate")\n',
     "        self.head_gate = nn.Linear(GATE_INPUTS, num_heads, bias=False)\n"
     "        nn.init.zeros_(self.head_gate.weight)\n"
     '        set_optimizer_label(self.head_gate.weight, "attn_gate", "gate")\n'),
    ("F.linear(gate_input(x), self.attn_gate.weight)", "F.linear(gate_input(x), self.head_gate.weight)"),
], [])
GELU_MLP = ("a GELU MLP", [
    ("    return F.relu(F.linear(x, w_fc)).square() @ w_proj\n", "    return F.gelu(F.linear(x, w_fc)) @ w_proj\n"),
], [])
SIXTEEN_LAYERS = ("16 layers", [], ["--num-layers", "16"])
ELEVEN_LAYERS = ("11 layers", [], ["--num-layers", "11"])
EDITS = [NEW_GATE, BLOCK_SCALAR, RENAMED_GATE, GELU_MLP, SIXTEEN_LAYERS, ELEVEN_LAYERS]


def edited_module(tmp_path, name, replacements):
    source = SOURCE
    for old, new in replacements:
        assert source.count(old) == 1, f"{name}: {old!r} is not one place of train_gpt.py"
        source = source.replace(old, new)
    path = tmp_path / f"edited_{abs(hash(name))}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[path.stem]
        raise
    return module


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("file_edits") / "data"
    build_shards(folder, train_shards=1, tokens_per_train_shard=30_000, val_tokens=2_000)
    return folder


def two_steps_at_w1(module, args, tmp_path):
    """Two steps of the first stage with one micro-batch each, the zero-initialised parameters given small values
    first so that every parameter gets a gradient; returns the trainer and the parameters the steps left unchanged."""
    with launcher_env():
        runtime = dataclasses.replace(module.resolve_runtime(args), grad_accum_steps=1)
    trainer = module.build_trainer(args, runtime, module.log_path(args, args.run_id))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in trainer.model.named_parameters():
            if torch.count_nonzero(p) == 0 or name.endswith("qkvo_w"):
                p.add_(torch.randn(p.shape, generator=g).mul(0.02).to(p.dtype))
        trainer.model.scalars[5 * args.num_layers] = 0.3  # the smear lambda: else the smear gate gets no gradient
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    stage = module.stages(args)[0]
    trainer.model.yarn.set_window(stage.ws_long)
    batches = trainer.new_batches(stage.batch_size)
    losses = [trainer.train_step(step, batches, None, stage.ws_short, stage.ws_long, 1).item() for step in range(2)]
    assert all(math.isfinite(loss) for loss in losses), losses
    trainer.log.close()
    return trainer, {n for n, p in trainer.model.named_parameters() if torch.equal(p.detach(), before[n])}


def check_as_rank0_of(module, args, world_size):
    out = io.StringIO()
    with launcher_env(WORLD_SIZE=world_size, RANK=0, LOCAL_RANK=0, LOCAL_WORLD_SIZE=world_size), redirect_stdout(out):
        module.run(dataclasses.replace(args, check=True))
    return out.getvalue()


@pytest.mark.parametrize("edit", EDITS, ids=[e[0] for e in EDITS])
def test_an_edit_of_the_file_trains_at_w1_passes_check_at_w2_and_w8_and_keeps_every_other_treatment(edit, data,
                                                                                                 tmp_path):
    name, replacements, flags = edit
    assert len(replacements) <= 2  # the places a speedrunner touches, and no table besides
    module = edited_module(tmp_path, name, replacements)
    args = module.parse_args([*TINY, "--data-path", str(data), "--log-dir", str(tmp_path / "logs"), "--run-id", "e",
                              *flags])
    for world_size in (2, 8):
        assert check_as_rank0_of(module, args, world_size).startswith(f"check: ok: {world_size} process(es) on cpu")
    trainer, unchanged = two_steps_at_w1(module, args, tmp_path)
    assert unchanged == set()
    log = trainer.log.path.read_text()
    assert module.layer_map(args.num_layers).line() in log  # the map it ran with, in the log
    assert "kernels: no fused kernel runs on the cpu: the plain functions, as --kernels plain" in log
    for world_size in (2, 8):
        record = optimizer_plan(tg.GPT(dataclasses.replace(tg.parse_args(TINY), num_layers=args.num_layers), 64),
                                   world_size)
        plan = optimizer_plan(trainer.model, world_size, module)
        renamed = {n.replace("head_gate", "attn_gate"): v for n, v in plan.items()}
        assert {n: v[1] for n, v in renamed.items() if n in record} == {n: v[1] for n, v in record.items()}
        if "NorMuon: the matrices differ from the record's" not in log:  # else the log says how they are grouped
            assert {n: v for n, v in renamed.items() if n in record} == record
        new = {n: v for n, v in renamed.items() if n not in record}
        if edit is NEW_GATE:
            assert set(new.values()) == {("NorMuon mlp_gate", "gate, second moment per row")} and len(new) == 11
        elif edit is BLOCK_SCALAR:
            assert set(new.values()) == {("DistAdam mlp_scale", "adam, 1 rows per rank")} and len(new) == 11
        else:
            assert new == {}


def test_eleven_layers_follow_the_rule_and_a_count_it_does_not_cover_is_one_line_at_check():
    eleven = tg.layer_map(11)
    assert (eleven.skip_from, eleven.skip_to, eleven.backout_from, eleven.long_window) == (3, 6, 7, (3, 10))
    assert eleven.value_embeds == ((1, 1), (2, 2), (8, 0), (9, 1), (10, 2)) and eleven.num_scalars == 57
    with pytest.raises(tg.ConfigError) as e:
        tg.validate_args(tg.parse_args(["--num-layers", "8"]))
    assert "\n" not in str(e.value) and "edit layer_map()" in str(e.value)
