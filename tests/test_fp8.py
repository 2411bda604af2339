"""FP8 lm_head custom op: numerics against fp32, and the backward's quantisation being traced; the fused head
(FusedLMHeadLoss: the FP8 matmul, a Triton forward and a Triton backward) against the plain lm_head_loss.

torch's CPU build implements _scaled_mm for e4m3/e5m2, so the op's real kernels run here too; the Triton passes run
in the Triton interpreter (tests/interpreter.py)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
from interpreter import interpreted, run_scripts_in_triton_interpreter

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


@pytest.fixture(scope="module")
def interpreter_runs():
    """The Triton-interpreter scripts of this module (below), run together in one fresh process."""
    return run_scripts_in_triton_interpreter(dict(
        transpose=TRANSPOSE_SCRIPT, quantize=QUANTIZE_SCRIPT, ce_backward=CE_BACKWARD_SCRIPT,
        ce_forward=CE_FORWARD_SCRIPT, fused_head=FUSED_HEAD_SCRIPT))


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


def test_transpose_bytes_kernel_matches_torch_on_fp8_and_ragged_shapes(interpreter_runs):
    """The Triton tile transpose (run in the interpreter: TRITON_INTERPRET must be set before triton loads)."""
    rows = interpreted(interpreter_runs, "transpose")
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


def test_quantize_transpose_kernel_writes_both_layouts_of_the_scaled_input(interpreter_runs):
    """The Triton pass in the interpreter, fp32 and fp16 inputs (bf16 is unreliable there): tiles, masks, the
    scale and the transposed store. The inputs are exact e4m3 values times the scale, because the interpreter's own
    fp8 conversion loses the carry when a value rounds up into the next power of two; rounding itself is checked
    against PyTorch's cast on the GPU (tests/gpu)."""
    rows = interpreted(interpreter_runs, "quantize")
    assert len(rows) == 10
    for row in rows:
        assert row["q_equal"] and row["q_t_equal"] and row["contiguous"], row
        assert row["q_t_shape"] == row["shape"][::-1] and row["q_dtype"] == "torch.float8_e4m3fn"


# ----------------------------------------------------------------------------------------------------
# the fused FP8 head: the FP8 matmul, one Triton pass forward, one backward writing both e5m2 gradient layouts
# ----------------------------------------------------------------------------------------------------

def _head_inputs(seed, t=64, v=256):
    g = torch.Generator().manual_seed(seed)
    x = tg.norm(torch.randn(t, D, generator=g)).bfloat16().requires_grad_()
    w = (torch.randn(v, D, generator=g) * 0.05).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (t,), generator=g)
    return x, w, targets


def plain_e5m2_gradient(logits, targets, grad):
    """What the plain head hands the FP8 backward: e5m2(bf16(autograd's gradient of the softcapped cross-entropy
    with respect to the logits) / FP8_GRAD_SCALE). The fused backward kernel computes these bytes."""
    leaf = logits.detach().float().requires_grad_()
    loss = F.cross_entropy(tg.softcap(leaf), targets, reduction="sum")
    (g,) = torch.autograd.grad(loss, leaf, grad)
    return tg.quantize_e5m2(g.bfloat16(), tg.FP8_GRAD_SCALE)


