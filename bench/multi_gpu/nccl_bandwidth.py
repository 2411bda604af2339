"""NCCL's bandwidth at the sizes of the trainer's collectives on a wider world.

    torchrun --standalone --nproc_per_node=2 bench/multi_gpu/nccl_bandwidth.py --for-world-size 8 --out X.json

The collectives one training step launches at --for-world-size ranks, from the model's parameters (built on the meta
device, no memory): NorMuon's reduce-scatter of each group's stacked gradients and all-gather of the updated
matrices every step, DistAdam's reduce-scatter of each gradient and all-gather of each parameter every other step.
Each is timed here, at this run's world size, with CUDA events (median of --iters after a warm-up), and reported
as NCCL's bus bandwidth (algorithm bandwidth x (W-1)/W, the figure that stays comparable across world sizes for
reduce-scatter and all-gather); the time at --for-world-size is then size x (W'-1)/W' / that bandwidth.
"""
import argparse
import datetime
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # bench.py, for git_commit
import train_gpt as tg  # noqa: E402
from bench import git_commit  # noqa: E402


def step_collectives(world: int) -> list:
    """[(op, what, dtype, bytes of the full tensor, launches per step)] of one training step at `world` ranks."""
    args = tg.Hyperparameters()
    with torch.device("meta"):
        model = tg.GPT(args, max_seq_len=128)
    by_label = {}
    for p in model.parameters():
        by_label.setdefault(p.label, []).append(p)
    out = []
    normuon = [p for p in model.parameters() if p.treatment != "adam"]
    for name, ps in tg.normuon_groups(normuon, world)[0]:
        chunk = math.ceil(len(ps) / world)
        nbytes = chunk * world * ps[0].numel() * ps[0].element_size()
        for op in ("reduce_scatter", "all_gather"):
            out.append((op, f"NorMuon {name} ({len(ps)} x {'x'.join(map(str, ps[0].shape))})",
                        str(ps[0].dtype).removeprefix("torch."), nbytes, 1.0))
    adam_labels = [lab for lab in by_label if by_label[lab][0].treatment == "adam"]
    for label in sorted(adam_labels, key=lambda lab: (lab not in tg.DISTADAM_RECORD_ORDER,  # DistAdam's group order
                                                      tg.DISTADAM_RECORD_ORDER.index(lab)
                                                      if lab in tg.DISTADAM_RECORD_ORDER else 0)):
        for i, p in enumerate(by_label[label]):
            row = p.numel() // max(p.shape[0], 1) if p.dim() else 1
            for op in ("reduce_scatter", "all_gather"):  # on DistAdam's buffers: padded to W x rows_per_rank rows
                out.append((op, f"DistAdam {label}{i if len(by_label[label]) > 1 else ''} "
                                f"({'x'.join(map(str, p.shape))})", str(p.dtype).removeprefix("torch."),
                            tg.rows_per_rank(p, world) * world * row * p.element_size(), 0.5))
    return out


def time_collective(op: str, dtype: str, nbytes: int, iters: int) -> float:
    """Median ms of one collective on a tensor of nbytes (the full, unsharded size), this process group."""
    world = dist.get_world_size()
    dt = getattr(torch, dtype)
    full = torch.zeros(nbytes // torch.empty((), dtype=dt).element_size(), dtype=dt, device="cuda")
    shard = torch.zeros(full.numel() // world, dtype=dt, device="cuda")
    run = ((lambda: tg.reduce_scatter(shard, full, op=dist.ReduceOp.AVG)) if op == "reduce_scatter"
           else (lambda: tg.all_gather(full, shard)))
    for _ in range(5):
        run()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--for-world-size", type=int, default=8, help="the world whose collectives are timed (default 8)")
    ap.add_argument("--iters", type=int, default=20, help="timed launches per collective (median reported)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    if "RANK" not in os.environ or not torch.cuda.is_available():
        print("error: run under torchrun on CUDA GPUs, e.g. torchrun --standalone --nproc_per_node=2 "
              "bench/multi_gpu/nccl_bandwidth.py --out X.json", file=sys.stderr)
        return 2
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    world, target = dist.get_world_size(), a.for_world_size
    rows = []
    for op, what, dtype, nbytes, per_step in step_collectives(target):
        ms = time_collective(op, dtype, nbytes, a.iters)
        busbw = nbytes * (world - 1) / world / (ms / 1e3)  # bytes/s
        rows.append(dict(op=op, what=what, dtype=dtype, bytes=nbytes, launches_per_step=per_step,
                         ms_here=ms, bus_gb_per_s=busbw / 1e9,
                         ms_at_target=nbytes * (target - 1) / target / busbw * 1e3))
    dist.destroy_process_group()
    if rank == 0:
        result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, nccl=".".join(
                          map(str, torch.cuda.nccl.version())), world_size=world, for_world_size=target,
                      date=datetime.date.today().isoformat(), commit=git_commit(),
                      command=" ".join([Path(sys.executable).name, *sys.argv]),
                      per_step_ms_at_target=sum(r["ms_at_target"] * r["launches_per_step"] for r in rows),
                      collectives=rows)
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
        for r in rows:
            print(f"{r['op']:<15} {r['what']:<44} {r['bytes'] / 2**20:8.1f} MiB  {r['ms_here']:7.3f} ms here  "
                  f"{r['bus_gb_per_s']:6.1f} GB/s bus  {r['ms_at_target']:7.3f} ms at W={target}")
        print(f"per step at W={target}: {result['per_step_ms_at_target']:.2f} ms of collectives (Adam's every other step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
