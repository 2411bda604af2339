"""The ReLU² MLP's kernel choice: quack's fused GEMM op (wired through a float64 stand-in for quack here) against
the Inductor formula, its fakes for torch.compile, and the opt-in dispatch with its one-line errors."""
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