def test_fused_head_launches_both_triton_passes_and_gives_the_plain_heads_loss_and_gradients(monkeypatch):
    """The fused head's plumbing on the CPU, with the two Triton launches stood in by the plain head's own numbers:
    the backward launch gets the upstream gradient, FP8_GRAD_SCALE and uint8 buffers for the e5m2 bytes in both
    layouts; given the bytes the plain head quantises (pinned against plain_e5m2_gradient), FusedLMHeadLoss returns
    the plain lm_head_loss's loss and, through the same FP8 GEMMs, its gradients bit for bit."""
    x, w, targets = _head_inputs(8)
    quantised = []
    real_quantize_e5m2 = tg.quantize_e5m2
    monkeypatch.setattr(tg, "quantize_e5m2", lambda g, s: quantised.append(real_quantize_e5m2(g, s)) or quantised[-1])
    plain = tg.lm_head_loss(x, w, targets, fp8=True)
    (plain / 4).backward()
    plain_grads = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    assert len(quantised) == 1  # the gradient of the logits, quantised once
    logits = tg.lm_head_fp8(x.detach(), w.detach())
    expected = plain_e5m2_gradient(logits, targets, torch.tensor(0.25))
    assert torch.equal(quantised[0].view(torch.uint8), expected.view(torch.uint8))
    seen = []

    def forward_launch(logits, targets, lse, per_token):
        seen.append(("forward", lse.dtype, per_token.dtype, tuple(lse.shape)))
        z = tg.softcap(logits.float())
        lse.copy_(torch.logsumexp(z, dim=-1))
        per_token.copy_(F.cross_entropy(z, targets, reduction="none"))

    def backward_launch(logits, lse, targets, grad, out, out_t, grad_s):
        seen.append(("backward", grad.item(), grad_s, out.dtype, tuple(out_t.shape)))
        out.copy_(expected.view(torch.uint8))
        out_t.copy_(expected.view(torch.uint8).t())

    monkeypatch.setattr(tg, "launch_softcap_ce_forward", forward_launch)
    monkeypatch.setattr(tg, "launch_softcap_ce_backward", backward_launch)
    fused = tg.fused_lm_head_loss(x, w, targets, fp8=True)
    (fused / 4).backward()
    assert seen == [("forward", torch.float32, torch.float32, (64,)),
                    ("backward", 0.25, tg.FP8_GRAD_SCALE, torch.uint8, (256, 64))]
    assert fused.dtype == torch.float32 and fused.item() == pytest.approx(plain.item(), rel=1e-6)
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    assert torch.equal(x.grad, plain_grads[0]) and torch.equal(w.grad, plain_grads[1])
    with pytest.raises(AssertionError, match="FP8"):
        tg.fused_lm_head_loss(x, w, targets, fp8=False)


def test_lm_head_module_trains_with_the_loss_it_is_given_and_evaluates_with_the_plain_bf16_head():
    calls = []

    def loss_fn(x, w, targets, fp8):
        calls.append(fp8)
        return tg.lm_head_loss(x, w, targets, fp8)

    head = tg.LMHead(D, 256, loss_fn=loss_fn, fp8=True)
    x, w, targets = _head_inputs(9)
    with torch.no_grad():
        head.weight.copy_(w)
    head(x, targets)
    head.eval()
    evaluated = head(x, targets)
    assert calls == [True]  # training only; evaluation never runs the FP8 matmul
    assert torch.equal(evaluated, tg.lm_head_loss(x, w, targets, fp8=False))
    model = tg.GPT(tg.Hyperparameters(**tg.SMOKE_PRESET), max_seq_len=16, fp8=True,
                   kernels={name: k.fused for name, k in tg.FUSED_KERNELS.items()})
    assert model.lm_head.loss_fn is tg.fused_lm_head_loss and model.lm_head.fp8


# Inputs shared by the interpreter scripts below: bf16 logits (the head's own dtype), targets, and the float64
# softcapped cross-entropy of the plain functions, per token, with its log-sum-exp and its autograd gradient.
CE_CASE = """
import json, torch, train_gpt as tg
F = torch.nn.functional


def ce_case(t, v, grad=0.125):
    g = torch.Generator().manual_seed(t + v)
    logits = (torch.randn(t, v, generator=g) * 8).bfloat16()
    targets = torch.randint(0, v, (t,), generator=g)
    leaf = logits.double().requires_grad_()
    z = tg.softcap(leaf)
    per_token = F.cross_entropy(z, targets, reduction="none")
    (ref_grad,) = torch.autograd.grad(per_token.sum(), leaf, torch.tensor(grad, dtype=torch.float64))
    return logits, targets, torch.logsumexp(z, dim=-1).detach(), per_token.detach(), ref_grad
"""


