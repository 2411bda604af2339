"""GPU checks: every fused kernel against its plain twin at the trainer's shapes, and the trainer's other GPU kernels
against higher-precision references, on the same GPU.

    python3 -m pytest -m gpu tests/gpu               # on a CUDA machine (a few minutes); skipped without CUDA
    SPEEDRUN_GPU_JSON=out.json python3 -m pytest -m gpu tests/gpu   # also write the numbers (tests/gpu/conftest.py)

The shapes are a one-GPU run's stage-3 micro-batch (49,152 tokens of log-normal documents), width 768, 6 heads of
128, vocabulary 50,304, and every stage's attention windows with the YaRN tables stretched as training stretches them.
  * FUSED_KERNELS, each fused twin against its plain function, both compiled as the trainer compiles them (a twin
    this machine cannot run, without FA4 or quack, is skipped and its reason recorded as `fused_<name>`):
      attention vs fused_attention: output and the qkv and value-embedding gradients, both against the plain
        function in fp32 (its FlashAttention swapped for the fp32 reference), per stage, with and without ve
      mlp vs fused_mlp, attention_output vs fused_attention_output: output and every gradient against float64
      lm_head_loss(fp8=True) vs fused_lm_head_loss: loss, dx and dw; and on the same logits the fused passes alone:
        the log-sum-exp, and the e5m2 gradient byte by byte against e5m2(bf16(autograd's gradient of the plain
        head's logits) / FP8_GRAD_SCALE), in a mild and a saturated softcap regime
  * the FP8 lm_head matmul (forward, dX, dW) vs float32, eager and compiled; its e4m3 quantisation byte by byte
    against the record's compiled division; dW in the weight's layout against the record's transposed product
  * FA2 (PyTorch's varlen kernels, the plain path) and FA4 against the fp32 reference attention, FA2 against torch's
    public varlen_attn (same bits), FA4 against FA2 on a stage-3 micro-batch with the speed of each, FA4's first call
  * the orthogonalizer's Triton kernels against float64 products; Polar Express and Turbo-Muon (the Triton path,
    bf16) against the same iteration in float64 and against the SVD polar factor, on NorMuon's stacks of a
    one-GPU run and of an 8-GPU rank (shapes from bench/kernels/orthogonalizer_bench.py, which derives them)
  * NorMuon's whole update on the shard of ranks 0 and 7 of 8 (one process through torch's fake process group),
    compiled as in training, against the same steps in float64, Polar Express and Turbo-Muon
Bounds sit about 1.5-3x above the errors measured on an H100 (bench/results/*gpu_checks*.json). Times are recorded,
never asserted: speed is bench/'s job.
"""
import functools
import inspect
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

