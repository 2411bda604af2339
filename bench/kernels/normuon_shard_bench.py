"""NorMuon at one rank's shard of a W-GPU run, on one GPU: per group, the GPU time of its update (momentum,
orthogonalizer, second moment, cautious update) and the GPU time and wall time of the whole NorMuon.step, beside
the orthogonalizer's FLOP time at the bf16 peak measured in the same process. The process becomes rank R of W
through torch's fake process group (bench.emulate_rank): the shard is exactly that rank's, its collectives move
nothing. The model is the trainer's (its defaults, the record's, plus any train_gpt.py flags after `--`), its
gradients Gaussian.

    python3 bench/kernels/normuon_shard_bench.py --out F.json [--trainer-dir DIR] [--world-size 8] [--rank 0]
        [--orthogonalizer polar|turbo] [--repeats 20] [--tiles] [-- TRAIN_FLAGS]
    python3 bench/kernels/normuon_shard_bench.py --compare A1.json A2.json ... --against B1.json B2.json ...

--trainer-dir: the folder whose train_gpt.py is measured (an older commit's, for an A/B: run A and B alternately,
one process each). --tiles: also each group's orthogonalizer with 128x128 and with 64x64 tiles forced, beside the
tiles kernel_config picks. --compare: per group and for the whole step, the medians of two sets of runs, the
difference of the medians (B - A) and its 95 % interval (percentile bootstrap over the runs).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from ab import bootstrap_interval  # noqa: E402  (the interval ab.py reports)
DEVICE = "cuda"  # the CPU tests set "cpu"


def load_trainer(folder: Path):
    """train_gpt from `folder`, then bench.py (which finds that module already imported)."""
    sys.path.insert(0, str(folder))
    import train_gpt as tg
    sys.path.insert(1, str(ROOT / "bench"))
    import bench
    assert Path(tg.__file__).resolve().parent == folder.resolve(), tg.__file__
    return tg, bench


def gaussian_gradients(tg, muon, seed: int = 0):
    """Each group's gradient stack and this rank's shard of it: Gaussian, at a gradient's scale."""
    import torch
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    for layout in muon._layout:
        for key in ("grads", "shard"):
            t = layout[key]
            t.copy_(torch.randn(t.shape, device=DEVICE, generator=gen) * 1e-3)


