"""quack-kernels against the trainer's own kernels, on the trainer's shapes (GPU; one JSON, one table).

    python bench/kernels/quack_kernels_bench.py --out quack.json [--commit SHA]

Answers, kernel by kernel, whether quack-kernels (CuTe DSL) is faster than what train_gpt.py runs today, and
whether its numbers agree within bf16 rounding:
  import   does quack import and run here (torch, triton, nvidia-cutlass-dsl versions recorded either way)
  mlp      the ReLU² MLP forward+backward per micro-batch (T x 768 -> T x 3072 -> T x 768, T = 16k/32k/48k):
           Inductor (torch.compile of the record's two lines: cuBLAS GEMMs + fused pointwise passes) against
           train_gpt's speedrun::relu2_mlp op (quack gemm_act / gemm_dact with the relu_sq epilogue); errors of
           both against an fp32 computation from the same bf16 inputs
  gemm     the two fused GEMMs alone, untuned (what the op runs) and autotuned, against cuBLAS without the
           activation: what the epilogue costs
  configs  the two fused GEMMs at T = 48k under each explicit Hopper tile config of quack's autotuning space
           (one compile each, time-boxed): which config to pin instead of the untuned default
  gram     Polar Express's symmetric products on the NorMuon stacks (40 x 768 x 768, 22 x 768 x 3072):
           our Triton xxt / ba_plus_cAA against quack gemm_symmetric and torch.bmm
  rmsnorm  the trunk's weightless RMS norm (T x 768) forward+backward: Inductor against quack's rmsnorm
  host     host time per call while the GPU is kept busy (pure dispatch cost, what decides whether a stage with
           little GPU work per step becomes bound by the CPU): cuBLAS, quack's GEMMs, the MLP op, FA4's ops
Times are medians of CUDA-event timings (triton.testing.do_bench). Each section that fails records its error.
"""
import argparse
import datetime
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402

D = 768
TOKENS = (16384, 32768, 49152)


