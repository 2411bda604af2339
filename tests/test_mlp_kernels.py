"""The fused twins of `mlp` and `attention_output` (quack's GEMMs with the activation or the residual in their
epilogues): their ops wired through a float64 stand-in for quack here (quack needs a Hopper or Blackwell GPU), against
the plain functions and autograd of them; their fakes for torch.compile; where they are chosen."""
import dataclasses
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
from dist_utils import runtime_for
from test_model import PLAIN, TRACEABLE, model_pair, pair_losses


class ReferenceQuack:
    """quack.gemm_interface's three entry points with its documented semantics, in plain torch (any dtype)."""
    calls = []

    @staticmethod
    def gemm_act(A, B, activation=None, tuned=True, config=None):
        ReferenceQuack.calls.append(("act", activation, tuned, tuple(B.shape), config))
        pre = A @ B
        return pre, F.relu(pre).square()

    @staticmethod
    def gemm_dact(A, B, PreAct, activation=None, tuned=True, config=None):
        ReferenceQuack.calls.append(("dact", activation, tuned, tuple(B.shape), config))
        return (A @ B) * 2 * F.relu(PreAct), F.relu(PreAct).square()

    @staticmethod
    def gemm_add(A, B, C, tuned=True):
        ReferenceQuack.calls.append(("add", tuned, tuple(B.shape)))
        return C + A @ B


@pytest.fixture
def stand_in_quack(monkeypatch):
    monkeypatch.setattr(tg, "quack_gemm", lambda: ReferenceQuack)
    ReferenceQuack.calls = []
    return ReferenceQuack


def mlp_inputs(T=37, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
            for shape in ((T, d), (4 * d, d), (4 * d, d))]


def test_fused_mlp_gives_the_plain_mlps_output_and_all_three_gradients(stand_in_quack):
    x, w_fc, w_proj = mlp_inputs()
    out = tg.fused_mlp(x, w_fc, w_proj)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, w_fc, w_proj), grad)
    ref_out = tg.mlp(x, w_fc, w_proj)
    ref = torch.autograd.grad(ref_out, (x, w_fc, w_proj), grad)
    torch.testing.assert_close(out, ref_out)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b)
    # quack gets B as (K, N) views of the (4d, d) weights, no autotune at start-up, and off Hopper quack's own config
    assert stand_in_quack.calls == [("act", "relu_sq", False, (8, 32), None), ("dact", "relu_sq", False, (8, 32), None)]


def test_mlp_module_calls_the_mlp_function_it_is_given(stand_in_quack):
    torch.manual_seed(0)
    module = tg.MLP(16).double()
    with torch.no_grad():
        module.c_proj.normal_()
    x = torch.randn(10, 16, dtype=torch.float64)
    torch.testing.assert_close(module(x, {"mlp": tg.fused_mlp}), module(x, {"mlp": tg.mlp}))
    assert [c[0] for c in stand_in_quack.calls] == ["act"]


