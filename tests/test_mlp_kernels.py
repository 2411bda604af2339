"""The ReLU² MLP's kernel choice: quack's fused GEMM op (wired through a float64 stand-in for quack here) against
the Inductor formula, its fakes for torch.compile, the opt-in dispatch with its one-line errors, and quack's
prepared plans (the MLP's GEMMs and the attention projections' gemm_add)."""
import dataclasses
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg


class _ReferenceQuack:
    """quack.gemm_interface's two entry points with its documented semantics, in plain torch (any dtype)."""
    calls = []

    @staticmethod
    def gemm_act(A, B, activation=None, tuned=True, config=None):
        _ReferenceQuack.calls.append(("act", activation, tuned, tuple(B.shape), config))
        pre = A @ B
        return pre, F.relu(pre).square()

    @staticmethod
    def gemm_dact(A, B, PreAct, activation=None, tuned=True, config=None):
        _ReferenceQuack.calls.append(("dact", activation, tuned, tuple(B.shape), config))
        return (A @ B) * 2 * F.relu(PreAct), F.relu(PreAct).square()


@pytest.fixture
def stand_in_quack(monkeypatch):
    monkeypatch.setattr(tg, "quack_gemm", lambda: _ReferenceQuack)
    _ReferenceQuack.calls = []
    return _ReferenceQuack


def mlp_inputs(T=37, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
            for shape in ((T, d), (4 * d, d), (4 * d, d))]


def test_quack_mlp_op_gives_the_inductor_formulas_output_and_all_three_gradients(stand_in_quack):
    x, w_fc, w_proj = mlp_inputs()
    out = torch.ops.speedrun.relu2_mlp(x, w_fc, w_proj)[0]
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w_fc, w_proj), grad)
    ref_out = F.relu(x @ w_fc.T).square() @ w_proj
    ref = torch.autograd.grad(ref_out, (x, w_fc, w_proj), grad)
    torch.testing.assert_close(out, ref_out)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    # quack gets B as (K, N) views of the (4d, d) weights, no autotune at start-up, and off Hopper quack's own config
    assert stand_in_quack.calls == [("act", "relu_sq", False, (8, 32), None), ("dact", "relu_sq", False, (8, 32), None)]


def test_mlp_module_runs_the_kernel_it_was_built_with(stand_in_quack):
    torch.manual_seed(0)
    inductor, quack = tg.MLP(16, "inductor").double(), tg.MLP(16, "quack").double()
    quack.load_state_dict(inductor.state_dict())
    with torch.no_grad():
        inductor.c_proj.normal_()
        quack.c_proj.copy_(inductor.c_proj)
    x = torch.randn(10, 16, dtype=torch.float64)
    torch.testing.assert_close(quack(x), inductor(x))
    assert [c[0] for c in stand_in_quack.calls] == ["act"]