CE_BACKWARD_SCRIPT = CE_CASE + """
assert tg._TRITON_INTERPRET
out = []
for t, v, constants in [(128, 256, None), (100, 300, None), (1, 17, None), (130, 129, None), (64, 200, (50.0, 10.0))]:
    if constants is not None:  # a speedrunner's new softcap: the kernels take the constants as arguments
        tg.SOFTCAP, tg.SOFTCAP_WIDTH = constants
    logits, targets, ref_lse, _, ref_grad = ce_case(t, v)
    lse, grad = ref_lse.float(), torch.tensor(0.125)
    # 0xFF is an e5m2 NaN, which the kernel never writes for finite inputs: a byte left so was not written
    q, q_t = torch.full((t, v), 0xFF, dtype=torch.uint8), torch.full((v, t), 0xFF, dtype=torch.uint8)
    tg.launch_softcap_ce_backward(logits, lse, targets, grad, q, q_t, tg.FP8_GRAD_SCALE)
    dec = q.view(torch.float8_e5m2).double()
    # the plain head's bytes for the same gradient: e5m2(bf16(autograd's gradient) / FP8_GRAD_SCALE). Compared as
    # magnitudes (sign bit apart): the interpreter's casts to bf16 and e5m2 round towards zero where GPUs round to
    # nearest, so a byte may sit one e5m2 step lower, or at half the power of two the rounding carried into (a
    # dropped carry; at 2^-14, the smallest normal, that half is the subnormal two steps down)
    expected = tg.quantize_e5m2(ref_grad.float().bfloat16(), tg.FP8_GRAD_SCALE)
    k, e = q.int(), expected.view(torch.uint8).int()
    kd, ed = dec.abs(), expected.double().abs()
    step = (e & 0x7F) - (k & 0x7F)
    same_sign = ((k & 0x80) == (e & 0x80)) | ((k & 0x7F) == 0) | ((e & 0x7F) == 0)
    power_of_two = (ed > 0) & (torch.log2(ed) == torch.log2(ed).round())
    explained = same_sign & ((step == 0) | (step == 1) | (power_of_two & (kd * 2 == ed)))
    ref = ref_grad / tg.FP8_GRAD_SCALE
    out.append(dict(shape=[t, v], constants=constants, all_written=not bool((q == 0xFF).any() or (q_t == 0xFF).any()),
                    rel_err=((dec - ref).norm() / ref.norm()).item(),
                    bytes_equal_share=(step == 0).double().mean().item(), bytes_explained=bool(explained.all()),
                    transposed_equal=torch.equal(q_t, q.t().contiguous())))
print(json.dumps(out))
"""


def test_softcap_ce_backward_kernel_writes_the_plain_heads_e5m2_gradient_bytes_in_both_layouts(interpreter_runs):
    """The fused Triton backward in the interpreter (its fast math: the interpreter's tanh is exact, tanh.approx runs
    on GPUs only, tests/gpu bounds it): its e5m2 bytes are the plain head's, e5m2(bf16(autograd's gradient of the
    plain softcap and cross-entropy) / FP8_GRAD_SCALE), but where the interpreter's own casts round towards zero;
    within e5m2's rounding of the float64 gradient; the transpose written exactly, every byte written, ragged tiles
    masked; also with a new SOFTCAP and SOFTCAP_WIDTH."""
    rows = interpreted(interpreter_runs, "ce_backward")
    assert len(rows) == 5 and rows[-1]["constants"] == [50.0, 10.0]
    for row in rows:
        assert row["transposed_equal"] and row["all_written"], row
        assert row["bytes_explained"] and row["bytes_equal_share"] > 0.8, row
        assert row["rel_err"] < 0.1, row  # e5m2 keeps 2 mantissa bits: at most 12.5 % off an element, nearest