def bench_ms(fn) -> float:
    import triton.testing
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref|: the error in units of the tensor's scale."""
    return ((got.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def versions() -> dict:
    out = dict(torch=torch.__version__, cuda=torch.version.cuda, gpu=torch.cuda.get_device_name(),
               capability=".".join(map(str, torch.cuda.get_device_capability())))
    for name in ("triton", "quack", "cutlass", "flash_attn"):
        try:
            out[name] = getattr(__import__(name), "__version__", "?")
        except Exception as e:
            out[name] = f"not importable ({type(e).__name__})"
    return out


def mlp_reference(x, w_fc, w_proj, grad):
    """fp32 from the same bf16 inputs: out, dx, dw_fc, dw_proj."""
    xf, wf, wp, gf = (t.float() for t in (x, w_fc, w_proj, grad))
    pre = xf @ wf.T
    h = F.relu(pre).square()
    dpre = (gf @ wp.T) * 2 * F.relu(pre)
    return h @ wp, dpre @ wf, dpre.T @ xf, h.T @ gf


def inductor_mlp(x, w_fc, w_proj):
    return F.relu(F.linear(x, w_fc)).square() @ w_proj


def quack_mlp(x, w_fc, w_proj):
    return torch.ops.speedrun.relu2_mlp(x, w_fc, w_proj)[0]


def mlp_inputs(T: int) -> tuple:
    """One micro-batch of T tokens as the trainer's MLP sees it, seeded by T: normalised bf16 activations, both
    (4d, d) weights at their init scale, and a small upstream gradient."""
    torch.manual_seed(T)
    x = tg.norm(torch.randn(T, D, device="cuda")).bfloat16()
    w_fc = (torch.randn(4 * D, D, device="cuda") * D ** -0.5).bfloat16()
    w_proj = (torch.randn(4 * D, D, device="cuda") * (4 * D) ** -0.5).bfloat16()
    grad = (torch.randn(T, D, device="cuda") * 1e-3).bfloat16()
    return x, w_fc, w_proj, grad


def section_mlp() -> list:
    rows = []
    compiled = torch.compile(inductor_mlp, dynamic=False, fullgraph=True)
    for T in TOKENS:
        x, w_fc, w_proj, grad = mlp_inputs(T)
        ref = mlp_reference(x, w_fc, w_proj, grad)
        row = dict(tokens=T)
        for name, fn in (("inductor", compiled), ("quack", quack_mlp)):
            leaves = [t.detach().clone().requires_grad_() for t in (x, w_fc, w_proj)]
            t0 = time.time()
            out = fn(*leaves)
            out.backward(grad)
            torch.cuda.synchronize()
            first_call_s = time.time() - t0
            errs = [rel_err(out, ref[0])] + [rel_err(leaf.grad, r) for leaf, r in zip(leaves, ref[1:])]

            def fwd():
                with torch.no_grad():
                    fn(*leaves)

            def fwd_bwd():
                for leaf in leaves:
                    leaf.grad = None
                fn(*leaves).backward(grad)
            row[name] = dict(first_call_s=round(first_call_s, 2), fwd_ms=bench_ms(fwd), fwd_bwd_ms=bench_ms(fwd_bwd),
                             rel_err=dict(zip(("out", "dx", "dw_fc", "dw_proj"), errs)))
        row["speedup_fwd_bwd"] = row["inductor"]["fwd_bwd_ms"] / row["quack"]["fwd_bwd_ms"]
        rows.append(row)
    return rows


def section_gemm() -> list:
    q = tg.quack_gemm()
    rows = []
    for T in TOKENS:
        torch.manual_seed(T)
        x = torch.randn(T, D, device="cuda").bfloat16()
        w_fc = (torch.randn(4 * D, D, device="cuda") * D ** -0.5).bfloat16()
        w_proj = (torch.randn(4 * D, D, device="cuda") * (4 * D) ** -0.5).bfloat16()
        grad = torch.randn(T, D, device="cuda").bfloat16()
        pre = x @ w_fc.T
        row = dict(tokens=T, cublas_fwd_ms=bench_ms(lambda: x @ w_fc.T),
                   cublas_bwd_first_ms=bench_ms(lambda: grad @ w_proj.T))
        for tuned in (False, True):
            key = "tuned" if tuned else "untuned"
            t0 = time.time()
            q.gemm_act(x, w_fc.mT, activation="relu_sq", tuned=tuned)
            q.gemm_dact(grad, w_proj.mT, pre, activation="relu_sq", tuned=tuned)
            torch.cuda.synchronize()
            row[f"{key}_first_call_s"] = round(time.time() - t0, 2)
            row[f"gemm_act_{key}_ms"] = bench_ms(lambda: q.gemm_act(x, w_fc.mT, activation="relu_sq", tuned=tuned))
            row[f"gemm_dact_{key}_ms"] = bench_ms(
                lambda: q.gemm_dact(grad, w_proj.mT, pre, activation="relu_sq", tuned=tuned))
        rows.append(row)
    return rows


def section_configs(budget_s: float = 300.0) -> list:
    """The two fused GEMMs at stage 3's micro-batch under each explicit Hopper tile configuration in quack's own
    autotuning space (swap_ab left out: the token dimension is the long one), one compile each, until the time
    budget runs out. The op runs quack's untuned default; a pinned winner is what the trainer could run instead.
    Every config must give the untuned outputs (same K order within a tile: expected bit-identical)."""
    from dataclasses import asdict
    from quack.gemm_config import default_config, get_all_configs
    q = tg.quack_gemm()
    T = TOKENS[-1]
    x, w_fc, w_proj, grad = mlp_inputs(T)
    pre = x @ w_fc.T
    ops = dict(gemm_act=lambda cfg: q.gemm_act(x, w_fc.mT, activation="relu_sq", tuned=False, config=cfg),
               gemm_dact=lambda cfg: q.gemm_dact(grad, w_proj.mT, pre, activation="relu_sq", tuned=False, config=cfg))
    flops = 2 * T * D * 4 * D
    configs = [c for c in get_all_configs() if c.device_capacity == torch.cuda.get_device_capability()[0]
               and not c.swap_ab]
    t_start, rows = time.time(), []
    for name, op in ops.items():
        want = [t.clone() for t in op(None)]
        base_ms = bench_ms(lambda: op(None))
        row = dict(op=name, tokens=T, untuned_ms=base_ms, untuned_tflops=flops / base_ms / 1e9,
                   untuned_config=asdict(default_config(x.device)), configs=[])
        for cfg in configs:
            if time.time() - t_start > budget_s:
                row["stopped"] = f"time budget {budget_s:.0f}s spent after {len(row['configs'])} configs"
                break
            entry = dict(tile=[cfg.tile_m, cfg.tile_n], cluster=[cfg.cluster_m, cfg.cluster_n],
                         pingpong=cfg.pingpong)
            try:
                t0 = time.time()
                got = op(cfg)
                torch.cuda.synchronize()
                entry["compile_s"] = round(time.time() - t0, 2)
                entry["max_abs_diff"] = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
                entry["ms"] = bench_ms(lambda: op(cfg))
                entry["tflops"] = flops / entry["ms"] / 1e9
            except Exception as e:
                entry["error"] = f"{type(e).__name__}: {e}"[:300]
            row["configs"].append(entry)
        for key, keep in (("best_bit_identical", lambda e: e["max_abs_diff"] == 0), ("best_any", lambda e: True)):
            ok = [e for e in row["configs"] if "ms" in e and keep(e)]
            if ok:
                best = min(ok, key=lambda e: e["ms"])
                row[key] = dict(best, speedup_vs_untuned=base_ms / best["ms"])
        rows.append(row)
    return rows


def section_gram() -> list:
    from quack.gemm_interface import gemm_symmetric
    rows = []
    for n, m, k in ((40, 768, 768), (22, 768, 3072)):
        torch.manual_seed(n)
        X = (torch.randn(n, m, k, device="cuda") / k ** 0.5).bfloat16()
        A_ref = X.float() @ X.float().mT
        A = A_ref.bfloat16()
        b, c = -2.808917465908714, 0.5000178451051316
        P_ref = b * A.float() + c * (A.float() @ A.float())
        row = dict(shape=[n, m, k])
        ours_a, ours_p = tg.xxt(X), tg.ba_plus_cAA(A, b, c)
        quack_a = gemm_symmetric(X, X.mT)
        quack_p = gemm_symmetric(A, A.mT, C=A, alpha=c, beta=b)
        row["rel_err"] = dict(triton_xxt=rel_err(ours_a, A_ref), quack_xxt=rel_err(quack_a, A_ref),
                              triton_poly=rel_err(ours_p, P_ref), quack_poly=rel_err(quack_p, P_ref))
        row["xxt_ms"] = dict(triton=bench_ms(lambda: tg.xxt(X)), quack=bench_ms(lambda: gemm_symmetric(X, X.mT)),
                             bmm=bench_ms(lambda: torch.bmm(X, X.mT)))
        row["poly_ms"] = dict(triton=bench_ms(lambda: tg.ba_plus_cAA(A, b, c)),
                              quack=bench_ms(lambda: gemm_symmetric(A, A.mT, C=A, alpha=c, beta=b)),
                              bmm=bench_ms(lambda: torch.baddbmm(A, A, A, beta=b, alpha=c)))
        rows.append(row)
    return rows


def section_rmsnorm() -> list:
    from quack import rmsnorm
    eps = torch.finfo(torch.bfloat16).eps  # F.rms_norm's default for bf16, which the trainer uses
    compiled = torch.compile(lambda x: F.rms_norm(x, (x.size(-1),)), dynamic=False, fullgraph=True)
    rows = []
    for T in TOKENS:
        x0 = torch.randn(T, D, device="cuda").bfloat16()
        grad = torch.randn(T, D, device="cuda").bfloat16()
        xr = x0.float().requires_grad_()
        ref = F.rms_norm(xr, (D,), eps=eps)
        ref.backward(grad.float())
        row = dict(tokens=T)
        for name, fn in (("inductor", compiled), ("quack", lambda x: rmsnorm(x, eps=eps))):
            x = x0.clone().requires_grad_()
            out = fn(x)
            out.backward(grad)
            row[f"{name}_rel_err"] = dict(out=rel_err(out, ref), dx=rel_err(x.grad, xr.grad))

            def fwd_bwd(fn=fn, x=x):
                x.grad = None
                fn(x).backward(grad)
            row[f"{name}_fwd_bwd_ms"] = bench_ms(fwd_bwd)
        rows.append(row)
    return rows


def host_us_per_call(fn, calls: int = 40) -> float:
    """CPU time to enqueue one call of fn while the GPU is kept busy (so that nothing waits for the GPU)."""
    for _ in range(3):  # compiled, plans cached
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU work ahead of the calls: they only enqueue
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def section_host(calls: int = 40) -> list:
    """Host microseconds per call at stage 1's micro-batch (16,384 tokens), where a step has the least GPU work
    to hide the CPU behind: each Python-dispatched kernel library call against a plain cuBLAS call."""
    T = TOKENS[0]
    q = tg.quack_gemm()
    x, w_fc, w_proj = (torch.randn(*s, device="cuda").bfloat16().requires_grad_()
                       for s in ((T, D), (4 * D, D), (4 * D, D)))
    grad = torch.randn(T, D, device="cuda").bfloat16()
    pre = (x @ w_fc.T).detach()
    compiled = torch.compile(inductor_mlp, dynamic=False, fullgraph=True)
    row = dict(tokens=T, calls=calls)
    cases = dict(
        cublas_mm=lambda: torch.mm(x.detach(), w_fc.detach().T),
        quack_gemm_act=lambda: q.gemm_act(x.detach(), w_fc.detach().mT, activation="relu_sq", tuned=False),
        quack_gemm_dact=lambda: q.gemm_dact(grad, w_proj.detach().mT, pre, activation="relu_sq", tuned=False),
        relu2_mlp_op_forward=lambda: torch.ops.speedrun.relu2_mlp(x.detach(), w_fc.detach(), w_proj.detach()),
        relu2_mlp_op_backward=lambda: torch.ops.speedrun.relu2_mlp_backward(grad, x.detach(), w_fc.detach(),
                                                                           w_proj.detach(), pre),
        inductor_mlp_fwd_bwd=lambda: compiled(x, w_fc, w_proj).backward(grad),
        quack_mlp_fwd_bwd=lambda: quack_mlp(x, w_fc, w_proj).backward(grad),
    )
    try:  # the other Python-dispatched library of a step: FlashAttention-4, through the trainer's calls
        tg.fa4_on_this_gpu()
        heads, hd = 6, 128
        qq, kk, vv = (torch.randn(T, heads, hd, device="cuda").bfloat16() for _ in range(3))
        cu = torch.arange(0, T + 1, 512, device="cuda", dtype=torch.int32)
        params = torch.tensor([[hd ** -0.5, 384.0]])
        out, lse = tg.fa4_forward(qq, kk, vv, cu, 512, params, 0)
        dq, dk, dv = (torch.empty_like(t) for t in (qq, kk, vv))
        cases["fa4_forward"] = lambda: tg.fa4_forward(qq, kk, vv, cu, 512, params, 0)
        cases["fa4_backward"] = lambda: tg.fa4_backward(out, qq, kk, vv, out, lse, cu, 512, params, 0, dq, dk, dv)
    except Exception as e:
        row["fa4"] = f"not measured ({type(e).__name__}: {e})"[:300]
    for name, fn in cases.items():
        try:
            row[f"{name}_host_us"] = host_us_per_call(fn, calls)
        except Exception as e:
            row[f"{name}_host_us"] = f"{type(e).__name__}: {e}"[:300]
    return [row]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="quack_kernels.json")
    ap.add_argument("--commit", default="", help="recorded in the JSON")
    ap.add_argument("--configs-budget", type=float, default=300.0, help="seconds the configs section may spend")
    ap.add_argument("--sections", default="mlp,gram,rmsnorm,host",
                    help="comma-separated; gemm (the fused GEMMs alone, untuned and autotuned) autotunes for minutes")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: quack_kernels_bench.py needs a CUDA GPU (it times the real kernels)", file=sys.stderr)
        return 2
    result = dict(question="Are quack-kernels' fused GEMM+ReLU², symmetric GEMM and RMSNorm faster than the "
                           "trainer's kernels on its shapes, and equal within bf16 rounding?",
                  device=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=a.commit,
                  command=" ".join(sys.argv),
                  versions=versions())
    try:
        tg.quack_on_this_gpu()
        result["import"] = "ok"
    except Exception as e:
        result["import"] = f"{type(e).__name__}: {e}"
    sections = dict(mlp=section_mlp, gemm=section_gemm, configs=lambda: section_configs(a.configs_budget), gram=section_gram,
                    rmsnorm=section_rmsnorm, host=section_host)
    for name in a.sections.split(","):
        t0 = time.time()
        try:
            result[name] = sections[name]()
        except Exception as e:
            result[name] = dict(error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-3000:])
        print(f"{name}: {time.time() - t0:.1f}s", flush=True)
        print(json.dumps(result[name], indent=1), flush=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