def test_quack_mlp_ops_trace_with_their_fakes_forward_and_backward():
    """What torch.compile sees (symbolic token count included): shapes and dtypes without running quack."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x, w_fc, w_proj = (torch.randn(*s, dtype=torch.bfloat16, requires_grad=True) for s in ((50, 8), (32, 8), (32, 8)))
        out, pre = torch.ops.speedrun.relu2_mlp(x, w_fc, w_proj)
        grads = torch.autograd.grad(out.sum(), (x, w_fc, w_proj))
    assert out.shape == (50, 8) and pre.shape == (50, 32) and out.dtype == torch.bfloat16
    assert [g.shape for g in grads] == [x.shape, w_fc.shape, w_proj.shape]


def test_mlp_kernel_auto_falls_back_to_inductor_where_quack_cannot_run_and_a_quack_request_is_refused(monkeypatch):
    assert tg.Hyperparameters().mlp_kernel == "auto"
    assert tg.resolve_mlp_kernel("inductor", "cpu") == "inductor"
    assert tg.resolve_mlp_kernel("auto", "cpu") == "inductor"
    with pytest.raises(tg.ConfigError, match="--mlp-kernel quack unavailable .*needs a CUDA GPU"):
        tg.resolve_mlp_kernel("quack", "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setitem(sys.modules, "quack", None)  # not installed
    tg.quack_gemm.cache_clear()
    assert tg.resolve_mlp_kernel("auto", "cuda") == "inductor"
    with pytest.raises(tg.ConfigError, match="pip install quack-kernels"):
        tg.resolve_mlp_kernel("quack", "cuda")
    tg.quack_gemm.cache_clear()


def test_mlp_kernel_auto_picks_quack_where_it_imports_on_hopper_but_not_on_ampere(monkeypatch):
    fake = types.ModuleType("quack.gemm_interface")
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", fake)
    tg.quack_gemm.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert tg.resolve_mlp_kernel("auto", "cuda") == "quack"
    assert tg.resolve_mlp_kernel("quack", "cuda") == "quack"
    assert tg.resolve_mlp_kernel("inductor", "cuda") == "inductor"  # forced off
    assert tg.quack_gemm() is fake
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    assert tg.resolve_mlp_kernel("auto", "cuda") == "inductor"
    with pytest.raises(tg.ConfigError, match="compute capability 9.x or 10.x"):
        tg.resolve_mlp_kernel("quack", "cuda")
    tg.quack_gemm.cache_clear()


def test_run_config_names_the_mlp_kernel_that_ran():
    args = tg.parse_args(["--device", "cpu", "--smoke"])
    rt = tg.resolve_runtime(args, env={})
    assert rt.mlp_kernel == "inductor"
    assert " mlp_kernel=inductor " in rt.config_line(args)


class _ReferenceEpilogueMods:
    """quack.epilogue.library's two mods as the trainer uses them: plan() once per signature (counted), whose
    run() computes the GEMM and its epilogue into the given outputs."""
    plans = []

    class Mod:
        def __init__(self, kind):
            self.kind = kind

        def plan(self, A, B, C=None, *, out, dynamic_scheduler=False, config=None):
            _ReferenceEpilogueMods.plans.append((self.kind, tuple(A.shape), tuple(B.shape), dynamic_scheduler, config))
            kind = self.kind

            class Plan:
                @staticmethod
                def run(A, B, C=None, *, out, tile_count_semaphore=None):
                    acc = A @ B
                    if kind == "act":
                        out["D"].copy_(acc)
                        out["mAuxOut"].copy_(F.relu(acc).square())
                    else:
                        out["D"].copy_(acc * 2 * F.relu(C))
                        out["mAuxOut"].copy_(F.relu(C).square())
            return Plan()

    @staticmethod
    def linear_act_mod(activation, *, gated, has_c, has_rowvec, has_colvec, sr=False, has_alpha=False):
        assert (activation, gated, has_c, has_rowvec, has_colvec, sr, has_alpha) == \
            ("relu_sq", False, False, False, False, False, False)
        return _ReferenceEpilogueMods.Mod("act")

    @staticmethod
    def dact_mod(activation, *, has_scale=False, has_reduce=False):
        assert (activation, has_scale, has_reduce) == ("relu_sq", False, False)
        return _ReferenceEpilogueMods.Mod("dact")


@pytest.fixture
def quack_plans(monkeypatch, stand_in_quack):
    library = types.ModuleType("quack.epilogue.library")
    library.linear_act_mod = _ReferenceEpilogueMods.linear_act_mod
    library.dact_mod = _ReferenceEpilogueMods.dact_mod
    for name, module in (("quack", types.ModuleType("quack")), ("quack.epilogue", types.ModuleType("quack.epilogue")),
                         ("quack.epilogue.library", library)):
        monkeypatch.setitem(sys.modules, name, module)
    plans = tg.QuackPlans()
    plans.enabled = True
    monkeypatch.setattr(tg, "QUACK_PLANS", plans)
    _ReferenceEpilogueMods.plans = []
    return plans


def quack_mlp_forward_backward(x, w_fc, w_proj, grad):
    x, w_fc, w_proj = (t.detach().requires_grad_() for t in (x, w_fc, w_proj))
    out = torch.ops.speedrun.relu2_mlp(x, w_fc, w_proj)[0]
    return (out.detach(), *torch.autograd.grad(out, (x, w_fc, w_proj), grad))


def test_quack_plans_give_the_interfaces_results_with_one_plan_per_gemm_and_shape(quack_plans, stand_in_quack):
    """--quack-plans: the MLP op's fused GEMMs go through quack's prepared plans, built once per signature (a new
    token count builds new ones), and give what quack's interface functions give on every new input."""
    for seed, T in ((0, 37), (1, 37), (2, 37), (3, 20)):
        x, w_fc, w_proj = mlp_inputs(T=T, seed=seed)
        grad = torch.randn(T, 8, dtype=torch.float64)
        got = quack_mlp_forward_backward(x, w_fc, w_proj, grad)
        quack_plans.enabled = False
        want = quack_mlp_forward_backward(x, w_fc, w_proj, grad)
        quack_plans.enabled = True
        for a, b in zip(got, want):
            assert torch.equal(a, b)
    # B as (K, N) views of the weights; the backward GEMM with quack's default dynamic scheduler; no config off Hopper
    assert _ReferenceEpilogueMods.plans == [
        ("act", (37, 8), (8, 32), False, None), ("dact", (37, 8), (8, 32), True, None),
        ("act", (20, 8), (8, 32), False, None), ("dact", (20, 8), (8, 32), True, None)]
    assert [c[0] for c in stand_in_quack.calls] == ["act", "dact"] * 4  # only the reference passes