CE_FORWARD_SCRIPT = CE_CASE + """
from torch._subclasses.fake_tensor import FakeTensorMode
assert tg._TRITON_INTERPRET
out = []
cases = [(128, 256, None, None), (100, 300, (4, 64, 4), None), (1, 17, (2, 16, 1), None), (130, 129, (8, 32, 4), None),
         (64, 200, None, (50.0, 10.0))]  # last: a speedrunner's new softcap, which the kernels take as arguments
for t, v, tile, constants in cases:
    if constants is not None:
        tg.SOFTCAP, tg.SOFTCAP_WIDTH = constants
    logits, targets, ref_lse, ref_per_token, _ = ce_case(t, v)
    if tile is not None:
        tg.CE_FORWARD_TILE = tile
    lse, per_token = torch.full((t,), float("nan")), torch.full((t,), float("nan"))
    tg.launch_softcap_ce_forward(logits, targets, lse, per_token)
    out.append(dict(shape=[t, v], tile=tile, constants=constants,
                    all_written=not (lse.isnan().any() or per_token.isnan().any()).item(),
                    lse_rel_err=((lse.double() - ref_lse).abs().max() / ref_lse.abs().max()).item(),
                    loss_rel_err=((per_token.double() - ref_per_token).abs().max()
                                  / ref_per_token.abs().max()).item()))
    loss, lse = torch.ops.speedrun.softcap_ce_forward(logits, targets)
    with FakeTensorMode() as mode:
        fake = torch.ops.speedrun.softcap_ce_forward(mode.from_tensor(logits), mode.from_tensor(targets))
    out.append(dict(op_loss_rel_err=abs(loss.item() - ref_per_token.sum().item()) / ref_per_token.sum().item(),
                    op_lse_rel_err=((lse.double() - ref_lse).abs().max() / ref_lse.abs().max()).item(),
                    op=[[list(r.shape), str(r.dtype)] for r in (loss, lse)],
                    fake=[[list(f.shape), str(f.dtype)] for f in fake], tokens=t))
print(json.dumps(out))
"""


def test_fused_ce_forward_kernel_is_the_plain_softcapped_cross_entropy_for_ragged_tiles(interpreter_runs):
    """The forward's Triton pass in the interpreter (its fast math, with the interpreter's exact tanh): per-token
    log-sum-exp and loss against float64 of the plain softcap and cross-entropy, several tiles (CE_FORWARD_TILE; V
    swept in chunks, ragged last rows and columns), every row written (NaN-poisoned buffers), also with a new SOFTCAP
    and SOFTCAP_WIDTH; the custom op sums the per-token losses, and its fake reports the real shapes and dtypes."""
    rows = interpreted(interpreter_runs, "ce_forward")
    kernel_rows = [row for row in rows if "lse_rel_err" in row]
    op_rows = [row for row in rows if "op_loss_rel_err" in row]
    assert len(kernel_rows) == 5 and len(op_rows) == 5
    assert kernel_rows[-1]["constants"] == [50.0, 10.0]
    for row in kernel_rows:
        assert row["all_written"], row
        assert row["lse_rel_err"] < 1e-6 and row["loss_rel_err"] < 1e-5, row
    for row in op_rows:
        assert row["op_loss_rel_err"] < 1e-6 and row["op_lse_rel_err"] < 1e-6, row
        assert row["op"] == row["fake"] == [[[], "torch.float32"], [[row["tokens"]], "torch.float32"]], row


