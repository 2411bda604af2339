"""MLP with ReLU² in the GEMM epilogues: tile variants against the unfused path, on stage-1 and stage-3
micro-batches (GPU).

    python bench/relu2_mm_bench.py --out relu2_mm.json   # prints a table, then `best: BM,BN,BK,G,W,S` or `best: unfused`

Per micro-batch size it times (median, triton.testing.do_bench):
  * up projection: compiled F.relu(F.linear(x, w_fc)).square() (cuBLAS GEMM + Inductor pointwise; pre kept for the
    backward as the trainer's graph keeps it) vs linear_relu2 with each tile variant
  * backward epilogue: compiled (g @ w_proj^T) * 2 relu(pre) vs relu2_grad_mm with each variant
  * the whole MLP forward + backward, compiled, unfused vs relu2_mlp with the default tile (RELU2_MM_CONFIG)
and checks every variant against the unfused result (bf16: relative difference of pre, h and grad_pre).
Run it with throwaway TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR when a cold start is measured afterwards."""
import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402

VARIANTS = [(128, 256, 64, 8, 8, 3), (128, 256, 64, 8, 8, 4), (256, 128, 64, 8, 8, 3), (128, 128, 64, 8, 4, 4),
            (128, 128, 64, 8, 8, 4), (128, 256, 32, 8, 8, 5), (64, 256, 64, 8, 4, 4)]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main(argv=None) -> int:
    import triton.testing
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="relu2_mm.json")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: relu2_mm_bench.py needs a CUDA GPU (it times the real kernels)", file=sys.stderr)
        return 2
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
    up_unfused = torch.compile(lambda x, w: (lambda pre: (pre, F.relu(pre).square()))(F.linear(x, w)), dynamic=False)
    bwd_unfused = torch.compile(lambda g, wp, pre: (g @ wp.t()) * 2 * F.relu(pre), dynamic=False)

    def mlp_unfused(x, w_fc, w_proj):
        return F.relu(F.linear(x, w_fc)).square() @ w_proj
    mlps = dict(unfused=torch.compile(mlp_unfused, dynamic=False), fused=torch.compile(tg.relu2_mlp, dynamic=False))
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
                  default_config=list(tg.RELU2_MM_CONFIG), sizes={})
    totals = {v: 0.0 for v in VARIANTS}
    totals["unfused"] = 0.0
    torch.manual_seed(0)
    for T in (16384, 49152):
        x = tg.norm(torch.randn(T, 768, device="cuda")).bfloat16()
        w_fc = (torch.rand(3072, 768, device="cuda") * 2 - 1).mul(3 ** 0.5 * 0.5 / 768 ** 0.5).bfloat16()
        w_proj = (torch.randn(3072, 768, device="cuda") * 0.02).bfloat16()
        g = (torch.randn(T, 768, device="cuda") * 0.01).bfloat16()
        pre_ref, h_ref = up_unfused(x, w_fc)
        grad_ref = bwd_unfused(g, w_proj, pre_ref)
        row = dict(up_unfused_ms=bench(lambda: up_unfused(x, w_fc)),
                   bwd_unfused_ms=bench(lambda: bwd_unfused(g, w_proj, pre_ref)), variants={})
        totals["unfused"] += row["up_unfused_ms"] + row["bwd_unfused_ms"]
        pre, h, grad = (torch.empty_like(h_ref) for _ in range(3))
        for v in VARIANTS:
            try:
                tg.launch_linear_relu2(x, w_fc, pre, h, backward=False, config=v)
                tg.launch_linear_relu2(g, w_proj, pre_ref, grad, backward=True, config=v)
                r = dict(pre_rel_diff=rel(pre, pre_ref), h_rel_diff=rel(h, h_ref), grad_rel_diff=rel(grad, grad_ref),
                         up_ms=bench(lambda: tg.launch_linear_relu2(x, w_fc, pre, h, backward=False, config=v)),
                         bwd_ms=bench(lambda: tg.launch_linear_relu2(g, w_proj, pre_ref, grad, backward=True, config=v)))
                ok = max(r["pre_rel_diff"], r["h_rel_diff"], r["grad_rel_diff"]) < 1e-2
                totals[v] = totals[v] + r["up_ms"] + r["bwd_ms"] if ok else float("inf")
            except Exception as e:  # e.g. out of shared memory for a tile: the variant is out
                r, totals[v] = f"FAILED: {type(e).__name__}: {str(e)[:200]}", float("inf")
            row["variants"][",".join(map(str, v))] = r
        for name, fn in mlps.items():
            xr, wf, wp = (t.detach().requires_grad_() for t in (x, w_fc, w_proj))

            def step():
                out = fn(xr, wf, wp)
                torch.autograd.grad(out, (xr, wf, wp), g)
            row[f"mlp_fwd_bwd_{name}_ms"] = bench(step)
        out_f, out_u = mlps["fused"](x, w_fc, w_proj), mlps["unfused"](x, w_fc, w_proj)
        row["mlp_out_rel_diff"] = rel(out_f, out_u)
        result["sizes"][str(T)] = row
        print(f"T={T}: unfused up {row['up_unfused_ms']:.3f} + bwd {row['bwd_unfused_ms']:.3f} ms; "
              f"MLP fwd+bwd unfused {row['mlp_fwd_bwd_unfused_ms']:.3f} fused {row['mlp_fwd_bwd_fused_ms']:.3f} ms", flush=True)
        for name, r in row["variants"].items():
            print(f"  {name:>22}: " + (r if isinstance(r, str) else
                  f"up {r['up_ms']:.3f} bwd {r['bwd_ms']:.3f} ms (diff pre {r['pre_rel_diff']:.1e} h {r['h_rel_diff']:.1e} "
                  f"grad {r['grad_rel_diff']:.1e})"), flush=True)
    best = min(totals, key=totals.get)
    result["totals_ms"] = {(k if isinstance(k, str) else ",".join(map(str, k))): t for k, t in totals.items()}
    result["best"] = best if isinstance(best, str) else ",".join(map(str, best))
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"best: {result['best']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