def test_quack_plans_is_on_by_default_with_quacks_mlp_only(monkeypatch):
    """The flag is on by default, takes effect with quack's MLP only, and the Run config line says which."""
    assert tg.parse_args([]).quack_plans is True
    cpu = ["--device", "cpu", "--compile", "off"]
    monkeypatch.setattr(tg, "resolve_mlp_kernel", lambda requested, device: "quack")
    rt = tg.resolve_runtime(tg.parse_args(cpu), env={})
    assert rt.quack_plans and "quack_plans=1" in rt.config_line(tg.parse_args(cpu))
    assert not tg.resolve_runtime(tg.parse_args(cpu + ["--quack-plans", "false"]), env={}).quack_plans
    monkeypatch.setattr(tg, "resolve_mlp_kernel", lambda requested, device: "inductor")
    assert not tg.resolve_runtime(tg.parse_args(cpu), env={}).quack_plans


class _ReferenceGemmAdd:
    """quack's gemm_add entry points as QuackPlans.gemm_add uses them: the interface function, its untuned path
    (launches, then returns config, split K, dynamic scheduler and the dispatch layer's plan) and the dispatch
    layer's run_gemm_plan. Every call is recorded; what it returns is set per test."""

    def __init__(self, swap_ab=False, split_k=1, dynamic_scheduler=False):
        self.calls = []
        self.decisions = (types.SimpleNamespace(swap_ab=swap_ab), split_k, dynamic_scheduler)
        self.gemm_tuned = types.SimpleNamespace(fn=self._tuned_fn)

    def gemm_add(self, A, B, C, tuned=True):
        self.calls.append(("interface", tuple(A.shape), tuned))
        return C + A @ B

    def _tuned_fn(self, A, B, out, C, config=None):
        self.calls.append(("tuned_fn", tuple(A.shape), config))
        out.copy_(C + A @ B)
        return (*self.decisions, ("plan", tuple(A.shape)))

    def run_gemm_plan(self, plan, A, B, D, C):
        assert plan == ("plan", tuple(A.shape))  # the plan made for this signature
        self.calls.append(("replay", tuple(A.shape)))
        D.copy_(C + A @ B)


@pytest.fixture
def gemm_add_plans(monkeypatch):
    def make(version="0.6.5", capability=(9, 0), **decisions):
        quack = _ReferenceGemmAdd(**decisions)
        monkeypatch.setattr(tg, "quack_gemm", lambda: quack)
        monkeypatch.setattr(tg, "quack_dispatch", lambda: quack)
        monkeypatch.setattr(tg, "quack_version", lambda: version)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
        plans = tg.QuackPlans()
        plans.enabled = True
        return plans, quack
    return make


def gemm_add_inputs(T, seed, k=12, n=8):
    g = torch.Generator().manual_seed(seed)
    y, w_out, c = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((T, k), (n, k), (T, n)))
    return y, w_out.mT, c  # w as the (k, n) view of an (n, k) weight, as residual_linear passes it


