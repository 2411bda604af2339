"""FP8 lm_head custom op: numerics against fp32, and the backward's quantisation being traced.

torch's CPU build implements _scaled_mm for e4m3/e5m2, so the op's real kernels run here too."""

import numpy as np
import pytest
import torch

import train_gpt as tg
from interpreter import run_in_triton_interpreter

T, V, D = 64, 256, 768


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(V, D, generator=g) * 0.02).bfloat16().requires_grad_()
    grad = torch.randn(T, V, generator=g).bfloat16() * 0.01
    return x, w, grad


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fp8_lm_head_matches_fp32_matmul_within_fp8_rounding():
    x, w, grad = _inputs()
    out = tg.lm_head_fp8(x, w)
    out.backward(grad)
    xf, wf, gf = x.detach().double(), w.detach().double(), grad.double()
    assert out.dtype == torch.bfloat16 and out.shape == (T, V)
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    # e4m3 keeps 3 mantissa bits, e5m2 two: a few percent, never tens of percent
    assert _rel(out, xf @ wf.T) < 0.06
    assert _rel(x.grad, gf @ wf) < 0.09
    assert _rel(w.grad, gf.T @ xf) < 0.09


def test_fp8_backward_gets_quantised_transposed_operands_from_the_traced_graph():
    """The e5m2 cast and the transposes must be ops of the compiled backward graph (so Inductor can fuse them
    into the kernel producing the gradient), not hidden inside the opaque custom op."""
    from torch._dynamo.backends.common import aot_autograd
    graphs = {}

    def capture(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm
            return gm.forward
        return compiler

    backend = aot_autograd(fw_compiler=capture("fw"), bw_compiler=capture("bw"))
    x, w, grad = _inputs(1)
    f = torch.compile(lambda x, w: tg.lm_head_fp8(x, w), backend=backend, fullgraph=True, dynamic=False)
    f(x, w).backward(grad)
    torch._dynamo.reset()
    bw = graphs["bw"].graph
    calls = [n for n in bw.nodes if n.op == "call_function"]
    op_calls = [n for n in calls if "fp8_matmul_backward" in str(n.target)]
    assert len(op_calls) == 1
    e5m2_casts = [n for n in calls if n.kwargs.get("dtype") == torch.float8_e5m2
                  or torch.float8_e5m2 in n.args[1:]]
    assert e5m2_casts, "the e5m2 quantisation of the gradient is not part of the traced backward graph"
    # every tensor input of the custom op is already fp8
    for arg in op_calls[0].args[:3]:
        assert arg.meta["val"].dtype in (torch.float8_e5m2, torch.float8_e4m3fn)


def test_fp8_lm_head_compiled_equals_eager():
    x, w, grad = _inputs(2)
    out = tg.lm_head_fp8(x, w)
    out.backward(grad)
    eager = (out.detach(), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    f = torch.compile(lambda x, w: tg.lm_head_fp8(x, w), fullgraph=True, dynamic=False)
    out = f(x, w)
    out.backward(grad)
    torch._dynamo.reset()
    # both modes round the gradient once, fp32 -> e5m2, so the quantised operands and results are identical
    assert torch.equal(out, eager[0])
    assert torch.equal(x.grad, eager[1])
    assert torch.equal(w.grad, eager[2])


@pytest.mark.parametrize("shape", [(T, V, D), (48, 384, 128)])
def test_fp8_fake_kernels_report_the_real_shapes_and_strides(shape):
    t, v, d = shape
    x = torch.randn(t, d).bfloat16()
    w = (torch.randn(v, d) * 0.02).bfloat16()
    out, x_f8_t, w_f8_t = torch.ops.speedrun.fp8_matmul(x, w, tg.FP8_X_SCALE, tg.FP8_W_SCALE, tg.FP8_GRAD_SCALE)
    assert x_f8_t.shape == (d, t) and w_f8_t.shape == (d, v) and x_f8_t.is_contiguous() and w_f8_t.is_contiguous()
    g_f8 = (torch.randn(t, v) * 0.01 / tg.FP8_GRAD_SCALE).to(torch.float8_e5m2)
    args = (g_f8, x_f8_t, w_f8_t, tg.FP8_X_SCALE, tg.FP8_W_SCALE, tg.FP8_GRAD_SCALE)
    real = torch.ops.speedrun.fp8_matmul_backward(*args)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = torch.ops.speedrun.fp8_matmul_backward(*fake_args)
        fake_fwd = torch.ops.speedrun.fp8_matmul(mode.from_tensor(x), mode.from_tensor(w), tg.FP8_X_SCALE,
                                             tg.FP8_W_SCALE, tg.FP8_GRAD_SCALE)
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
    for r, f in zip((out, x_f8_t, w_f8_t), fake_fwd):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
    # dW comes out in the weight's own layout and dtype: autograd adds it to the gradient without a cast or a
    # strided pass
    assert real[1].shape == (v, d) and real[1].is_contiguous() and real[1].dtype == torch.bfloat16


def test_fp8_weight_gradient_equals_the_records_transposed_fp32_product_after_rounding():
    """dW = (gᵀ x) computed as (vocab, 768) in bf16 against the record's (768, vocab) fp32 product, transposed and
    rounded to bf16 (what autograd did with it): the same products summed, one rounding."""
    x, w, grad = _inputs(3)
    _, x_f8_t, w_f8_t = torch.ops.speedrun.fp8_matmul(x, w, tg.FP8_X_SCALE, tg.FP8_W_SCALE, tg.FP8_GRAD_SCALE)
    g_f8 = tg.quantize_e5m2(grad, tg.FP8_GRAD_SCALE)
    _, grad_w = torch.ops.speedrun.fp8_matmul_backward(g_f8, x_f8_t, w_f8_t, tg.FP8_X_SCALE, tg.FP8_W_SCALE,
                                                   tg.FP8_GRAD_SCALE)
    scales = dict(scale_a=torch.tensor(tg.FP8_X_SCALE), scale_b=torch.tensor(tg.FP8_GRAD_SCALE))
    record = torch._scaled_mm(x_f8_t, g_f8.t().contiguous().T, out_dtype=torch.float32, **scales).T.to(torch.bfloat16)
    assert grad_w.dtype == record.dtype and grad_w.shape == record.shape
    # the GEMM may sum in another order: a bf16 rounding of a value a few fp32 ulps away, at most one bf16 step
    ulp = 2.0 ** (torch.floor(torch.log2(record.float().abs().clamp_min(1e-30))) - 7)
    assert ((grad_w.float() - record.float()).abs() <= ulp).all()
    assert (grad_w != record).float().mean() < 0.01


def test_fp8_operands_are_the_scaled_inputs_rounded_once_to_e4m3():
    """The CPU path of quantize_e4m3 (what the Triton pass computes, and what the record's compiled quantiser
    computes): x times the fp32 reciprocal of the scale in fp32, one rounding to e4m3; the second output is the
    first transposed. Eager PyTorch's bf16 quotient would put some activation bytes one e4m3 step away."""
    x, w, _ = _inputs(4)
    for t, scale in ((x.detach(), tg.FP8_X_SCALE), (w.detach(), tg.FP8_W_SCALE)):
        q, q_t = tg.quantize_e4m3(t, scale)
        inv = float(np.float32(1) / np.float32(scale))
        expected = (t.float() * inv).to(torch.float8_e4m3fn)
        assert torch.equal(q.view(torch.uint8), expected.view(torch.uint8))
        assert q_t.is_contiguous() and torch.equal(q_t.view(torch.uint8), expected.t().contiguous().view(torch.uint8))
        exact = (t.double() / scale).to(torch.float8_e4m3fn)  # the exact quotient, rounded once
        assert (q.view(torch.uint8) == exact.view(torch.uint8)).float().mean() > 0.9999
    twice = (x.detach().float() * inv_x()).bfloat16().to(torch.float8_e4m3fn)  # eager's bf16 quotient first
    q, _ = tg.quantize_e4m3(x.detach(), tg.FP8_X_SCALE)
    assert (q.view(torch.uint8) != twice.view(torch.uint8)).float().mean() > 0.005  # the rounding that differs


def inv_x() -> float:
    return float(np.float32(1) / np.float32(tg.FP8_X_SCALE))


TRANSPOSE_SCRIPT = """
import json, torch, train_gpt as tg
assert tg._TRITON_INTERPRET
out = []
for shape in [(128, 256), (200, 130), (1, 7), (129, 1), (300, 257)]:
    x = (torch.randn(*shape, generator=torch.Generator().manual_seed(len(out))) * 100).to(torch.float8_e5m2)
    y = tg.transpose_bytes(x)
    out.append(dict(shape=list(shape), dtype=str(y.dtype), out_shape=list(y.shape), contiguous=y.is_contiguous(),
                    equal=torch.equal(y.view(torch.uint8), x.t().contiguous().view(torch.uint8))))
print(json.dumps(out))
"""


def test_transpose_bytes_kernel_matches_torch_on_fp8_and_ragged_shapes():
    """The Triton tile transpose (run in the interpreter: TRITON_INTERPRET must be set before triton loads)."""
    rows = run_in_triton_interpreter(TRANSPOSE_SCRIPT)
    assert len(rows) == 5
    for row in rows:
        assert row["equal"] and row["contiguous"], row
        assert row["out_shape"] == row["shape"][::-1] and row["dtype"] == "torch.float8_e5m2"


QUANTIZE_SCRIPT = """
import json, torch, train_gpt as tg
assert tg._TRITON_INTERPRET
out = []
e4m3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
e4m3 = e4m3[e4m3.isfinite()]
for dtype in (torch.float32, torch.float16):
    for shape in [(128, 256), (200, 130), (1, 7), (129, 1), (300, 257)]:
        g = torch.Generator().manual_seed(len(out))
        q_ref = e4m3[torch.randint(0, e4m3.numel(), shape, generator=g)]
        x = (q_ref * 2.0 ** -9).to(dtype)  # a power-of-two scale: every input is exactly an e4m3 value times it
        q, q_t = tg.quantize_e4m3(x, 2.0 ** -9)
        ref = q_ref.to(torch.float8_e4m3fn).view(torch.uint8)
        out.append(dict(shape=list(shape), dtype=str(dtype), q_dtype=str(q.dtype), q_t_shape=list(q_t.shape),
                        contiguous=q.is_contiguous() and q_t.is_contiguous(),
                        q_equal=torch.equal(q.view(torch.uint8), ref),
                        q_t_equal=torch.equal(q_t.view(torch.uint8), ref.t().contiguous())))
print(json.dumps(out))
"""


def test_quantize_transpose_kernel_writes_both_layouts_of_the_scaled_input():
    """The Triton pass in the interpreter, fp32 and fp16 inputs (bf16 is unreliable there): tiles, masks, the
    scale and the transposed store. The inputs are exact e4m3 values times the scale, because the interpreter's own
    fp8 conversion loses the carry when a value rounds up into the next power of two; rounding itself is checked
    against PyTorch's cast on the GPU (tests/gpu)."""
    rows = run_in_triton_interpreter(QUANTIZE_SCRIPT)
    assert len(rows) == 10
    for row in rows:
        assert row["q_equal"] and row["q_t_equal"] and row["contiguous"], row
        assert row["q_t_shape"] == row["shape"][::-1] and row["q_dtype"] == "torch.float8_e4m3fn"


# ----------------------------------------------------------------------------------------------------
# fused FP8 head: lm_head + softcapped cross-entropy with one backward pass writing both gradient layouts
# ----------------------------------------------------------------------------------------------------

def _head_inputs(seed, t=64, v=256):
    g = torch.Generator().manual_seed(seed)
    x = tg.norm(torch.randn(t, D, generator=g)).bfloat16().requires_grad_()
    w = (torch.randn(v, D, generator=g) * 0.05).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (t,), generator=g)
    return x, w, targets


def test_fused_fp8_head_equals_lm_head_fp8_plus_softcapped_cross_entropy():
    """Same function, same roundings (bf16 gradient, /grad_s, e5m2): loss and both gradients bit-identical."""
    x, w, targets = _head_inputs(3)
    loss = tg.softcapped_cross_entropy_sum(tg.lm_head_fp8(x, w), targets)
    (loss / 4).backward()
    ref = (loss.detach(), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    fused = tg.fp8_lm_head_cross_entropy_sum(x, w, targets)
    (fused / 4).backward()
    assert fused.dtype == torch.float32 and torch.equal(fused.detach(), ref[0])
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    assert torch.equal(x.grad, ref[1]) and torch.equal(w.grad, ref[2])


def test_fused_fp8_head_gradient_matches_float64_within_fp8_rounding():
    x, w, targets = _head_inputs(4)
    tg.fp8_lm_head_cross_entropy_sum(x, w, targets).backward()
    xd, wd = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    F = torch.nn.functional
    F.cross_entropy(30 * torch.sigmoid((xd @ wd.T) / 7.5), targets, reduction="sum").backward()
    assert _rel(x.grad, xd.grad) < 0.1 and _rel(w.grad, wd.grad) < 0.1


def test_fused_fp8_head_compiled_equals_eager():
    x, w, targets = _head_inputs(5)
    tg.fp8_lm_head_cross_entropy_sum(x, w, targets).backward()
    eager = (x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None
    f = torch.compile(tg.fp8_lm_head_cross_entropy_sum, backend="aot_eager", fullgraph=True, dynamic=False)
    f(x, w, targets).backward()
    torch._dynamo.reset()
    assert torch.equal(x.grad, eager[0]) and torch.equal(w.grad, eager[1])


def test_fused_backward_op_fake_kernels_report_the_real_shapes_and_strides():
    x, w, targets = _head_inputs(6, t=48, v=384)
    logits = tg.lm_head_fp8(x.detach(), w.detach())
    lse = torch.exp(30 * torch.sigmoid(logits.float() / 7.5)).sum(-1).log()
    grad = torch.tensor(0.25)
    real = torch.ops.speedrun.softcap_ce_backward(logits, lse, targets, grad, tg.FP8_GRAD_SCALE, [32, 128, 4])
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = torch.ops.speedrun.softcap_ce_backward(*(mode.from_tensor(a) for a in (logits, lse, targets, grad)),
                                                      tg.FP8_GRAD_SCALE, [32, 128, 4])
    for r, f in zip(real, fake):
        assert (r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
    assert torch.equal(real[1].view(torch.uint8), real[0].t().contiguous().view(torch.uint8))


# Inputs shared by the interpreter scripts below: fp32 logits (the interpreter mangles bf16), their softcapped
# log-sum-exp, and the float64 gradient of the summed softcapped CE, divided by grad_s.
CE_CASE = """
import json, torch, train_gpt as tg


def ce_case(t, v):
    g = torch.Generator().manual_seed(t + v)
    logits = torch.randn(t, v, generator=g) * 8
    targets = torch.randint(0, v, (t,), generator=g)
    lse = torch.exp(30 * torch.sigmoid(logits / 7.5)).sum(-1).log()
    grad = torch.tensor(0.125)
    s = torch.sigmoid(logits.double() / 7.5)
    ref = 0.125 * (torch.exp(30 * s - lse.double()[:, None]) - torch.nn.functional.one_hot(targets, v)) * 4 * s * (1 - s)
    return logits, targets, lse, grad, ref / tg.FP8_GRAD_SCALE
"""


CE_KERNEL_SCRIPT = CE_CASE + """
assert tg._TRITON_INTERPRET
out = []
for t, v in [(128, 256), (100, 300), (1, 17), (130, 129)]:
    logits, targets, lse, grad, ref = ce_case(t, v)
    o, o_t = torch.full((t, v), float("nan")), torch.full((v, t), float("nan"))
    tg.launch_softcap_ce_backward(logits, lse, targets, grad, o, o_t, tg.FP8_GRAD_SCALE, round_bf16=False, fp8=False)
    q, q_t = torch.zeros(t, v, dtype=torch.uint8), torch.zeros(v, t, dtype=torch.uint8)
    tg.launch_softcap_ce_backward(logits, lse, targets, grad, q, q_t, tg.FP8_GRAD_SCALE, round_bf16=False, fp8=True)
    dec = q.view(torch.float8_e5m2).double()
    # torch's round-to-nearest-even cast of the kernel's own fp32 values is the GPU's answer. The interpreter's cast
    # drops the carry when rounding overflows the 2-bit mantissa (1.9*2^e becomes 2^e, not 2^(e+1)): accept that.
    expected = o.to(torch.float8_e5m2).double()
    power_of_two = (expected != 0) & (torch.log2(expected.abs()) == torch.log2(expected.abs()).round())
    dropped_carry = power_of_two & ((dec * 2 == expected) | ((expected.abs() == 2.0 ** -16) & (dec == 0)))
    # ... and it truncates subnormals (|x| <= 2^-14) instead of rounding them: one 2^-16 step towards zero
    subnormal_trunc = (expected.abs() <= 2.0 ** -14) & (dec.abs() <= expected.abs()) & ((expected - dec).abs() <= 2.0 ** -16)
    out.append(dict(shape=[t, v], rel_err=((o.double() - ref).norm() / ref.norm()).item(),
                    transposed_equal=torch.equal(o_t, o.t().contiguous()), all_written=not o.isnan().any().item(),
                    fp8_rounded_as_torch=bool(((dec == expected) | dropped_carry | subnormal_trunc).all()),
                    fp8_exact_share=((dec == expected).double().mean().item()),
                    fp8_transposed_equal=torch.equal(q_t, q.t().contiguous())))
print(json.dumps(out))
"""


def test_softcap_ce_backward_kernel_matches_float64_and_writes_both_layouts():
    """The fused Triton backward in the interpreter: fp32 output against float64, its transpose written exactly,
    every element written (NaN-poisoned buffers), ragged tiles masked, e5m2 values as torch rounds them."""
    rows = run_in_triton_interpreter(CE_KERNEL_SCRIPT)
    assert len(rows) == 4
    for row in rows:
        assert row["rel_err"] < 1e-5, row
        assert row["transposed_equal"] and row["all_written"], row
        assert row["fp8_rounded_as_torch"] and row["fp8_transposed_equal"], row
        assert row["fp8_exact_share"] > 0.8, row


CE_FAST_MATH_SCRIPT = CE_CASE + """
out = []
for t, v in [(128, 256), (100, 300)]:
    logits, targets, lse, grad, ref = ce_case(t, v)
    res = {}
    for fast in (False, True):
        o, o_t = torch.full((t, v), float("nan")), torch.full((v, t), float("nan"))
        tg.launch_softcap_ce_backward(logits, lse, targets, grad, o, o_t, tg.FP8_GRAD_SCALE, round_bf16=False,
                                      fp8=False, fast_math=fast)
        res[fast] = o
    fast = res[True]
    out.append(dict(rel_err=((fast.double() - ref).norm() / ref.norm()).item(),
                    max_rel_diff_vs_exact=((fast - res[False]).abs().max() / res[False].abs().max()).item(),
                    transposed_equal=torch.equal(o_t, o.t().contiguous()), all_written=not fast.isnan().any().item()))
print(json.dumps(out))
"""


def test_ce_fast_math_formula_matches_float64_in_the_interpreter():
    """Fast math's algebra (sigmoid through tanh, multiplications for divisions) with the interpreter's exact
    tanh: the same gradient as the exact kernel to fp32 rounding. (tanh.approx itself runs on GPUs only:
    tests/gpu bounds its effect on the e5m2 bytes.)"""
    rows = run_in_triton_interpreter(CE_FAST_MATH_SCRIPT)
    for row in rows:
        assert row["rel_err"] < 1e-5 and row["max_rel_diff_vs_exact"] < 1e-5, row
        assert row["transposed_equal"] and row["all_written"], row


CE_FORWARD_SCRIPT = CE_CASE + """
assert tg._TRITON_INTERPRET
out = []
for t, v, tile in [(128, 256, None), (100, 300, (4, 64, 4)), (1, 17, (2, 16, 1)), (130, 129, (8, 32, 4))]:
    logits, targets, *_ = ce_case(t, v)
    z = 30 * torch.sigmoid(logits.double() / 7.5)
    ref_lse = torch.logsumexp(z, dim=-1)
    ref_per_token = ref_lse - z.gather(1, targets[:, None]).squeeze(1)
    for fast in (False, True):
        lse, per_token = torch.full((t,), float("nan")), torch.full((t,), float("nan"))
        tg.launch_softcap_ce_forward(logits, targets, lse, per_token, fast, tile=tile)
        out.append(dict(shape=[t, v], tile=tile, fast=fast, all_written=not (lse.isnan().any() or per_token.isnan().any()).item(),
                        lse_rel_err=((lse.double() - ref_lse).abs().max() / ref_lse.abs().max()).item(),
                        loss_rel_err=((per_token.double() - ref_per_token).abs().max() / ref_per_token.abs().max()).item()))
    loss, lse = tg.fused_softcap_ce_forward(logits, targets, True)
    out.append(dict(op_loss_rel_err=abs(loss.item() - ref_per_token.sum().item()) / ref_per_token.sum().item(),
                    op_shapes=[list(loss.shape), list(lse.shape)], tokens=t))
print(json.dumps(out))
"""


def test_fused_ce_forward_kernel_matches_float64_for_ragged_tiles_and_both_maths():
    """The forward's Triton pass in the interpreter: per-token log-sum-exp and loss against float64, several tiles
    (V swept in chunks, ragged last rows and columns), every row written (NaN-poisoned buffers), exact and fast
    math (the interpreter's tanh is exact: tanh.approx runs on GPUs only)."""
    rows = run_in_triton_interpreter(CE_FORWARD_SCRIPT)
    kernel_rows = [row for row in rows if "lse_rel_err" in row]
    op_rows = [row for row in rows if "op_loss_rel_err" in row]
    assert len(kernel_rows) == 8 and len(op_rows) == 4
    for row in kernel_rows:
        assert row["all_written"], row
        assert row["lse_rel_err"] < 1e-6 and row["loss_rel_err"] < 1e-5, row
    for row in op_rows:  # the custom op: the per-token losses summed, the log-sum-exp per token
        assert row["op_loss_rel_err"] < 1e-6 and row["op_shapes"] == [[], [row["tokens"]]], row


def _head_loss_and_grads(fused, x, w, targets):
    head = tg.LMHead(D, 256, fp8=True, fused=fused)
    with torch.no_grad():
        head.weight.copy_(w)
    head.train()
    x = x.detach().clone().requires_grad_()
    loss = head(x, targets)
    loss.backward()
    return loss.detach(), x.grad, head.weight.grad


def test_fused_head_launches_both_triton_passes_with_fast_math_and_matches_the_unfused_head(monkeypatch):
    """LMHead's fused path -> its forward and backward ops -> the two kernel launches (recording stand-ins that
    compute the PyTorch formulas): both with fast math, the backward with CE_BACKWARD_TILE; the loss and gradients
    equal the unfused head's."""
    x, w, targets = _head_inputs(8)
    unfused = _head_loss_and_grads(False, x, w, targets)
    seen = []

    def fake_forward(logits, targets, lse, per_token, fast_math, tile=None):
        seen.append(("forward", fast_math))
        _, ref_lse = tg.softcap_ce_forward(logits, targets)
        z_t = 30 * torch.sigmoid(logits.gather(1, targets[:, None]).squeeze(1).float() / 7.5)
        lse.copy_(ref_lse)
        per_token.copy_(ref_lse - z_t)

    def fake_backward(logits, lse, targets, grad, out, out_t, grad_s, round_bf16, fp8, tile=None, fast_math=False):
        seen.append(("backward", tuple(tile), fast_math))
        g, g_t = tg.softcap_ce_backward_reference(logits, lse, targets, grad, grad_s)
        out.copy_(g.view(torch.uint8))
        out_t.copy_(g_t.view(torch.uint8))
    monkeypatch.setattr(tg, "launch_softcap_ce_forward", fake_forward)
    monkeypatch.setattr(tg, "launch_softcap_ce_backward", fake_backward)
    monkeypatch.setattr(tg, "_kernels_usable", lambda t: True)
    monkeypatch.setattr(tg, "quantize_e4m3", tg.quantize_e4m3_reference)  # no GPU for the operands' Triton pass
    fused = _head_loss_and_grads(True, x, w, targets)
    assert seen == [("forward", True), ("backward", tg.CE_BACKWARD_TILE, True)]
    for a, b in zip(fused, unfused):
        assert torch.equal(a, b)


def test_fused_ce_forward_fake_kernel_reports_the_real_shapes():
    logits = torch.randn(48, 384).bfloat16()
    targets = torch.randint(0, 384, (48,))
    real = torch.ops.speedrun.softcap_ce_forward(logits, targets, False)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = torch.ops.speedrun.softcap_ce_forward(mode.from_tensor(logits), mode.from_tensor(targets), False)
    for r, f in zip(real, fake):
        assert (r.shape, r.dtype) == (f.shape, f.dtype)


def test_fp8_scale_tensors_are_made_once_per_value_and_device():
    """torch.tensor(value, device="cuda") blocks the CPU until the GPU is idle: the op's scale tensors must be
    created once, not on every call (six calls per micro-batch)."""
    x, w, grad = _inputs()
    tg.lm_head_fp8(x, w).backward(grad)
    made = dict(tg._SCALE_TENSORS)
    assert {value for value, _ in made} == {tg.FP8_X_SCALE, tg.FP8_W_SCALE, tg.FP8_GRAD_SCALE}
    tg.lm_head_fp8(x, w).backward(grad)
    assert tg._SCALE_TENSORS.keys() == made.keys()
    assert all(tg._SCALE_TENSORS[key] is made[key] for key in made)
    assert tg._scale_tensor(tg.FP8_X_SCALE, x).item() == pytest.approx(tg.FP8_X_SCALE)
