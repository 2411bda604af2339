"""GPU correctness checks and orthogonalizer timings (one device call, ~1 minute).

    python bench/gpu_checks.py --out bench/results/gpu_checks.json

Checks, each against a higher-precision reference on the same GPU:
  * FP8 lm_head op (forward, dX, dW) vs a float32 matmul
  * attention backends (PyTorch varlen_attn, FA3 / FA4 when installed) vs the plain-PyTorch reference, fwd + bwd;
    their speed on a stage-3 micro-batch (attention_speed)
  * the three Triton kernels vs float32 torch matmuls on the real shapes
  * Polar Express vs Turbo-Muon on the real parameter stacks: time and error vs the float64 SVD polar factor
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def time_ms(fn, reps=20):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def check_fp8(results):
    torch.manual_seed(0)
    T, d, V = 8192, 768, 50304
    x = tg.norm(torch.randn(T, d, device="cuda")).bfloat16().requires_grad_()
    w = (torch.randn(V, d, device="cuda") * 0.02).bfloat16().requires_grad_()
    out = tg.lm_head_fp8(x, w)
    g = torch.randn_like(out)
    out.backward(g)
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = xf @ wf.T
    ref.backward(g.float())
    results["fp8_lm_head"] = dict(shape=[T, d, V], out_rel_err=rel(out, ref), dx_rel_err=rel(x.grad, xf.grad),
                                  dw_rel_err=rel(w.grad, wf.grad), dw_dtype=str(w.grad.dtype))
    # compiled, fullgraph: the fake kernels must trace
    f = torch.compile(lambda a, b: tg.lm_head_fp8(a, b).float().sum(), fullgraph=True, dynamic=False)
    results["fp8_lm_head"]["compiled_matches_eager"] = abs(f(x, w).item() - out.float().sum().item()) < 1e-2 * abs(out.float().sum().item()) + 1


def check_fused_head(results):
    """FP8LMHeadCrossEntropySum (one Triton backward pass writing both e5m2 layouts) against the unfused path
    (lm_head_fp8 + softcapped CE, compiled: Inductor's kernel + cast + transpose kernel), on a 16384-token batch."""
    import triton.testing
    torch.manual_seed(0)
    T, d, V = 16384, 768, 50304
    x = tg.norm(torch.randn(T, d, device="cuda")).bfloat16().requires_grad_()
    w = (torch.randn(V, d, device="cuda") * 0.05).bfloat16().requires_grad_()
    targets = torch.randint(0, V, (T,), device="cuda")
    paths = dict(unfused=lambda a, b, t: tg.softcapped_cross_entropy_sum(tg.lm_head_fp8(a, b), t),
                 fused=tg.fp8_lm_head_cross_entropy_sum)
    out = {}
    for name, fn in paths.items():
        f = torch.compile(fn, fullgraph=True, dynamic=False)
        loss = f(x, w, targets)
        (loss / 8).backward()
        out[name] = (loss.detach(), x.grad.clone(), w.grad.clone())
        x.grad = w.grad = None

        def step():
            (f(x, w, targets) / 8).backward()
        out[name] += (triton.testing.do_bench(step, warmup=5, rep=50, return_mode="median"),)
        x.grad = w.grad = None
    # the e5m2 gradient itself: Triton kernel vs the same formula in PyTorch ops, byte by byte
    with torch.no_grad():
        logits = tg.lm_head_fp8(x, w)
        lse = tg.softcap_ce_forward(logits, targets)[1]
        grad = torch.tensor(0.125, device="cuda")
        k, k_t = torch.ops.speedrun.softcap_ce_backward(logits, lse, targets, grad, tg.FP8_GRAD_SCALE)
        r, r_t = tg.softcap_ce_backward_reference(logits, lse, targets, grad, tg.FP8_GRAD_SCALE)
    results["fused_fp8_head"] = dict(
        shape=[T, d, V], loss_rel_diff=abs((out["fused"][0] - out["unfused"][0]) / out["unfused"][0]).item(),
        dx_rel_diff=rel(out["fused"][1], out["unfused"][1]), dw_rel_diff=rel(out["fused"][2], out["unfused"][2]),
        g_f8_bytes_identical_share=(k.view(torch.uint8) == r.view(torch.uint8)).double().mean().item(),
        g_f8_rel_diff=rel(k.float(), r.float()),
        g_f8_t_is_transpose=bool(torch.equal(k_t.view(torch.uint8), k.t().contiguous().view(torch.uint8))),
        fwd_bwd_ms_unfused=out["unfused"][3], fwd_bwd_ms_fused=out["fused"][3])


def random_docs(T, max_len, device):
    lengths, total = [], 0
    gen = torch.Generator().manual_seed(1)
    while total < T:
        n = int(torch.randint(1, max_len + 1, (1,), generator=gen))
        n = min(n, T - total)
        lengths.append(n)
        total += n
    cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(torch.int32)
    cu = torch.cat([cu, torch.full((128 - len(cu) % 128,), T, dtype=torch.int32)])
    return cu.to(device)


def check_attention(results):
    torch.manual_seed(0)
    T, H, D = 4096, 6, 128
    cu = random_docs(T, 1500, "cuda")
    backends = {"varlen": tg.attention_varlen} if tg.varlen_available() else {}
    for name in ("fa3", "fa4"):
        try:
            tg.resolve_attention_backend(name, "cuda")
            backends[name] = tg.ATTENTION_BACKENDS[name]
        except tg.ConfigError as e:
            results[f"attention_{name}"] = f"unavailable: {e}"
    if "fa4" in backends:  # the CuTe DSL compiles its kernels at the first call: the cold-start cost
        q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        params = torch.tensor([[0.12, 384], [0.12, 384]], dtype=torch.float64)
        t = time.time()
        out = tg.attention_fa4(q, k, v, cu, 2048, params, 1)
        torch.cuda.synchronize()
        t_fwd = time.time() - t
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        results["attention_fa4_first_call_s"] = dict(forward=t_fwd, backward=time.time() - t - t_fwd)
    for window in (384, 1408):
        q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
        params = torch.tensor([[0.12, window], [0.12, window]], dtype=torch.float64)
        ref = tg.attention_reference(q, k, v, cu, 1500, params, 1)
        ref_grads = torch.autograd.grad(ref, (q, k, v), g)
        for name, fn in backends.items():
            out = fn(q, k, v, cu, 2048, params if name != "fa3" else ((0.12, window),) * 2, 1)
            grads = torch.autograd.grad(out, (q, k, v), g)
            results[f"attention_{name}_w{window}"] = dict(
                out_rel_err=rel(out, ref), dq_rel_err=rel(grads[0], ref_grads[0]),
                dk_rel_err=rel(grads[1], ref_grads[1]), dv_rel_err=rel(grads[2], ref_grads[2]))
            if name == "varlen":  # our custom op wraps the kernels of torch's public varlen_attn: same bits
                from torch.nn.attention.varlen import varlen_attn
                pub = varlen_attn(q, k, v, cu, cu, 2048, 2048, scale=0.12, window_size=(window, 0))
                pub_grads = torch.autograd.grad(pub, (q, k, v), g)
                # (dq is accumulated with atomics in FA2's backward: run to run it differs in the last bits)
                results[f"attention_{name}_w{window}"].update(
                    out_bit_identical_to_torch_varlen_attn=bool(torch.equal(out, pub)),
                    dk_dv_bit_identical_to_torch_varlen_attn=bool(torch.equal(grads[1], pub_grads[1])
                                                                  and torch.equal(grads[2], pub_grads[2])),
                    dq_rel_diff_to_torch_varlen_attn=rel(grads[0], pub_grads[0]))


def check_attention_speed(results):
    """Forward and forward+backward time of each available backend on one stage-3 micro-batch (49,152 tokens of
    log-normal documents, 6 heads of 128) at the stage-3 windows (640 and 1408 tokens)."""
    import numpy as np
    from bench import document_lengths  # bench/bench.py: the benchmark's synthetic documents
    T, H, D = 49152, 6, 128
    lengths = document_lengths(T, np.random.default_rng(0), median=600, max_len=2048)
    cu = tg.pack_cu_seqlens(lengths, T, tg.max_num_docs_for(T)).cuda()
    backends = {"varlen": tg.attention_varlen}
    try:
        tg.resolve_attention_backend("fa4", "cuda")
        backends["fa4"] = tg.attention_fa4
    except tg.ConfigError as e:
        results["attention_speed_fa4"] = f"unavailable: {e}"
    q, k, v = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    for window in (640, 1408):
        params = torch.tensor([[0.12, window], [0.12, window]], dtype=torch.float64)
        for name, fn in backends.items():
            def fwd():
                with torch.no_grad():
                    fn(q, k, v, cu, 2048, params, 1)

            def fwd_bwd():
                torch.autograd.grad(fn(q, k, v, cu, 2048, params, 1), (q, k, v), g)
            results[f"attention_speed_{name}_w{window}"] = dict(fwd_ms=time_ms(fwd), fwd_bwd_ms=time_ms(fwd_bwd))


def check_kernels(results):
    torch.manual_seed(0)
    for n, m, k in ((10, 768, 768), (8, 768, 3072)):
        X = torch.randn(n, m, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        A = tg.xxt(X)
        A_ref = X.float() @ X.float().mT
        B = tg.ba_plus_cAA(A, -2.0, 0.5)
        B_ref = -2.0 * A.float() + 0.5 * A.float() @ A.float()
        C = tg.ax_plus_bx(X, B, 3.0)
        C_ref = 3.0 * X.float() + B.float() @ X.float()
        results[f"triton_{n}x{m}x{k}"] = dict(
            xxt_rel_err=rel(A, A_ref), ba_plus_cAA_rel_err=rel(B, B_ref), ax_plus_bx_rel_err=rel(C, C_ref),
            xxt_ms=time_ms(lambda: tg.xxt(X, out=A)), xxt_torch_ms=time_ms(lambda: torch.bmm(X, X.mT)),
            ba_plus_cAA_ms=time_ms(lambda: tg.ba_plus_cAA(A, -2.0, 0.5, out=B)),
            ba_plus_cAA_torch_ms=time_ms(lambda: torch.baddbmm(A, A, A, beta=-2.0, alpha=0.5)),
            ax_plus_bx_ms=time_ms(lambda: tg.ax_plus_bx(X, B, 3.0, out=C)),
            ax_plus_bx_torch_ms=time_ms(lambda: torch.baddbmm(X, B, X, beta=3.0)))


def polar_factor(G):
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


def check_orthogonalizers(results):
    torch.manual_seed(0)
    stacks = {"attn 40x768x768": (40, 768, 768), "mlp 22x3072x768": (22, 3072, 768),
              "attn_gate 10x6x12": (10, 6, 12), "smear_gate 1x1x12": (1, 1, 12)}
    for name, shape in stacks.items():
        G = torch.randn(*shape, device="cuda")
        ref = polar_factor(G)
        row = {}
        for mode, turbo in (("polar", False), ("turbo", True)):
            fn = torch.compile(lambda x, t=turbo: tg.polar_express(x, turbo=t), dynamic=False, fullgraph=True)
            out = fn(G)
            sv = torch.linalg.svdvals(out.double())
            row[mode] = dict(ms=time_ms(lambda: fn(G)), polar_rel_err=rel(out, ref),
                             sv_min=sv.min().item(), sv_max=sv.max().item())
        results[f"orthogonalizer {name}"] = row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/gpu_checks.json")
    ap.add_argument("--checks", default="fp8,fused_head,attention,kernels,orthogonalizers",
                    help="comma-separated subset of fp8, fused_head, attention, attention_speed, kernels, orthogonalizers")
    a = ap.parse_args()
    import triton
    results = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                   device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   python=platform.python_version(), command=" ".join(["python3", *sys.argv]),
                   commit=subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip())
    checks = dict(fp8=check_fp8, fused_head=check_fused_head, attention=check_attention,
                  attention_speed=check_attention_speed, kernels=check_kernels,
                  orthogonalizers=check_orthogonalizers)
    for check in (checks[name] for name in a.checks.split(",")):
        try:
            check(results)
        except Exception as e:  # keep going: one broken check must not hide the others
            results[check.__name__] = f"FAILED: {type(e).__name__}: {e}"
        print(check.__name__, "done", flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