def test_quack_plans_replay_gemm_add_from_its_dispatch_plan_after_one_interface_call_per_shape(gemm_add_plans):
    """--quack-plans with gemm_add: the first call of each signature runs quack's untuned path (which returns its
    dispatch plan); later calls launch that plan directly; every result is c + y w, as the interface gives."""
    plans, quack = gemm_add_plans()
    for seed, T in ((0, 37), (1, 37), (2, 37), (3, 20), (4, 20)):
        y, w, c = gemm_add_inputs(T, seed)
        torch.testing.assert_close(plans.gemm_add(y, w, c), c + y @ w, rtol=0, atol=0)
    assert quack.calls == [("tuned_fn", (37, 12), None), ("replay", (37, 12)), ("replay", (37, 12)),
                           ("tuned_fn", (20, 12), None), ("replay", (20, 12))]
    assert plans.summary() == "quack plans: 0 fused MLP GEMM signatures, gemm_add replayed for 2 of 2"
    plans.enabled = False
    y, w, c = gemm_add_inputs(37, 5)
    torch.testing.assert_close(plans.gemm_add(y, w, c), c + y @ w, rtol=0, atol=0)
    assert quack.calls[-1] == ("interface", (37, 12), False)  # off: quack's interface, untuned


@pytest.mark.parametrize("setting, reason", [
    (dict(version="0.7.0"), "quack 0.7.0 is not the release the replay was checked with"),
    (dict(capability=(8, 0)), "the GPU is older than Hopper"),
    (dict(swap_ab=True), "swaps operands"), (dict(split_k=2), "splits K"),
    (dict(dynamic_scheduler=True), "schedules tiles dynamically")],
    ids=["other quack release", "pre-Hopper", "swapped operands", "split K", "dynamic scheduler"])
def test_quack_plans_call_gemm_add_every_time_where_quacks_warm_path_would_launch_differently(gemm_add_plans, setting,
                                                                                              reason):
    """Where quack's own warm path would not launch the plan with exactly these arguments (or with a quack release
    it was not checked against), every later call goes through the interface function, and the summary says why."""
    plans, quack = gemm_add_plans(**setting)
    for seed in range(3):
        y, w, c = gemm_add_inputs(16, seed)
        torch.testing.assert_close(plans.gemm_add(y, w, c), c + y @ w, rtol=0, atol=0)
    assert quack.calls == [("tuned_fn", (16, 12), None), ("interface", (16, 12), False),
                           ("interface", (16, 12), False)]
    assert "gemm_add replayed for 0 of 1 (the rest through quack's interface: " in plans.summary()
    assert reason in plans.summary()


def test_host_paths_line_names_what_the_library_shortcuts_cover_and_why_not(gemm_add_plans, monkeypatch):
    """The log line after the warm-up: FA4's recorded signatures with any refusal, and the quack plans' summary;
    nothing when neither shortcut is on."""
    plans, _ = gemm_add_plans(version="0.7.0")
    monkeypatch.setattr(tg, "QUACK_PLANS", plans)
    plans.gemm_add(*gemm_add_inputs(16, 0))
    replay = tg.KernelLaunchReplay(lambda: [], lambda: "flash-attn-4 9.9 is not checked")
    replay.enabled = True
    replay.run(lambda: torch.zeros(1), (torch.zeros(2),), ("forward",))
    monkeypatch.setattr(tg, "FA4_LAUNCHES", replay)
    rt = tg.resolve_runtime(tg.parse_args(["--device", "cpu", "--compile", "off"]), env={})
    assert tg.host_paths_line(rt) is None
    line = tg.host_paths_line(dataclasses.replace(rt, fa4_launch_replay=True, quack_plans=True))
    assert line == ("Host paths: FlashAttention-4 launches recorded for 1 signatures (not replayed: flash-attn-4 9.9 "
                    "is not checked), quack plans: 0 fused MLP GEMM signatures, gemm_add replayed for 0 of 1 (the "
                    "rest through quack's interface: quack 0.7.0 is not the release the replay was checked with)")