# Everything this file takes from train_gpt.py and bench/, in one place.
BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path[:0] = [str(BENCH), str(BENCH / "kernels")]
import train_gpt as tg  # noqa: E402
from bench import document_lengths  # noqa: E402  (bench/bench.py: the benchmark's synthetic documents)
from orthogonalizer_bench import normuon_params, shard_shapes, stack_name  # noqa: E402
from train_gpt import (  # noqa: E402
    FP8_GRAD_SCALE,
    FP8_W_SCALE,
    FP8_X_SCALE,
    FUSED_KERNELS,
    Hyperparameters,
    Yarn,
    attention_reference,
    attention_varlen,
    ax_plus_bx,
    ba_plus_cAA,
    code_fingerprint,
    fa4_backward,
    fa4_forward,
    lm_head_fp8,
    max_num_docs_for,
    norm,
    pack_cu_seqlens,
    polar_express,
    polar_express_reference,
    quantize_e4m3,
    quantize_e5m2,
    xxt,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ARGS = Hyperparameters()
T3 = ARGS.train_bs_schedule[-1] // tg.grad_accum_steps_for(1)   # 49,152: a stage-3 micro-batch of a one-GPU run
D, H, HD = ARGS.model_dim, ARGS.num_heads, ARGS.head_dim
VOCAB = tg.next_multiple_of(ARGS.vocab_size, 128)
MAX_SEQ = ARGS.train_max_seq_len
# (name, short, long window in blocks): each stage's, then the final validation's (wider, no YaRN update)
WINDOWS = [(s.name, s.ws_short, s.ws_long) for s in tg.stages(ARGS)] + \
          [("final validation", tg.stages(ARGS)[-1].ws_short, ARGS.ws_validate_post_yarn_ext)]

ATTENTION_BOUND = 6e-3  # out/dq/dk/dv relative error vs the fp32 reference (measured 1.9e-3 to 2.9e-3, FA2 and FA4)
# From raw qkv, q, k and v + ve are rounded to bf16 before the attention kernels (the reference keeps them in fp32)
# and the q/k gradients pass through the norm's backward: on the CPU, those roundings alone, around an exact
# attention, gave 3.7e-3 (out), 4.4e-3 (dqkv) and 3.3e-3 (dve); the kernels' own error comes on top.
ATTENTION_QKV_BOUND = 1e-2


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def bf16_steps(a, exact) -> float:
    """The largest difference of a from exact (float64) in bf16 steps at exact's magnitude (8 significant bits)."""
    step = 2.0 ** (torch.floor(torch.log2(exact.double().abs().clamp_min(1e-30))) - 7)
    return ((a.double() - exact.double()).abs() / step).max().item()


def same_bytes(a, b) -> float:
    return (a.view(torch.uint8) == b.view(torch.uint8)).double().mean().item()


def time_ms(fn, warmup=25, rep=100) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


@functools.cache
def compiled(fn):
    """fn compiled as the trainer compiles its regions (one compiled object per function, reused by every test)."""
    return torch.compile(fn, fullgraph=True, dynamic=False)


def fused_kernel(name: str, results: dict) -> tg.FusedKernel:
    """FUSED_KERNELS[name], or a skip naming why its fused twin cannot run here (recorded as fused_<name>)."""
    kernel = FUSED_KERNELS[name]
    try:
        kernel.check_here(True)
    except Exception as e:  # what resolve_kernels catches: a missing library, an older GPU
        results[f"fused_{name}"] = f"unavailable: {type(e).__name__}: {e}"
        pytest.skip(f"fused {name} cannot run here: {type(e).__name__}: {e}")
    return kernel


def plain_code_unchanged(kernel: tg.FusedKernel) -> bool:
    """Whether the plain functions are still the code the fused kernel was checked against (else the trainer
    refuses the twin; this check then shows how far the edit moved them apart)."""
    return code_fingerprint(*kernel.follows) == kernel.fingerprint


def stage3_cu_seqlens(T: int = T3) -> torch.Tensor:
    lengths = document_lengths(T, np.random.default_rng(0), median=600, max_len=MAX_SEQ)
    return pack_cu_seqlens(lengths, T, max_num_docs_for(T)).cuda()


def random_cu_seqlens(T: int, max_len: int, seed: int = 1) -> torch.Tensor:
    """cu_seqlens of uniformly random document lengths in [1, max_len] summing to T, padded like the loader's."""
    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    while total < T:
        n = min(int(rng.integers(1, max_len + 1)), T - total)
        lengths.append(n)
        total += n
    return pack_cu_seqlens(lengths, T, max_num_docs_for(T)).cuda()


def single_window(window: int, scale: float = 0.12) -> torch.Tensor:
    """A window table whose two rows are the same (scale, window in tokens): a CPU tensor, as the model passes it."""
    return torch.tensor([[scale, window], [scale, window]], dtype=torch.float64)


def yarn_and_window_table(i: int) -> tuple:
    """The YaRN tables (on the GPU) and the window table of WINDOWS[i], stretched stage by stage as in training."""
    yarn = Yarn(HD, T3)
    for _, _, long in WINDOWS[:min(i + 1, len(WINDOWS) - 1)]:
        yarn.set_window(long)
    _, short, long = WINDOWS[i]
    table = tg.GPT.window_table(types.SimpleNamespace(yarn=yarn, block_size=ARGS.block_size), short, long)
    return yarn.cuda(), table


# ---- the FP8 lm_head matmul ---------------------------------------------------------------------------------------

def test_fp8_lm_head_matches_float32_matmul_eager_and_compiled(gpu_results):
    torch.manual_seed(0)
    T, d, V = 8192, D, VOCAB
    x = norm(torch.randn(T, d, device="cuda")).bfloat16().requires_grad_()
    w = (torch.randn(V, d, device="cuda") * 0.02).bfloat16().requires_grad_()
    out = lm_head_fp8(x, w)
    g = torch.randn_like(out)
    out.backward(g)
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = xf @ wf.T
    ref.backward(g.float())
    compiled_sum = torch.compile(lambda a, b: lm_head_fp8(a, b).float().sum(), fullgraph=True, dynamic=False)
    total, compiled_total = out.float().sum().item(), compiled_sum(x, w).item()
    r = gpu_results["fp8_lm_head"] = dict(
        shape=[T, d, V], out_rel_err=rel(out, ref), dx_rel_err=rel(x.grad, xf.grad), dw_rel_err=rel(w.grad, wf.grad),
        dw_dtype=str(w.grad.dtype), compiled_matches_eager=abs(compiled_total - total) < 1e-2 * abs(total) + 1)
    assert r["out_rel_err"] < 0.06, r   # e4m3 inputs: measured 0.038
    assert r["dx_rel_err"] < 0.09 and r["dw_rel_err"] < 0.09, r  # e5m2 gradient: measured 0.059
    assert w.grad.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert r["compiled_matches_eager"], (compiled_total, total)  # the fake kernels trace under fullgraph


def test_fp8_operand_quantisation_matches_the_records_compiled_quantiser(gpu_results):
    """quantize_e4m3's Triton pass (one read of x, both e4m3 layouts) against the record's two lines under
    torch.compile, x.div(scale).to(e4m3) (Inductor: fp32 arithmetic, one rounding), byte for byte, on a stage-3
    micro-batch's activations and on the lm_head weight; eager PyTorch's bf16 quotient is reported beside it."""
    torch.manual_seed(0)
    cases = dict(x=(norm(torch.randn(T3, D, device="cuda")).bfloat16(), FP8_X_SCALE),
                 w=((torch.randn(VOCAB, D, device="cuda") * 0.05).bfloat16(), FP8_W_SCALE))
    for name, (t, scale) in cases.items():
        record = torch.compile(lambda a: a.div(scale).to(torch.float8_e4m3fn), dynamic=False)
        q, q_t = quantize_e4m3(t, scale)
        ref = record(t)
        eager = t.div(scale).to(torch.float8_e4m3fn)
        r = gpu_results[f"fp8_quantize_{name}"] = dict(
            shape=list(t.shape),
            bytes_differing_from_compiled=int((q.view(torch.uint8) != ref.view(torch.uint8)).sum()),
            transpose_bytes_differing=int((q_t.view(torch.uint8) != ref.t().contiguous().view(torch.uint8)).sum()),
            share_of_eager_bytes_differing_from_compiled=1 - same_bytes(eager, ref),
            ms_triton=time_ms(lambda: quantize_e4m3(t, scale)),
            ms_compiled=time_ms(lambda: record(t).t().contiguous()))
        torch._dynamo.reset()
        assert r["bytes_differing_from_compiled"] == 0 and r["transpose_bytes_differing"] == 0, r


def test_fp8_weight_gradient_in_the_weights_layout_matches_the_records_product(gpu_results):
    """dW as (vocab, 768) bf16 straight from the GEMM against the record's (768, vocab) fp32 product transposed and
    cast to bf16 (what autograd then did with it): at most one bf16 step apart; the time of each way including
    the addition into an existing bf16 gradient (a second micro-batch)."""
    torch.manual_seed(0)
    T, d, V = T3, D, VOCAB
    x = norm(torch.randn(T, d, device="cuda")).bfloat16()
    w = (torch.randn(V, d, device="cuda") * 0.05).bfloat16()
    g = (torch.randn(T, V, device="cuda") * 1e-4).bfloat16()
    _, x_f8_t, w_f8_t = torch.ops.speedrun.fp8_matmul(x, w, FP8_X_SCALE, FP8_W_SCALE, FP8_GRAD_SCALE)
    g_f8 = quantize_e5m2(g, FP8_GRAD_SCALE)
    g_f8_t = g_f8.t().contiguous()
    scale_x, scale_g = (torch.tensor(s, device="cuda") for s in (FP8_X_SCALE, FP8_GRAD_SCALE))

    def ours():
        return torch._scaled_mm(g_f8_t, x_f8_t.T, out_dtype=torch.bfloat16, scale_a=scale_g, scale_b=scale_x)

    def records():
        return torch._scaled_mm(x_f8_t, g_f8_t.T, out_dtype=torch.float32, scale_a=scale_x, scale_b=scale_g).T

    new = torch.ops.speedrun.fp8_matmul_backward(g_f8, x_f8_t, w_f8_t, FP8_X_SCALE, FP8_W_SCALE, FP8_GRAD_SCALE)[1]
    old = records().to(torch.bfloat16)
    acc = torch.zeros(V, d, device="cuda", dtype=torch.bfloat16)

    def accumulate(fn):
        def step():
            acc.add_(fn().to(torch.bfloat16))
        return step
    r = gpu_results["fp8_weight_gradient"] = dict(
        shape=[T, d, V], contiguous=new.is_contiguous(), dtype=str(new.dtype),
        share_differing=(new != old).double().mean().item(),
        max_diff_in_bf16_steps=bf16_steps(new, old),
        equals_the_gemm_alone=bool(torch.equal(new, ours())),
        ms_gemm_ours=time_ms(ours), ms_gemm_records=time_ms(records),
        ms_with_accumulation_ours=time_ms(accumulate(ours)), ms_with_accumulation_records=time_ms(accumulate(records)))
    assert r["contiguous"] and r["dtype"] == "torch.bfloat16" and r["equals_the_gemm_alone"], r
    assert r["max_diff_in_bf16_steps"] <= 1.0 and r["share_differing"] < 0.01, r


# ---- attention kernels: FA2 (the plain path) and FA4 against the fp32 reference ------------------------------------

# FA4 on rotated q, k, v as an opaque op with autograd: the attention inside the fused twin, without its norm/rotary.
@torch.library.custom_op("speedrun_tests::fa4_attention", mutates_args=())
def fa4_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                     window_table: torch.Tensor, window_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    return fa4_forward(q, k, v, cu_seqlens, max_seqlen, window_table, window_row)


@fa4_attention_op.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, window_table, window_row):
    return torch.empty_like(q), q.new_empty((q.size(1), q.size(0)), dtype=torch.float32)