def orthogonalizer_tiles(tg, bench, muon, repeats: int) -> dict:
    """Per group with Triton kernels: the orthogonalizer on the group's shard (uncompiled) with the tiles
    kernel_config picks, and with 128x128 and 64x64 forced."""
    import torch
    rule, out = tg.kernel_config, {}

    def forced(tile):
        def config(kind, n, m, k, dtype):
            c = dict(rule(kind, n, m, k, dtype))
            if c["BLOCK_M"] >= 64:
                c.update(BLOCK_M=tile, BLOCK_N=tile, num_warps=8 if tile == 128 else 4)
            return c
        return config
    for group, layout in zip(muon.param_groups, muon._layout):
        n = layout["hi"] - layout["lo"]
        if n == 0:
            continue
        rows, cols = layout["shard"].shape[-2:]
        G = layout["shard"][:n].bfloat16()
        G = G.view(4 * n, rows // 4, cols) if layout["is_attn"] else G
        if min(G.shape[-2:]) < tg.KERNEL_MIN_DIM:
            continue
        row = {}
        for name, config in (("rule", rule), ("128", forced(128)), ("64", forced(64))):
            tg.kernel_config = config
            try:
                row[name] = bench.gpu_ms(lambda: tg.polar_express(G, turbo=muon.turbo), repeats)
            finally:
                tg.kernel_config = rule
        row["rule_tiles"] = rule("xxt", G.size(0), min(G.shape[-2:]), max(G.shape[-2:]), torch.bfloat16)["BLOCK_M"]
        out[f"{group['label']} {'x'.join(map(str, G.shape))}"] = row
    return out


def measure(a) -> dict:
    import torch
    import torch.distributed as dist
    tg, bench = load_trainer(Path(a.trainer_dir))
    if a.world_size > 1:
        bench.emulate_rank(a.rank, a.world_size)
    args = tg.parse_args([*a.train_flags, "--orthogonalizer", a.orthogonalizer])
    torch.manual_seed(0)
    model = tg.GPT(args, max_seq_len=128).to(DEVICE)
    _, muon = tg.build_optimizers(model, args)
    if DEVICE == "cuda":  # as the trainer: its per-shard math compiled
        muon.compile_helpers()
    for group in muon.param_groups:
        group["lr"], group["momentum"] = group["initial_lr"], args.muon_momentum_warmup[1]
    gaussian_gradients(tg, muon)
    peak = bench.bf16_peak_flops()
    with torch.no_grad():
        muon.step()  # every compiled helper made, outside the measurements
        groups = bench.measure_normuon_groups(muon, peak, repeats=a.repeats)
        gaussian_gradients(tg, muon)
        step_gpu_ms = bench.gpu_ms(muon.step, a.repeats)
        step_wall_ms = statistics.median(bench.timed(muon.step, a.repeats))
        tiles = orthogonalizer_tiles(tg, bench, muon, a.repeats) if a.tiles else None
    cuda = DEVICE == "cuda"
    result = dict(
        device=torch.cuda.get_device_name() if cuda else DEVICE, torch=torch.__version__,
        triton=__import__("triton").__version__,
        commit=a.commit, trainer_dir=a.trainer_dir, command=" ".join([Path(sys.executable).name, *sys.argv]),
        world_size=a.world_size, rank=a.rank, orthogonalizer=a.orthogonalizer, train_flags=a.train_flags, bf16_peak_tflops=peak / 1e12,
        sm_count=torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
        normuon_groups=groups, step=dict(gpu_ms=step_gpu_ms, wall_ms=step_wall_ms, repeats=a.repeats,
                                         what="NorMuon.step on this rank's shard: its kernels' GPU time, and its "
                                              "wall time synchronised around each call (the host's launch time)"),
        orthogonalizer_tiles=tiles)
    if dist.is_initialized():
        dist.destroy_process_group()
    return result


def compare(a_files: list, b_files: list) -> dict:
    """Per group and for the whole step: the runs' GPU ms on each side, medians, B - A and its 95 % interval."""
    def series(files):
        out = {}
        for f in files:
            d = json.loads(Path(f).read_text())
            for label, g in d["normuon_groups"]["groups"].items():
                out.setdefault(label, []).append(g["gpu_ms"])
            out.setdefault("NorMuon.step (GPU)", []).append(d["step"]["gpu_ms"])
            out.setdefault("NorMuon.step (wall)", []).append(d["step"]["wall_ms"])
        return out
    a, b = series(a_files), series(b_files)
    rows = {}
    for key in a:
        if key not in b:
            continue
        lo, hi = bootstrap_interval(a[key], b[key])
        ma, mb = statistics.median(a[key]), statistics.median(b[key])
        rows[key] = dict(a_ms=a[key], b_ms=b[key], a_median_ms=ma, b_median_ms=mb, b_minus_a_ms=mb - ma,
                         interval_95_ms=[lo, hi], b_over_a=mb / ma if ma else None)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="the JSON to write")
    ap.add_argument("--trainer-dir", default=str(ROOT), help="the folder whose train_gpt.py is measured")
    ap.add_argument("--world-size", type=int, default=8, help="the run whose rank is measured (1, 2, 4 or 8)")
    ap.add_argument("--rank", type=int, default=0, help="which of its ranks")
    ap.add_argument("--orthogonalizer", default="polar", choices=("polar", "turbo"), help="Polar Express or Turbo-Muon")
    ap.add_argument("--repeats", type=int, default=20, help="calls profiled per measurement")
    ap.add_argument("--tiles", action="store_true", help="also the orthogonalizer with 128 and with 64 tiles forced")
    ap.add_argument("--commit", default="", help="recorded in the JSON")
    ap.add_argument("--compare", nargs="+", metavar="A.json", help="runs of side A (with --against: side B)")
    ap.add_argument("--against", nargs="+", metavar="B.json", help="runs of side B")
    ap.add_argument("train_flags", nargs="*", metavar="-- TRAIN_FLAGS", help="train_gpt.py flags (the model's)")
    a = ap.parse_args(argv)
    if a.compare:
        if not a.against:
            print("error: --compare needs --against B.json ...", file=sys.stderr)
            return 2
        rows = compare(a.compare, a.against)
        for key, r in rows.items():
            print(f"{key:<22} A {r['a_median_ms']:.4f}  B {r['b_median_ms']:.4f}  B-A {r['b_minus_a_ms']:+.4f} ms "
                  f"(95 % {r['interval_95_ms'][0]:+.4f} .. {r['interval_95_ms'][1]:+.4f})")
        if a.out:
            Path(a.out).write_text(json.dumps(rows, indent=1))
        return 0
    if a.world_size not in (1, 2, 4, 8) or not 0 <= a.rank < a.world_size:
        print(f"error: --world-size {a.world_size} --rank {a.rank}: give W in 1, 2, 4, 8 and a rank below it",
              file=sys.stderr)
        return 2
    if not a.out:
        print("error: give --out F.json", file=sys.stderr)
        return 2
    result = measure(a)
    Path(a.out).write_text(json.dumps(result, indent=1))
    g = result["normuon_groups"]
    print(", ".join(f"{label} {r['gpu_ms']:.3f} ms ({r['ratio']:.1f}x FLOP time)" for label, r in g["groups"].items())
          + f"; groups {g['gpu_ms']:.3f} ms; NorMuon.step GPU {result['step']['gpu_ms']:.3f} ms, wall "
          f"{result['step']['wall_ms']:.2f} ms")
    for key, row in (result["orthogonalizer_tiles"] or {}).items():
        print(f"orthogonalizer {key}: rule ({row['rule_tiles']}) {row['rule']:.4f} ms, 128 {row['128']:.4f}, "
              f"64 {row['64']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
