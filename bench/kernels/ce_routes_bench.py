"""The parts from which a one-read training cross-entropy could be built, timed on one stage-3 micro-batch (GPU), so
that a route is chosen by measurement before it is built (bench/notes/cross_entropy_one_read.md reads the sources):

    python3 bench/kernels/ce_routes_bench.py --out ce_routes.json [--tokens 49152]

  floor          the trainer's forward pass (log-sum-exp) + backward pass (the e5m2 gradient in both layouts)
                 against the floor (one read of the logits + the two e5m2 writes) at this GPU's copy bandwidth
                 (ce_kernel_bench.training_against_floor)
  quack_ce_dx    quack's cross-entropy forward with return_dx: one read of the bf16 logits, the bf16 gradient written
                 in the same pass (one row across a cluster): how fast a one-read row kernel runs at this shape
  transpose      the trainer's transpose_bytes of a (T, V) byte tensor: the price of writing the second layout in a
                 pass of its own, after a row kernel that writes only the first
  scaled_mm      the trainer's FP8 lm_head (torch._scaled_mm, fast accumulation) into bf16 logits
  quack_fp8_gemm quack's GEMM on the same FP8 operands into bf16 (untuned default config): what a GEMM whose epilogue
                 could sum exp per row would start from

A part that fails (a library version without it, a kernel that does not compile) is reported with its error, not
fatal. Times are ce_kernel_bench.kernel_ms's medians; GB/s counts the bytes each part must move.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train_gpt as tg  # noqa: E402
from ce_kernel_bench import kernel_ms, training_against_floor  # noqa: E402

VOCAB, WIDTH = 50304, 768


def part(rows: dict, name: str, fn, bytes_moved: int, **extra):
    """Time fn as rows[name] (ms, GB/s and `extra`), or record why it could not run."""
    try:
        fn()
        torch.cuda.synchronize()
        ms = kernel_ms(fn)
        rows[name] = dict(ms=ms, bytes=bytes_moved, GB_per_s=bytes_moved / (ms * 1e-3) / 1e9, **extra)
    except Exception as e:  # noqa: BLE001 (a part this machine cannot run is a result too)
        rows[name] = dict(error=f"{type(e).__name__}: {e}"[:300])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="ce_routes.json")
    ap.add_argument("--tokens", type=int, default=49152, help="rows of logits (a stage-3 micro-batch: 49,152)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: ce_routes_bench.py needs a CUDA GPU (it times the real kernels)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    T, V = a.tokens, VOCAB
    x = tg.norm(torch.randn(T, WIDTH, device="cuda")).bfloat16()
    w = (torch.randn(V, WIDTH, device="cuda") * 0.05).bfloat16()
    logits = tg.lm_head_fp8(x, w)
    targets = torch.randint(0, V, (T,), device="cuda")
    grad = torch.tensor(0.125, device="cuda")
    out, out_t = (torch.empty(shape, dtype=torch.uint8, device="cuda") for shape in ((T, V), (V, T)))
    floor = training_against_floor(logits, targets, grad, out, out_t)
    rows = {}

    def quack_ce():
        from quack.cross_entropy import cross_entropy_fwd
        return cross_entropy_fwd(logits, targets, return_lse=True, return_dx=True)
    part(rows, "quack_ce_dx", quack_ce, T * V * (2 + 2), note="bf16 dx: an e5m2 row-major write would move 1 byte, "
                                                                "not 2, per element")
    part(rows, "transpose", lambda: tg.transpose_bytes(out), 2 * T * V)
    x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    part(rows, "scaled_mm", lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                     use_fast_accum=True), T * V * 2 + (T + V) * WIDTH)
    logits_q = torch.empty((T, V), dtype=torch.bfloat16, device="cuda")

    def quack_fp8():
        import quack.gemm_interface as gi
        return gi.gemm(x8, w8.mT, out=logits_q, alpha=1.0, tuned=False)
    part(rows, "quack_fp8_gemm", quack_fp8, T * V * 2 + (T + V) * WIDTH)
    for name in ("scaled_mm", "quack_fp8_gemm"):
        if "ms" in rows[name]:
            rows[name]["tflops"] = 2 * T * V * WIDTH / (rows[name]["ms"] * 1e-3) / 1e12
    if "ms" in rows["scaled_mm"] and "ms" in rows["quack_fp8_gemm"]:
        ref = torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=True)
        rows["quack_fp8_gemm"]["rel_diff_vs_scaled_mm"] = ((logits_q.float() - ref.float()).norm()
                                                           / ref.float().norm()).item()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, tokens=T, vocab=V, rows=rows,
                  floor=floor, command=" ".join(["python3", *sys.argv]))
    Path(a.out).write_text(json.dumps(result, indent=1))
    for name, row in rows.items():
        print(f"{name:>15}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in row.items() if k != "bytes"))
    print(f"ours: {floor['training_ms']:.3f} ms, {floor['training_over_floor']:.2f}x the floor of {floor['floor_ms']:.3f} "
          f"ms ({floor['copy_gb_per_s']:.0f} GB/s copy bandwidth)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