def test_fused_mlp_ops_trace_with_their_fakes_forward_and_backward():
    """What torch.compile sees (symbolic token count included): shapes and dtypes without running quack."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x, w_fc, w_proj = (torch.randn(*s, dtype=torch.bfloat16, requires_grad=True) for s in ((50, 8), (32, 8), (32, 8)))
        out, pre = torch.ops.speedrun.relu2_mlp(x, w_fc, w_proj)
        grads = torch.autograd.grad(out.sum(), (x, w_fc, w_proj))
        assert tg.fused_mlp(x, w_fc, w_proj).shape == (50, 8)
    assert out.shape == (50, 8) and pre.shape == (50, 32) and out.dtype == torch.bfloat16
    assert [g.shape for g in grads] == [x.shape, w_fc.shape, w_proj.shape]


def test_fused_attention_output_is_the_residual_plus_the_projection_with_its_gradients(stand_in_quack):
    """fused_attention_output (speedrun::residual_linear) against the plain attention_output under autograd, in
    float64, and torch.library's checks of the op's fake and autograd registrations."""
    g = torch.Generator().manual_seed(4)
    inputs = [torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
              for shape in ((32, 24), (32, 16), (24, 16))]
    plain = [t.detach().clone().requires_grad_() for t in inputs]
    out = tg.fused_attention_output(*inputs)
    ref = tg.attention_output(*plain)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(grad)
    ref.backward(grad)
    for a, b in zip(inputs, plain):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    assert stand_in_quack.calls[0] == ("add", False, (16, 24))  # y @ wᵀ with wᵀ a view, no autotune
    torch.library.opcheck(torch.ops.speedrun.residual_linear, [t.detach().requires_grad_() for t in inputs])


@pytest.mark.parametrize("compiled", [False, True])
def test_the_model_with_the_fused_mlp_and_attention_output_matches_the_plain_model(stand_in_quack, compiled):
    """The model calling fused_mlp and fused_attention_output (quack stood in) against the plain functions: the same
    loss and gradients up to bf16 rounding (the fused backward rounds in another order), eager and compiled
    (aot_eager: the ops' fakes and autograd registrations inside the model's graphs)."""
    fused_kernels = dict(TRACEABLE, mlp=tg.fused_mlp, attention_output=tg.fused_attention_output)
    plain, _ = model_pair(seed=5, max_seq_len=128, head_seed=1, output_projections=True)
    _, fused = model_pair(seed=5, max_seq_len=128, head_seed=1, kernels=fused_kernels, output_projections=True)
    if compiled:
        fused.compile_regions(backend="aot_eager", dynamic=False, fullgraph=True)
    try:
        losses = pair_losses((plain, fused))
    finally:
        torch._dynamo.reset()
    assert {c[0] for c in stand_in_quack.calls} == {"act", "dact", "add"}
    assert sum(c[0] == "add" for c in stand_in_quack.calls) == 10  # the 10 attention layers' output projections
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-3, atol=0)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            scale = p.grad.float().abs().max().clamp_min(1e-30)
            assert (p.grad.float() - q.grad.float()).abs().max() <= 0.05 * scale, name


# ----------------------------------------------------------------------------------------------------
# where the quack twins run: resolve_kernels with quack and the GPU faked
# ----------------------------------------------------------------------------------------------------

@pytest.fixture
def fake_quack(monkeypatch):
    fake = types.ModuleType("quack.gemm_interface")
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", fake)
    tg.quack_gemm.cache_clear()
    yield fake
    tg.quack_gemm.cache_clear()


def test_fused_quack_kernels_are_chosen_on_hopper_and_blackwell_where_quack_imports(monkeypatch, fake_quack):
    for capability in ((9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        chosen, notes = tg.resolve_kernels("mlp,attention_output", "cuda", fp8=True)
        assert chosen == dict(PLAIN, mlp=tg.fused_mlp, attention_output=tg.fused_attention_output)
        assert notes == []
    assert tg.quack_gemm() is fake_quack


def test_before_hopper_fused_keeps_the_plain_mlp_with_a_note_and_a_request_for_it_is_refused(monkeypatch, fake_quack):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    chosen, notes = tg.resolve_kernels("fused", "cuda", fp8=False)
    assert chosen["mlp"] is tg.mlp and chosen["attention_output"] is tg.attention_output
    assert any(n.startswith("kernels: plain mlp (") and "compute capability 9.x or 10.x" in n for n in notes), notes
    with pytest.raises(tg.ConfigError, match=r"--kernels: the fused mlp kernel cannot run here \(RuntimeError: .*"
                                             r"compute capability 9\.x or 10\.x.*--kernels plain"):
        tg.resolve_kernels("mlp", "cuda", fp8=False)


def test_without_quack_installed_a_request_for_its_kernel_is_one_line_naming_the_import(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setitem(sys.modules, "quack", None)  # not installed
    tg.quack_gemm.cache_clear()
    try:
        with pytest.raises(tg.ConfigError) as e:
            tg.resolve_kernels("attention_output", "cuda", fp8=True)
    finally:
        tg.quack_gemm.cache_clear()
    message = str(e.value)
    assert "\n" not in message and "fused attention_output kernel cannot run here" in message
    assert "quack" in message and "ModuleNotFoundError" in message


def test_run_config_names_the_kernels_flag_and_the_fused_kernels_in_use():
    args = tg.parse_args(["--device", "cpu", "--smoke"])
    runtime = runtime_for(args)
    assert runtime.kernels == PLAIN and runtime.fused == "none"
    assert " kernels=fused fused=none " in runtime.config_line(args)
    args = tg.parse_args(["--device", "cpu", "--smoke", "--kernels", "plain"])
    assert " kernels=plain fused=none " in runtime_for(args).config_line(args)
    fused = dataclasses.replace(runtime, kernels=dict(PLAIN, mlp=tg.fused_mlp,
                                                      attention_output=tg.fused_attention_output))
    assert fused.fused == "mlp,attention_output"