def _fa4_attention_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, window_table, window_row = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens, window_table, *output)
    ctx.max_seqlen, ctx.window_row = max_seqlen, window_row


def _fa4_attention_autograd(ctx, grad_out, _grad_lse):
    q, k, v, cu_seqlens, window_table, out, lse = ctx.saved_tensors
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    fa4_backward(grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, window_table, ctx.window_row,
                 dq, dk, dv)
    return dq, dk, dv, None, None, None, None


fa4_attention_op.register_autograd(_fa4_attention_autograd, setup_context=_fa4_attention_setup_context)


def fa4_attention(q, k, v, cu_seqlens, max_seqlen, window_table, window_row):
    return fa4_attention_op(q, k, v, cu_seqlens, max_seqlen, window_table, window_row)[0]


def attention_kernel(name: str, results: dict):
    """FA2's (attention_varlen) or FA4's attention, or a skip naming why FA4 cannot run here."""
    if name == "fa4":
        fused_kernel("attention", results)  # FA4 is the fused attention's kernel: the same check loads it
        return fa4_attention
    return attention_varlen


def test_fa4_first_call_compiles_and_runs(gpu_results):
    """FA4's CuTe DSL compiles its kernels at the first call: the cold-start cost (near zero when its on-disk
    kernel cache already holds them). Runs before the other FA4 tests of this file so it sees that first call."""
    fa4 = attention_kernel("fa4", gpu_results)
    T = 4096
    cu = random_cu_seqlens(T, 1500)
    q, k, v = (torch.randn(T, H, HD, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    t = time.time()
    out = fa4(q, k, v, cu, MAX_SEQ, single_window(384), 1)
    torch.cuda.synchronize()
    t_fwd = time.time() - t
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    gpu_results["attention_fa4_first_call_s"] = dict(forward=t_fwd, backward=time.time() - t - t_fwd)
    assert torch.isfinite(out).all() and all(torch.isfinite(p.grad).all() for p in (q, k, v))


@pytest.mark.parametrize("window", [384, 1408])
@pytest.mark.parametrize("kernel", ["varlen", "fa4"])
def test_attention_kernel_matches_the_fp32_reference(kernel, window, gpu_results):
    fn = attention_kernel(kernel, gpu_results)
    torch.manual_seed(0)
    T = 4096
    cu = random_cu_seqlens(T, 1500)
    q, k, v = (torch.randn(T, H, HD, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(T, H, HD, device="cuda", dtype=torch.bfloat16)
    table = single_window(window)
    ref = attention_reference(*(t.float() for t in (q, k, v)), cu, 1500, table, 1)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g.float())
    out = fn(q, k, v, cu, MAX_SEQ, table, 1)
    grads = torch.autograd.grad(out, (q, k, v), g)
    r = gpu_results[f"attention_{kernel}_w{window}"] = dict(
        out_rel_err=rel(out, ref), dq_rel_err=rel(grads[0], ref_grads[0]),
        dk_rel_err=rel(grads[1], ref_grads[1]), dv_rel_err=rel(grads[2], ref_grads[2]))
    if kernel == "varlen":  # our custom op wraps the kernels of torch's public varlen_attn: the same bits
        from torch.nn.attention.varlen import varlen_attn
        pub = varlen_attn(q, k, v, cu, cu, MAX_SEQ, MAX_SEQ, scale=0.12, window_size=(window, 0))
        pub_grads = torch.autograd.grad(pub, (q, k, v), g)
        r.update(out_bit_identical_to_torch_varlen_attn=bool(torch.equal(out, pub)),
                 dk_dv_bit_identical_to_torch_varlen_attn=bool(torch.equal(grads[1], pub_grads[1])
                                                               and torch.equal(grads[2], pub_grads[2])),
                 dq_rel_diff_to_torch_varlen_attn=rel(grads[0], pub_grads[0]))
        assert r["out_bit_identical_to_torch_varlen_attn"] and r["dk_dv_bit_identical_to_torch_varlen_attn"], r
        assert r["dq_rel_diff_to_torch_varlen_attn"] < 1e-4, r  # dq is summed with atomics: measured 1.4e-6 to 8e-6
    assert max(r["out_rel_err"], r["dq_rel_err"], r["dk_rel_err"], r["dv_rel_err"]) < ATTENTION_BOUND, r


@pytest.mark.parametrize("stage", [2, 3], ids=[WINDOWS[2][0], WINDOWS[3][0]])
def test_fa4_matches_fa2_on_a_stage3_micro_batch(stage, gpu_results):
    """One stage-3 micro-batch at the long window of stage 3 and of the extension: FA4 against FA2, and the forward
    and forward+backward time of each (attention_speed_<kernel>_w<window>)."""
    window = WINDOWS[stage][2] * ARGS.block_size
    cu = stage3_cu_seqlens()
    torch.manual_seed(0)
    q, k, v = (torch.randn(T3, H, HD, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(T3, H, HD, device="cuda", dtype=torch.bfloat16)
    table = single_window(window)
    outputs = {}
    kernels = [("varlen", attention_varlen)]
    try:
        kernels.append(("fa4", attention_kernel("fa4", gpu_results)))
    except pytest.skip.Exception:
        pass  # FA2 is still timed
    for name, fn in kernels:
        out = fn(q, k, v, cu, MAX_SEQ, table, 1)
        outputs[name] = (out, *torch.autograd.grad(out, (q, k, v), g))

        def fwd():
            with torch.no_grad():
                fn(q, k, v, cu, MAX_SEQ, table, 1)

        def fwd_bwd():
            torch.autograd.grad(fn(q, k, v, cu, MAX_SEQ, table, 1), (q, k, v), g)
        gpu_results[f"attention_speed_{name}_w{window}"] = dict(fwd_ms=time_ms(fwd), fwd_bwd_ms=time_ms(fwd_bwd))
    assert all(torch.isfinite(t).all() for t in outputs["varlen"])
    if "fa4" not in outputs:
        pytest.skip(f"FA4 unavailable, FA2 timed only: {gpu_results.get('fused_attention')}")
    diffs = [rel(a, b) for a, b in zip(outputs["fa4"], outputs["varlen"])]
    gpu_results[f"attention_fa4_vs_varlen_w{window}"] = dict(zip(("out", "dq", "dk", "dv"), diffs))
    assert max(diffs) < 2 * ATTENTION_BOUND, diffs  # two bf16 kernels, each within ATTENTION_BOUND of fp32


# ---- FUSED_KERNELS: each fused twin against its plain function ----------------------------------------------------

def grads_of(fn, inputs: list, grad: torch.Tensor, dtype) -> list:
    """[fn's output, the gradient of each input] with the inputs cast to dtype (None passes through)."""
    leaves = [None if t is None else t.detach().to(dtype).requires_grad_() for t in inputs]
    out = fn(*leaves)
    return [out, *torch.autograd.grad(out, [t for t in leaves if t is not None], grad.to(dtype))]


def twin_errors(plain: list, fused: list, ref: list, names: tuple) -> dict:
    return {name: dict(plain=rel(p, r), fused=rel(f, r), fused_vs_plain=rel(f, p))
            for name, p, f, r in zip(names, plain, fused, ref)}


@pytest.mark.parametrize("with_ve", [False, True], ids=["no_ve", "ve"])
@pytest.mark.parametrize("stage", range(len(WINDOWS)), ids=[w[0].replace(" ", "_") for w in WINDOWS])
def test_fused_attention_matches_plain_attention_against_fp32(stage, with_ve, gpu_results, monkeypatch):
    """fused_attention (q/k norm + rotary in one Triton pass, FlashAttention-4) and attention (compiled norm +
    rotary, FlashAttention-2) on a stage-3 micro-batch at a stage's windows and YaRN tables (the short and the long
    window row): output, qkv, value-embedding and gate gradients against attention in fp32 with attention_reference
    as its FlashAttention. The twin must be as close to fp32 as the plain function."""
    kernel = fused_kernel("attention", gpu_results)
    yarn, table = yarn_and_window_table(stage)
    cu = stage3_cu_seqlens()
    torch.manual_seed(0)
    qkv = (torch.randn(T3, 3 * H, HD, device="cuda") * 0.5).bfloat16()
    ve = torch.randn(T3, H, HD, device="cuda").bfloat16() if with_ve else None
    gate = torch.randn(T3, H, device="cuda").bfloat16()
    g = torch.randn(T3, H, HD, device="cuda").bfloat16()
    names = ("out", "dqkv", "dve", "dgate") if with_ve else ("out", "dqkv", "dgate")
    rows = {}
    for row, label in ((0, "short"), (1, "long")):
        def call(fn, dtype):
            return lambda q, v, gt: fn(q, v, gt, yarn.cos.to(dtype), yarn.sin.to(dtype), cu, MAX_SEQ, table, row)
        with monkeypatch.context() as m:
            m.setattr(tg, "flash_attention", attention_reference)
            ref = grads_of(call(tg.attention, torch.float32), [qkv, ve, gate], g, torch.float32)
        plain = grads_of(call(compiled(kernel.plain), torch.bfloat16), [qkv, ve, gate], g, torch.bfloat16)
        fused = grads_of(call(compiled(kernel.fused), torch.bfloat16), [qkv, ve, gate], g, torch.bfloat16)
        assert all(t.dtype == torch.bfloat16 for t in fused)
        rows[label] = twin_errors(plain, fused, ref, names)
        rows[label]["window_tokens"] = int(table[row, 1])
    r = gpu_results[f"fused_attention_{WINDOWS[stage][0].replace(' ', '_')}_{'ve' if with_ve else 'no_ve'}"] = dict(
        tokens=T3, plain_code_unchanged=plain_code_unchanged(kernel), **rows)
    for label in rows:
        for name in names:
            e = r[label][name]
            assert e["plain"] < ATTENTION_QKV_BOUND and e["fused"] < ATTENTION_QKV_BOUND, (label, name, r)
            assert e["fused"] <= 1.5 * e["plain"] + 5e-4, (label, name, r)  # FA4 and FA2 measured alike


def test_the_gate_backward_writes_what_fa4s_own_preprocess_writes(gpu_results):
    """On a stage-3 micro-batch: FA4's own backward preprocess and the attention gate's backward, each into
    NaN-filled buffers of FA4's sizes, from the same out, dout and lse: the same rows written, the row sums of
    dout·out to fp32 rounding, lse in log2 units and the zeroed dQ tiles equal; and on this machine fa4_backward hands
    the gate's backward FA4's buffers (its FA4 is the version whose preprocess it replaces, called as expected)."""
    fused_kernel("attention", gpu_results)
    fa4 = tg.fa4_interface()
    cu = stage3_cu_seqlens()
    torch.manual_seed(0)
    q, k, v = (torch.randn(T3, H, HD, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out, lse = fa4_forward(q, k, v, cu, MAX_SEQ, single_window(1408), 1)
    out = out.contiguous()
    gate, grad_y = torch.randn(T3, H, device="cuda").bfloat16(), torch.randn_like(out)
    d_out, d_gate = torch.empty_like(out), torch.empty_like(gate)
    tg.attention_gate_backward(grad_y, out, gate, lse, cu, d_out, d_gate)
    own, kept = fa4._bwd_preprocess, {}

    def keep_own(*args, **kwargs):  # FA4's own preprocess, into NaN-filled buffers
        buffers = [inspect.signature(own).bind(*args, **kwargs).arguments[name]
                   for name in ("dpsum", "lse_log2", "dq_accum")]
        for buf in buffers:
            buf.fill_(float("nan"))
        own(*args, **kwargs)
        kept["theirs"] = [buf.clone() for buf in buffers]
    fa4._bwd_preprocess = functools.update_wrapper(keep_own, own)
    try:
        fa4_backward(d_out, q, k, v, out, lse, cu, MAX_SEQ, single_window(1408), 1, dq=torch.empty_like(q),
                     dk=torch.empty_like(k), dv=torch.empty_like(v))
    finally:
        fa4._bwd_preprocess = own
    theirs = kept["theirs"]
    ours = [torch.full_like(t, float("nan")) for t in theirs]
    d_out2 = torch.empty_like(out)
    tg.attention_gate_backward(grad_y, out, gate, lse, cu, d_out2, torch.empty_like(gate), *ours)
    written = [bool(torch.equal(a.isnan(), b.isnan())) for a, b in zip(ours, theirs)]
    handed = []  # what fa4_backward hands the gate's backward here: FA4's three buffers, or None for each

    def fill(*buffers):
        handed.append([b is not None for b in buffers])
        tg.attention_gate_backward(grad_y, out, gate, lse, cu, d_out, torch.empty_like(gate), *buffers)
    fa4_backward(d_out, q, k, v, out, lse, cu, MAX_SEQ, single_window(1408), 1, dq=torch.empty_like(q),
                 dk=torch.empty_like(k), dv=torch.empty_like(v), fill_grad_out=fill)
    r = gpu_results["fa4_preprocess_by_the_gate_backward"] = dict(
        replaceable=tg.fa4_preprocess_replaceable(), buffers_handed=handed, same_rows_written=written,
        dpsum_rel_diff=rel(ours[0].nan_to_num(), theirs[0].nan_to_num()),
        lse_log2_equal=bool(torch.equal(ours[1].nan_to_num(), theirs[1].nan_to_num())),
        accumulator_equal=bool(torch.equal(ours[2].nan_to_num(), theirs[2].nan_to_num())),
        d_out_equal=bool(torch.equal(d_out, d_out2)))
    assert r["replaceable"] and handed == [[True, True, True]], r
    assert written == [True, True, True] and r["dpsum_rel_diff"] < 1e-5, r
    assert r["lse_log2_equal"] and r["accumulator_equal"] and r["d_out_equal"], r


def test_fused_mlp_matches_plain_mlp_against_float64(gpu_results):
    """fused_mlp (quack's GEMMs with ReLU² in their epilogues) and mlp compiled (cuBLAS + Inductor) on a stage-3
    micro-batch: output and the three gradients against float64 from the same bf16 inputs."""
    kernel = fused_kernel("mlp", gpu_results)
    torch.manual_seed(0)
    x = norm(torch.randn(T3, D, device="cuda")).bfloat16()
    w_fc = (torch.randn(4 * D, D, device="cuda") * D ** -0.5).bfloat16()
    w_proj = (torch.randn(4 * D, D, device="cuda") * (4 * D) ** -0.5).bfloat16()
    g = (torch.randn(T3, D, device="cuda") * 1e-3).bfloat16()
    inputs = [x, w_fc, w_proj]
    ref = grads_of(tg.mlp, inputs, g, torch.float64)
    plain = grads_of(compiled(kernel.plain), inputs, g, torch.bfloat16)
    fused = grads_of(compiled(kernel.fused), inputs, g, torch.bfloat16)
    r = gpu_results["fused_mlp"] = dict(shape=[T3, D, 4 * D], plain_code_unchanged=plain_code_unchanged(kernel),
                                        **twin_errors(plain, fused, ref, ("out", "dx", "dw_fc", "dw_proj")))
    assert all(t.dtype == torch.bfloat16 for t in fused)
    for name in ("out", "dx", "dw_fc", "dw_proj"):
        # measured against fp32: quack 2.4e-3 to 4.1e-3, Inductor 3.3e-3 to 4.1e-3
        assert r[name]["fused"] < 8e-3 and r[name]["fused"] <= 1.5 * r[name]["plain"] + 1e-3, (name, r)


def test_fused_attention_output_matches_plain_against_float64(gpu_results):
    """fused_attention_output (quack's gemm_add: the residual read in the GEMM's epilogue) and attention_output
    compiled (Inductor's addmm) on a stage-3 micro-batch: output and the residual, y and w gradients against
    float64; the residual's gradient is the incoming one, passed on unchanged by both."""
    kernel = fused_kernel("attention_output", gpu_results)
    torch.manual_seed(0)
    residual = torch.randn(T3, D, device="cuda").bfloat16()
    y = torch.randn(T3, D, device="cuda").bfloat16()
    w = (torch.randn(D, D, device="cuda") * D ** -0.5).bfloat16()
    g = torch.randn(T3, D, device="cuda").bfloat16()
    inputs = [residual, y, w]
    ref = grads_of(tg.attention_output, inputs, g, torch.float64)
    plain = grads_of(compiled(kernel.plain), inputs, g, torch.bfloat16)
    fused = grads_of(compiled(kernel.fused), inputs, g, torch.bfloat16)
    r = gpu_results["fused_attention_output"] = dict(
        shape=[T3, D, D], plain_code_unchanged=plain_code_unchanged(kernel),
        **twin_errors(plain, fused, ref, ("out", "d_residual", "dy", "dw")),
        d_residual_identical=bool(torch.equal(plain[1], fused[1]) and torch.equal(fused[1], g)),
        ms_fused=time_ms(lambda: compiled(kernel.fused)(residual, y, w)),
        ms_plain=time_ms(lambda: compiled(kernel.plain)(residual, y, w)))
    assert r["d_residual_identical"], r
    for name in ("out", "dy", "dw"):  # forward measured: quack 1.7e-3, addmm 2.1e-3
        assert r[name]["fused"] < 5e-3 and r[name]["fused"] <= 1.5 * r[name]["plain"] + 1e-3, (name, r)


# The lm_head's regimes: at w std 0.05 the logits have std about 1.4, where the softcap 30·sigmoid(logit/7.5) barely
# bends; at 0.6 (std about 17) much of the row sits where the sigmoid saturates, as late in training.
HEAD_REGIMES = dict(mild=0.05, saturated=0.6)
MICRO_BATCHES = tg.grad_accum_steps_for(1)  # the loss is divided by them: the head's backward gets 1/8


def head_inputs(T: int = T3, w_std: float = 0.05) -> tuple:
    """A micro-batch for the lm_head checks, seeded: normalised bf16 activations, bf16 weights, targets."""
    torch.manual_seed(0)
    x = norm(torch.randn(T, D, device="cuda")).bfloat16()
    w = (torch.randn(VOCAB, D, device="cuda") * w_std).bfloat16()
    return x, w, torch.randint(0, VOCAB, (T,), device="cuda")


def test_fused_lm_head_loss_matches_the_plain_fp8_head(gpu_results):
    """fused_lm_head_loss against lm_head_loss(fp8=True), both compiled, on a stage-3 micro-batch: the summed loss
    and dx, dw after (loss / 8).backward(). Both share the FP8 matmuls; they differ in the softcapped cross-entropy
    (the plain head's in PyTorch ops, exact; the twin's two Triton passes, fast math) and in its e5m2 gradient."""
    kernel = fused_kernel("lm_head_loss", gpu_results)
    x, w, targets = head_inputs()
    out, ms = {}, {}
    for name, fn in (("plain", kernel.plain), ("fused", kernel.fused)):
        f = torch.compile(lambda a, b, t, fn=fn: fn(a, b, t, True), fullgraph=True, dynamic=False)
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = f(xs, ws, targets)
        (loss / MICRO_BATCHES).backward()
        out[name] = (loss.detach(), xs.grad.clone(), ws.grad.clone())  # the timing below adds to .grad

        def step():
            (f(xs, ws, targets) / MICRO_BATCHES).backward()
        ms[name] = time_ms(step, warmup=5, rep=30)
    (loss_p, dx_p, dw_p), (loss_f, dx_f, dw_f) = out["plain"], out["fused"]
    r = gpu_results["fused_lm_head_loss"] = dict(
        shape=[T3, D, VOCAB], plain_code_unchanged=plain_code_unchanged(kernel), loss_rel_diff=abs(rel(loss_f, loss_p)),
        dx_rel_diff=rel(dx_f, dx_p), dw_rel_diff=rel(dw_f, dw_p), fwd_bwd_ms_plain=ms["plain"],
        fwd_bwd_ms_fused=ms["fused"])
    assert dx_f.dtype == dw_f.dtype == torch.bfloat16
    assert r["loss_rel_diff"] < 1e-4, r     # measured 8e-8 (16,384 tokens)
    assert r["dx_rel_diff"] < 5e-3 and r["dw_rel_diff"] < 5e-3, r  # e5m2 rounding flips: measured 1.8e-3, 1.7e-3


@pytest.mark.parametrize("regime", list(HEAD_REGIMES))
def test_fused_head_passes_match_the_plain_head_on_the_same_logits(regime, gpu_results, monkeypatch):
    """On one stage-3 micro-batch's FP8 logits: the twin's forward pass (log-sum-exp and loss) against the plain
    head's, and its backward's e5m2 gradient against the plain head's operand, e5m2(bf16(autograd's gradient of
    lm_head_loss at the logits, the loss times 1/8) / FP8_GRAD_SCALE), byte by byte. One e5m2 step is 12.5-25 % of
    a value, so the flips fast math makes at rounding boundaries must stay rare."""
    fused_kernel("lm_head_loss", gpu_results)
    x, w, targets = head_inputs(w_std=HEAD_REGIMES[regime])
    logits = lm_head_fp8(x, w)
    grad = torch.tensor(1 / MICRO_BATCHES, device="cuda")
    loss, lse = torch.ops.speedrun.softcap_ce_forward(logits, targets)
    g8, g8_t = torch.ops.speedrun.softcap_ce_backward(logits, lse, targets, grad, FP8_GRAD_SCALE)
    plain_g8 = torch.empty_like(g8)
    plain_loss = torch.zeros((), dtype=torch.float64, device="cuda")
    lse_diff = 0.0
    for start in range(0, T3, 8192):  # each token's gradient is its own: chunks of tokens save memory
        rows = slice(start, start + 8192)
        leaf = logits[rows].detach().requires_grad_()
        with monkeypatch.context() as m:  # the plain head itself, its logits the leaf
            m.setattr(tg, "lm_head_fp8", lambda a, b, leaf=leaf: leaf)
            part = tg.lm_head_loss(x[rows], w, targets[rows], True)
        (part * grad).backward()
        plain_g8[rows] = quantize_e5m2(leaf.grad, FP8_GRAD_SCALE)  # autograd's gradient is bf16 (the logits')
        plain_loss += part.detach().double()
        plain_lse = torch.logsumexp(tg.softcap(leaf.detach().float()), dim=-1)
        lse_diff = max(lse_diff, (lse[rows] - plain_lse).abs().max().item())
    r = gpu_results[f"fused_head_passes_{regime}"] = dict(
        logit_std=logits.float().std().item(),
        saturated_share=(logits.float().abs() > 15).double().mean().item(),  # |logit/7.5| > 2: sigmoid > 0.88
        lse_max_abs_diff=lse_diff, loss_rel_diff=abs(rel(loss, plain_loss)),
        g_f8_bytes_identical_share=same_bytes(g8, plain_g8), g_f8_rel_diff=rel(g8.float(), plain_g8.float()),
        g_f8_t_is_transpose=bool(torch.equal(g8_t.view(torch.uint8), g8.t().contiguous().view(torch.uint8))))
    assert r["g_f8_t_is_transpose"], r
    assert r["lse_max_abs_diff"] < 1e-2, r  # tanh.approx moves a softcapped logit by at most 30 x 2^-12
    assert r["loss_rel_diff"] < 1e-4, r     # measured 1.7e-7
    assert r["g_f8_bytes_identical_share"] > 0.999, r  # measured 0.99996 (saturated) to 0.99999 (mild)
    assert r["g_f8_rel_diff"] < 1e-4, r     # measured 3.6e-6 to 1.2e-5


# ---- orthogonalizers ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,m,k", [(10, 768, 768), (8, 768, 3072)])
def test_orthogonalizer_triton_kernels_match_float64(n, m, k, gpu_results):
    torch.manual_seed(0)
    X = torch.randn(n, m, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    A = xxt(X)
    A_ref = X.double() @ X.double().mT
    B = ba_plus_cAA(A, -2.0, 0.5)
    B_ref = -2.0 * A.double() + 0.5 * A.double() @ A.double()
    C = ax_plus_bx(X, B, 3.0)
    C_ref = 3.0 * X.double() + B.double() @ X.double()
    r = gpu_results[f"triton_{n}x{m}x{k}"] = dict(
        xxt_rel_err=rel(A, A_ref), ba_plus_cAA_rel_err=rel(B, B_ref), ax_plus_bx_rel_err=rel(C, C_ref),
        xxt_ms=time_ms(lambda: xxt(X, out=A)), xxt_torch_ms=time_ms(lambda: torch.bmm(X, X.mT)),
        ba_plus_cAA_ms=time_ms(lambda: ba_plus_cAA(A, -2.0, 0.5, out=B)),
        ba_plus_cAA_torch_ms=time_ms(lambda: torch.baddbmm(A, A, A, beta=-2.0, alpha=0.5)),
        ax_plus_bx_ms=time_ms(lambda: ax_plus_bx(X, B, 3.0, out=C)),
        ax_plus_bx_torch_ms=time_ms(lambda: torch.baddbmm(X, B, X, beta=3.0)))
    # bf16 outputs of fp32 accumulation: measured 1.6e-3 to 1.8e-3
    assert max(r["xxt_rel_err"], r["ba_plus_cAA_rel_err"], r["ax_plus_bx_rel_err"]) < 4e-3, r


def normuon_stacks() -> dict:
    """{name: (shape, dtype)}: the distinct stacks NorMuon orthogonalizes in a one-GPU run and on a rank of eight."""
    stacks, seen = {}, set()
    for world in (1, 8):
        for e in shard_shapes(normuon_params(world), world):
            key = (tuple(e["shape"]), getattr(torch, e["dtype"]))
            if key not in seen:
                seen.add(key)
                stacks[f"W{world} {stack_name(e['group'], e['shape'])}"] = key
    return stacks


STACKS = normuon_stacks()
# The Triton path (bf16 kernels) against the same iteration in float64: emulating the kernels' roundings (fp32
# accumulation, one bf16 rounding per product) gave 0.9 % to 1.1 % on Gaussian stacks of these shapes. The gates
# take the fp32 torch path, whose output is rounded to bf16 once (about 1e-3).
ITERATION_BOUND = {True: 2.5e-2, False: 3e-3}  # by whether the Triton kernels run (min(rows, cols) >= 64)


@pytest.mark.parametrize("stack", list(STACKS))
def test_polar_express_and_turbo_muon_match_their_float64_iteration_and_the_polar_factor(stack, gpu_results):
    """polar_express(G) and polar_express(G, turbo=True) as NorMuon runs them on CUDA, on Gaussian stacks of
    NorMuon's shapes: against polar_express_reference of the same G in float64 (the kernels' rounding alone) and
    against the exact polar factor U Vᵀ of a float64 SVD (the iteration's own approximation on top)."""
    shape, dtype = STACKS[stack]
    torch.manual_seed(0)
    G = torch.randn(*shape, device="cuda").to(dtype)
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    polar = U @ Vh
    triton_path = min(shape[-2:]) >= tg.KERNEL_MIN_DIM
    row = gpu_results[f"orthogonalizer {stack}"] = dict(triton_path=triton_path)
    for mode, turbo in (("polar", False), ("turbo", True)):
        out = polar_express(G, turbo=turbo)
        iteration = polar_express_reference(G.double(), turbo=turbo)  # a float64 G: the float64 iteration
        sv = torch.linalg.svdvals(out.double())
        row[mode] = dict(dtype=str(out.dtype), rel_err_vs_float64_iteration=rel(out, iteration),
                         polar_rel_err=rel(out, polar), sv_min=sv.min().item(), sv_max=sv.max().item(),
                         ms=time_ms(lambda turbo=turbo: polar_express(G, turbo=turbo)))
    for mode in ("polar", "turbo"):
        r = row[mode]
        assert r["dtype"] == "torch.bfloat16", (mode, row)
        assert r["rel_err_vs_float64_iteration"] < ITERATION_BOUND[triton_path], (mode, row)
        assert r["polar_rel_err"] < 0.2, (mode, row)  # measured 0.078 to 0.137 on Gaussian stacks
        assert r["sv_max"] < 1.2, (mode, row)         # measured <= 1.143
        if shape[-2] != shape[-1]:                     # square Gaussian matrices have near-zero singular values
            assert r["sv_min"] > 0.8, (mode, row)     # measured >= 0.857


# ---- NorMuon at a rank of 8 -----------------------------------------------------------------------------------------

NORMUON_SHARD_BOUND = {"torch.float32": 2e-2, "torch.bfloat16": 1.5e-2}  # measured 0.67-0.81 % and 0.34-0.60 %


@pytest.mark.parametrize("orthogonalizer", ["polar", "turbo"])
@pytest.mark.parametrize("rank", [0, 7])
def test_normuon_update_on_a_rank_of_8_matches_its_float64_steps(rank, orthogonalizer, gpu_results):
    """Rank 0 of 8 updates a share of every group (the gates included), rank 7 only 3072x768 matrices. Three steps of
    each group's shard update, compiled as in training, from Gaussian gradients, against the same three steps in
    float64: the relative error of the parameters' change."""
    from normuon_reference import shard_update_errors
    row = gpu_results[f"normuon_rank{rank}_of_8_{orthogonalizer}"] = shard_update_errors(
        rank, 8, orthogonalizer, flags=[], device="cuda", compiled=True)
    assert set(row) == ({"smear_gate", "attn_gate", "attn+mlp", "mlp"} if rank == 0 else {"attn+mlp", "mlp"}), row
    for label, r in row.items():
        assert r["update_rel_err"] < NORMUON_SHARD_BOUND[r["dtype"]], row