FUSED_HEAD_SCRIPT = """
import json, torch, train_gpt as tg
from torch._subclasses.fake_tensor import FakeTensorMode
F = torch.nn.functional
assert tg._TRITON_INTERPRET


def plain_e5m2_gradient(logits, targets, grad):
    leaf = logits.detach().float().requires_grad_()
    (g,) = torch.autograd.grad(F.cross_entropy(tg.softcap(leaf), targets, reduction="sum"), leaf, grad)
    return tg.quantize_e5m2(g.bfloat16(), tg.FP8_GRAD_SCALE)


out = []
for seed, (t, v, d) in enumerate([(64, 384, 128), (7, 1000, 32)]):
    g = torch.Generator().manual_seed(seed)
    x = tg.norm(torch.randn(t, d, generator=g)).bfloat16().requires_grad_()
    w = (torch.randn(v, d, generator=g) * 0.1).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (t,), generator=g)
    results = {}
    for name, head in (("plain", tg.lm_head_loss), ("fused", tg.fused_lm_head_loss),
                       ("compiled", torch.compile(tg.fused_lm_head_loss, backend="aot_eager", fullgraph=True))):
        loss = head(x, w, targets, True)
        (loss / 4).backward()
        results[name] = (loss.detach(), x.grad.clone(), w.grad.clone())
        x.grad = w.grad = None
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    exact = torch.autograd.grad(F.cross_entropy(30 * torch.sigmoid((xd @ wd.T) / 7.5), targets, reduction="sum") / 4,
                                (xd, wd))
    logits = tg.lm_head_fp8(x.detach(), w.detach())
    _, lse = torch.ops.speedrun.softcap_ce_forward(logits, targets)
    args = (logits, lse, targets, torch.tensor(0.25), tg.FP8_GRAD_SCALE)
    g_f8, g_f8_t = torch.ops.speedrun.softcap_ce_backward(*args)
    with FakeTensorMode() as mode:
        fake = torch.ops.speedrun.softcap_ce_backward(*(mode.from_tensor(a) if torch.is_tensor(a) else a for a in args))
    # the bytes, compared as magnitudes (sign bit apart): the interpreter's casts to bf16 and e5m2 round towards zero
    # where GPUs round to nearest, so a byte may sit one e5m2 step lower, or at half a power of two (a dropped carry)
    k = g_f8.view(torch.uint8).int()
    e = plain_e5m2_gradient(logits, targets, torch.tensor(0.25)).view(torch.uint8).int()
    step = (e & 0x7F) - (k & 0x7F)
    same_sign = ((k & 0x80) == (e & 0x80)) | ((k & 0x7F) == 0) | ((e & 0x7F) == 0)
    explained = same_sign & ((step == 0) | (step == 1) | ((step == 4) & ((e & 3) == 0)))
    out.append(dict(case=[t, v, d], loss_rel_err=abs(results["fused"][0].item() / results["plain"][0].item() - 1),
                    grad_rel_errs=[rel(results["fused"][i], results["plain"][i]) for i in (1, 2)],
                    float64_grad_rel_errs={name: [rel(results[name][i], exact[i - 1]) for i in (1, 2)]
                                           for name in ("plain", "fused")},
                    compiled_equal=all(torch.equal(a, b) for a, b in zip(results["compiled"], results["fused"])),
                    bytes_equal_share=(step == 0).double().mean().item(), bytes_explained=bool(explained.all()),
                    transposed_equal=torch.equal(g_f8_t.view(torch.uint8), g_f8.view(torch.uint8).t().contiguous()),
                    fake_equal=[(r.shape, r.stride(), r.dtype) == (f.shape, f.stride(), f.dtype)
                                for r, f in zip((g_f8, g_f8_t), fake)]))
print(json.dumps(out))
"""


def test_fused_head_is_the_plain_fp8_head_in_the_interpreter_eager_and_compiled(interpreter_runs):
    """FusedLMHeadLoss with its real Triton passes (interpreter) against the plain lm_head_loss with FP8 operands:
    the same loss; e5m2 gradient bytes equal to e5m2(bf16(autograd's gradient) / FP8_GRAD_SCALE) but where the
    interpreter's own casts round towards zero, so gradients within those bytes' difference (and as close to the
    float64 textbook loss's as the plain head's); compiled (aot_eager)
    equal to eager bit for bit; the backward op's fake reports the real shapes, strides and dtypes."""
    rows = interpreted(interpreter_runs, "fused_head")
    assert len(rows) == 2
    for row in rows:
        assert row["loss_rel_err"] < 1e-6, row
        assert row["bytes_explained"] and row["bytes_equal_share"] > 0.9 and row["transposed_equal"], row
        assert max(row["grad_rel_errs"]) < 0.03, row
        # as far from the float64 textbook gradient as the plain FP8 head is (its FP8 operands' rounding)
        for fused, plain in zip(row["float64_grad_rel_errs"]["fused"], row["float64_grad_rel_errs"]["plain"]):
            assert fused < 1.1 * plain < 0.15, row
        assert row["compiled_equal"] and row["fake_equal"] == [True, True], row


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
