"""Throughput benchmark: one device call, one table, one JSON.

    python bench/bench.py --out bench/results/<date>_<device>_bench.json [--steps 24] [--cached-start]
    torchrun --standalone --nproc_per_node=2 bench/bench.py --stages-only --as-world-size 8 --out ...

Synthetic document-structured tokens (the loss is meaningless; the shapes, the data loader and every kernel are the
real run's), on one GPU or under torchrun (rank 0 writes). --as-world-size K runs every rank with the micro-batches
of a K-GPU run (8: one micro-batch per rank and step, of a 1/8 of the batch), so two GPUs time what a rank of the
8-GPU speedrun does, its collectives excepted (they are the W ranks' here). On one process, --as-world-size K
[--as-rank R] runs exactly what rank R of a K-GPU run computes: its micro-batch and its optimizer shard (NorMuon's
matrices and gates, DistAdam's rows), the collectives through torch's fake process group (no data crosses GPUs).
Ranks differ in the gates they update (rank 0: the smear gate and two attention gates; ranks 5-7: none) and in
their documents: time several R and take the slowest, as predict_8gpu.py does. Measures, in this order:
  * cold start: process start -> end of the kernel warm-up (every train and eval graph compiled), i.e. the moment
    the real script starts its timed loop; with --cached-start a second process measures it again with the
    Inductor/Triton caches this one left behind. `-- --compile-cache FILE` loads the trainer's portable bundle first
    (a fresh machine given another machine's bundle) or, when FILE is absent or does not match, writes it after
    the warm-up, outside the clock
  * per batch-size stage: median ms/step over --steps steps (CUDA-synchronised per step), and ms/step of --steps
    more run back to back as the trainer runs them (one synchronisation after the last), the host's enqueue time
    per step (well below the step time: bound by the GPU; close to it: the profile's GPU idle time tells whether
    the CPU is the limit), tokens/s, MFU, peak memory; with several processes, the GPU timeline of one profiled
    step (compute, communication, the communication no compute hides); with --profile-stages, one profiled step
    of the stages named written out (GPU idle time, top kernels, host time by op).
    The timed steps run under train_gpt.no_compiles_allowed(): any recompilation there aborts the benchmark
  * NorMuon step alone, DistAdam step alone (same model, real gradients); NorMuon's update per group as GPU time,
    beside its orthogonalizer's FLOP time at the measured peak
  * the orthogonalizer alone on the real NorMuon stacks (their momentum buffers): Polar Express vs Turbo-Muon,
    time and relative error against the float64 SVD polar factor
  * one profiled stage-3 step: the top kernels and their share of the step (written beside the JSON)
MFU counts 6 x (matmul parameters) FLOPs per token (attention's T^2 term excluded, like the reference figures)
against the bf16 dense matmul peak measured here on a 8192^3 GEMM.
"""
import argparse
import dataclasses
import datetime
import gc
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import train_gpt as tg  # noqa: E402  (PROCESS_START, this process's start: the benchmark's cold-start clock)

REFERENCE_H100_MS = {1: 274.0, 2: 485.0, 3: 721.0}  # the December 2025 record script on an H100 (ms/step)
REFERENCE_PEAK_TFLOPS = 798.0  # bf16 8192^3 on random data: the H100's figure


# ---- synthetic data ----------------------------------------------------------------------------------------

def document_lengths(num_tokens: int, rng: np.random.Generator, median: int = 600, max_len: int = 8192) -> list:
    """Log-normal document lengths (web text has a long tail), clipped to [16, max_len], summing to num_tokens."""
    lengths, total = [], 0
    while total < num_tokens:
        n = int(np.clip(rng.lognormal(np.log(median), 1.0), 16, max_len))
        n = min(n, num_tokens - total)
        lengths.append(n)
        total += n
    return lengths


def synthetic_tokens(num_tokens: int, seed: int) -> np.ndarray:
    """Random GPT-2 token ids in documents that each start with BOS."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, tg.BOS_ID, size=num_tokens, dtype=np.uint16)
    starts = np.cumsum([0] + document_lengths(num_tokens, rng)[:-1])
    tokens[starts] = tg.BOS_ID
    return tokens


def write_shard(path: Path, tokens: np.ndarray) -> Path:
    """Written aside and renamed: the ranks of a torchrun make the same shards at the same time."""
    header = np.zeros(tg.HEADER_INTS, dtype="<i4")
    header[0], header[1], header[2] = tg.SHARD_MAGIC, tg.SHARD_VERSION, len(tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())
    os.replace(tmp, path)
    return path


def make_synthetic_shards(folder: Path, train_tokens: int, val_tokens: int) -> Path:
    """Train and val shards in the speedrun format (reused when already there with the right sizes)."""
    specs = [(folder / "fineweb_train_000001.bin", train_tokens // 2, 1),
             (folder / "fineweb_train_000002.bin", train_tokens - train_tokens // 2, 2),
             (folder / "fineweb_val_000000.bin", val_tokens, 3)]
    for path, n, seed in specs:
        if not (path.exists() and path.stat().st_size == tg.HEADER_INTS * 4 + 2 * n):
            write_shard(path, synthetic_tokens(n, seed))
    return folder


# ---- measurement helpers -----------------------------------------------------------------------------------

def matmul_params(model: tg.GPT) -> int:
    """Parameters that take part in a matmul per token: block matrices and lm_head (embeddings are lookups)."""
    blocks = sum(p.numel() for n, p in model.blocks.named_parameters() if p.ndim >= 2)
    return blocks + model.lm_head.weight.numel()


def mfu(tokens_per_s: float, n_params: int, peak_flops: float) -> float:
    return 6.0 * n_params * tokens_per_s / peak_flops


def bf16_peak_flops(n: int = 8192) -> float:
    import triton.testing
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    return 2 * n ** 3 / (ms * 1e-3)


def timed(fn, repeats: int) -> list:
    """Wall time of each call in ms, synchronised around every call."""
    return [wall for wall, _ in timed_with_host(fn, repeats)]


def timed_with_host(fn, repeats: int) -> list:
    """(wall ms, host ms) of each call, synchronised around every call. The host time is how long the CPU took to
    enqueue the call's work (until fn returned). Well below the wall time, the GPU is the bottleneck; close to it,
    either the CPU is, or it ran far enough ahead to block on CUDA's launch queue: the profile's GPU idle time
    tells which."""
    out = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        host = time.perf_counter() - t
        torch.cuda.synchronize()
        out.append((1000 * (time.perf_counter() - t), 1000 * host))
    return out


def back_to_back_ms(fn, steps: int) -> float:
    """ms per call of `steps` calls run as the trainer runs its steps, one synchronisation after the last: the host's
    work before a step's first kernel (the next batch, the launches) overlaps the previous step's kernels, which a
    synchronisation around every call (timed_with_host) exposes."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return 1000 * (time.perf_counter() - t) / steps


def polar_factor(G: Tensor) -> Tensor:
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


def relative_error(a: Tensor, b: Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def format_table(result: dict) -> str:
    lines = [f"world size {result.get('world_size', 1)}, each rank as a rank of {result.get('as_world_size', 1)} GPUs"
             + (f"; collectives: {result['collectives']}" if result.get("collectives") else ""),
             f"{'stage':<10} {'tokens/step':>11} {'windows':>8} {'ms/step':>8} {'host ms':>7} {'comm exp':>8} "
             f"{'ref ms':>7} {'x ref':>6} {'tokens/s':>10} {'MFU':>6} {'MFU@798':>7} {'peak in use':>11}"]
    for s in result["stages"]:
        ref = s.get("reference_ms")
        ratio = f"{s['median_ms'] / ref:.3f}" if ref else ""
        exposed = f"{s['timeline']['communication_exposed_ms']:.2f}" if s.get("timeline") else ""
        lines.append(f"{s['name']:<10} {s['tokens_per_step']:>11,} {s['windows']:>8} {s['median_ms']:>8.1f} "
                     f"{s.get('host_ms', 0):>7.1f} {exposed:>8} {ref if ref else '':>7} {ratio:>6} "
                     f"{s['tokens_per_s']:>10,.0f} {100 * s['mfu']:>5.1f}% {100 * s.get('mfu_vs_798', 0):>6.1f}% "
                     f"{s.get('peak_in_use_gib', s['peak_allocated_gib']):>8.2f} GiB")  # + the graphs' pool
    c = result["cold_start"]
    lines.append(f"cold start (process start -> timed loop): {c['this_process_s']:.1f}s "
                 f"(warm-up {c['warm_up_s']:.1f}s; Inductor cache {'present' if c['cache_present_at_start'] else 'empty'} "
                 f"at start, {c['cache_mb_after']:.0f} MB after)"
                 + (f"; with that cache: {c['cached_s']:.1f}s" if c.get("cached_s") is not None else ""))
    if c.get("before_warm_up_parts_s"):
        lines.append("before the warm-up: " + ", ".join(f"{k} {v:.1f}s" for k, v in c["before_warm_up_parts_s"].items()))
    if "host_syncs_in_a_stage3_step" in result:
        h = result["host_syncs_in_a_stage3_step"]
        lines.append(f"fused kernels {result.get('fused', '?')}; synchronising CUDA calls in a stage-3 step: "
                     f"{h['count']}" + (f" (first: {h['first'][0]})" if h["first"] else ""))
    if "optimizers" in result:
        o = result["optimizers"]
        lines.append(f"NorMuon step alone {o['normuon_ms']:.2f} ms; DistAdam step alone {o['distadam_ms']:.2f} ms")
    for name, row in result.get("orthogonalizer", {}).items():
        lines.append(f"orthogonalizer {name}: polar {row['polar']['ms']:.3f} ms (err {row['polar']['polar_rel_err']:.3f}), "
                     f"turbo {row['turbo']['ms']:.3f} ms (err {row['turbo']['polar_rel_err']:.3f})")
    lines.append(f"MFU basis: 6 x {result['matmul_params'] / 1e6:.1f}M matmul params per token, "
                 f"measured bf16 peak {result['bf16_peak_tflops']:.0f} TFLOP/s")
    return "\n".join(lines)


# ---- profile summaries: a profiled step's GPU timeline, its kernels, its host waits ------------------------

def _union_length(intervals) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _intersection_length(a_intervals, b_intervals) -> float:
    return _union_length(a_intervals) + _union_length(b_intervals) - _union_length(a_intervals + b_intervals)


HOST_WAIT_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
                   "cudaMemcpyAsync")


def host_wait_summary(prof) -> str:
    """Calls and CPU time of the runtime calls that can stall the CPU. Memcpys are listed because a copy from
    pageable memory (or a blocking one) waits for the stream; any synchronize in a training step is a bug."""
    found = {}
    for e in prof.events():
        if e.name in HOST_WAIT_CALLS:
            n, ms = found.get(e.name, (0, 0.0))
            found[e.name] = (n + 1, ms + (e.time_range.end - e.time_range.start) / 1e3)
    return ", ".join(f"{name} {n}x {ms:.2f} ms" for name, (n, ms) in sorted(found.items())) or "none"


def profile_kernels(prof) -> list:
    """(name, start ms, end ms) of every GPU kernel a profile recorded. A range a `record_function` marks on the GPU
    (Optimizer.step#NorMuon.step: from its first kernel to its last) is not a kernel: summed, it counted them twice."""
    return [(e.name, e.time_range.start / 1e3, e.time_range.end / 1e3) for e in prof.events()
            if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
            and not getattr(e, "is_user_annotation", False)]


def profile_timeline(kernels: list) -> dict:
    """ms of the GPU timeline: its span, compute and communication (NCCL) busy time, the communication that
    overlaps compute, the exposed rest (communication alone on the GPU) and the idle time."""
    t0 = min(k[1] for k in kernels)
    comm = [(a, b) for n, a, b in kernels if "nccl" in n.lower()]
    compute = [(a, b) for n, a, b in kernels if "nccl" not in n.lower()]
    span = max(k[2] for k in kernels) - t0
    comm_busy, overlapped = _union_length(comm), _intersection_length(comm, compute)
    return dict(span_ms=span, compute_busy_ms=_union_length(compute), communication_busy_ms=comm_busy,
                communication_overlapped_ms=overlapped, communication_exposed_ms=comm_busy - overlapped,
                idle_ms=span - _union_length(compute + comm))


def summarize_profile(prof, title: str) -> str:
    """Communication vs compute on the GPU timeline of one step: busy time of each, their overlap, and the
    start/duration of every NCCL kernel relative to the first kernel of the step."""
    kernels = profile_kernels(prof)
    if not kernels:
        return f"profile ({title}): no GPU kernels recorded\n"
    t0 = min(k[1] for k in kernels)
    compute = [(a, b) for n, a, b in kernels if "nccl" not in n.lower()]
    t = profile_timeline(kernels)
    out = [f"profile ({title}); times in ms from the step's first GPU kernel",
           f"GPU span {t['span_ms']:.2f}  compute busy {t['compute_busy_ms']:.2f}  communication busy "
           f"{t['communication_busy_ms']:.2f}  communication overlapped with compute "
           f"{t['communication_overlapped_ms']:.2f}  idle {t['idle_ms']:.2f}",
           "host waits (CUDA runtime calls that block the CPU): " + host_wait_summary(prof),
           "", "NCCL kernels: start  duration  overlapped-with-compute  name"]
    for n, a, b in sorted((k for k in kernels if "nccl" in k[0].lower()), key=lambda k: k[1]):
        out.append(f"  {a - t0:9.2f} {b - a:8.3f} {_intersection_length([(a, b)], compute):8.3f}  {n[:90]}")
    totals = {}
    for n, a, b in kernels:
        c, t = totals.get(n, (0, 0.0))
        totals[n] = (c + 1, t + b - a)
    kinds = {}
    for n, (c, t) in totals.items():
        k = kernel_kind(n)
        kc, kt = kinds.get(k, (0, 0.0))
        kinds[k] = (kc + c, kt + t)
    out += ["", "GPU time by kind of kernel: total_ms  calls  kind"]
    for k, (c, t) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
        out.append(f"  {t:9.2f} {c:6d}  {k}")
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])
    out += ["", "top kernels by GPU time: total_ms  calls  name"]
    for n, (c, t) in ranked[:TOP_KERNELS]:
        out.append(f"  {t:9.2f} {c:6d}  {short_kernel_name(n)[:120]}")
    if len(ranked) > TOP_KERNELS:
        rest = ranked[TOP_KERNELS:]
        out.append(f"  {sum(t for _, (_, t) in rest):9.2f} {sum(c for _, (c, _) in rest):6d}  "
                   f"({len(rest)} other kernels)")
    return "\n".join(out) + "\n"


TOP_KERNELS = 60

# Which library or compiler a kernel came from, by its name (first match wins).
KERNEL_KINDS = (("nccl", "NCCL collectives"), ("flash", "FlashAttention"), ("quack", "quack GEMMs"),
                ("nvjet|gemm|xmma|cutlass", "cuBLAS/CUTLASS GEMMs"), ("^triton_", "Inductor's Triton kernels"),
                ("^_", "our Triton kernels"), ("memcpy|memset", "copies and fills"),
                ("at::native|^void at::", "ATen kernels"))


def short_kernel_name(name: str) -> str:
    """A kernel's name without the namespaces that hide which operation an ATen kernel runs."""
    for noise in ("void ", "at::native::", "(anonymous namespace)::", "at_cuda_detail::", "c10::"):
        name = name.replace(noise, "")
    return name


def kernel_kind(name: str) -> str:
    for pattern, kind in KERNEL_KINDS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return kind
    return "other"


# ---- the benchmark -----------------------------------------------------------------------------------------

def inductor_cache_dir() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return Path(cache_dir())


def folder_mb(path: Path) -> float:
    if not path.exists():
        return 0.0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2 ** 20


def measure_stages(trainer, args, steps: int, n_params: int, peak: float, profile_stages=(),
                   profile_stem: Path = None, reference: dict = None, master: bool = True) -> list:
    """Median step time per stage; with several processes also the GPU timeline of one profiled step; for the stage
    numbers in profile_stages, one profiled step written to <profile_stem>_stage<N>.txt (GPU busy/idle, top kernels,
    host time by op). reference: ms per step of the record script per stage number, where comparable. master: this
    process prints and writes (the first of several processes; one process, whichever rank it emulates)."""
    rt = trainer.runtime
    rows, step = [], 0
    for stage_no, stage in enumerate(tg.stages(args), start=1):  # the extension is number 4: no reference
        name, bs = stage.name, stage.batch_size
        trainer.model.yarn.set_window(stage.ws_long)
        batches = trainer.new_batches(bs)
        torch.cuda.reset_peak_memory_stats()

        def one_step():
            nonlocal step
            trainer.train_step(step, batches, None, stage.ws_short, stage.ws_long, rt.grad_accum_steps)
            step += 1
        gc.collect()  # as the trainer does before its timed loop: no gen-2 collection inside the timed steps
        timeline = None
        with tg.no_compiles_allowed():
            walls_hosts = timed_with_host(one_step, steps + 2)[2:]  # the first two refill the loader's queue
            back_to_back = back_to_back_ms(one_step, steps)
            if rt.world_size > 1:  # every rank profiles the same steps: their collectives pair up
                timeline = timeline_per_step(one_step)
            if stage_no in profile_stages:
                text = profiled(one_step, f"bench: a stage-{stage_no} step ({name}), world size {rt.world_size}")
                if master:
                    Path(f"{profile_stem}_stage{stage_no}.txt").write_text(text)
        times = [w for w, _ in walls_hosts]
        allocated_gib = torch.cuda.max_memory_allocated() / 2 ** 30
        pool_gib = tg.CudaGraph.pool_bytes() / 2 ** 30 if trainer.graphs is not None else 0.0
        ms = statistics.median(times)
        host_ms = statistics.median(h for _, h in walls_hosts)
        per_gpu = bs / rt.world_size / (ms / 1000)  # tokens/s of one GPU
        rows.append(dict(name=name, tokens_per_step=bs, windows=f"{stage.ws_short},{stage.ws_long}", steps=len(times),
                         micro_batches_per_rank=rt.grad_accum_steps,
                         tokens_per_micro_batch=tg.tokens_per_micro_batch(bs, rt.grad_accum_steps, rt.world_size),
                         median_ms=ms, mean_ms=statistics.fmean(times), min_ms=min(times), max_ms=max(times),
                         host_ms=host_ms, host_share=host_ms / ms, back_to_back_ms=back_to_back,
                         tokens_per_s=bs / (ms / 1000), mfu=mfu(per_gpu, n_params, peak),
                         mfu_vs_798=mfu(per_gpu, n_params, REFERENCE_PEAK_TFLOPS * 1e12),
                         peak_allocated_gib=allocated_gib,
                         peak_reserved_gib=torch.cuda.max_memory_reserved() / 2 ** 30,
                         # the graphs' pool: their temporaries, in use during replays but not in the allocated count
                         graph_pool_gib=pool_gib,
                         peak_in_use_gib=allocated_gib + pool_gib,
                         timeline=timeline,
                         reference_ms=(reference or {}).get(stage_no)))
        if master:
            exposed = f"; communication exposed {timeline['communication_exposed_ms']:.2f} ms" if timeline else ""
            print(f"{name}: {ms:.1f} ms/step (median of {len(times)}; host enqueue {host_ms:.1f} ms{exposed}; "
                  f"back to back {back_to_back:.1f} ms/step)", flush=True)
    return rows


def timeline_per_step(one_step) -> dict:
    """The GPU timeline (profile_timeline) of two steps profiled together, per step: one step with Adam's
    collectives and one without (it steps every other step)."""
    kernels = profile_kernels(profile_of(lambda: (one_step(), one_step())))
    return {k: v / 2 for k, v in profile_timeline(kernels).items()}


def check_cuda_graphs(trainer, args) -> dict:
    """Per stage, one step (all its micro-batches, no optimizer step) from the same weights and batches, twice eagerly
    and twice replayed as CUDA graphs: each micro-batch's loss, and the step's gradients. The forward is
    deterministic, so the losses must agree bit for bit; FlashAttention-4's backward sums dQ with atomic adds (in
    an order that depends on timing), so the gradients of two runs differ even without graphs: graphs against eager
    should differ no more than eager against eager, or graphs against graphs."""
    if trainer.graphs is None:
        return dict(skipped="--cuda-graphs is off")
    model, graphs = trainer.model, trainer.graphs

    def differences(a, b) -> dict:
        diff = torch.cat([(x - y).flatten() for x, y in zip(a, b)])
        return dict(identical=all(torch.equal(x, y) for x, y in zip(a, b)), max_abs=diff.abs().max().item(),
                    rel_norm=(diff.norm() / torch.cat([y.flatten() for y in b]).norm()).item())

    rows = []
    model.yarn.reset()
    try:
        with tg.no_compiles_allowed():
            for stage in tg.stages(args):
                model.yarn.set_window(stage.ws_long)
                grads, losses = {}, {}
                for name in ("eager", "graphs", "eager_again", "graphs_again"):
                    trainer.graphs = graphs if name.startswith("graphs") else None
                    model.zero_grad(set_to_none=True)
                    if graphs.writes_first:  # as in training, the odd step finds Adam's gradients of the even one
                        for group in trainer.adam.param_groups:
                            for p in group["params"]:
                                p.grad = torch.zeros_like(p)
                    # an odd step: with several processes its last micro-batch launches Adam's reduce-scatters
                    batches, n = trainer.new_batches(stage.batch_size), trainer.runtime.grad_accum_steps
                    losses[name] = []
                    for micro in range(n):
                        trainer.adam.should_sync = micro == n - 1
                        losses[name].append(trainer.micro_batch(batches.get(), stage.ws_short, stage.ws_long,
                                                                n).clone())
                    trainer.adam.should_sync = False
                    averaged = [trainer.adam._grad_slices[p] for p in trainer.adam.join_reduce_scatters()]
                    trainer.adam._pending.clear()  # no optimizer step follows
                    grads[name] = [g.detach().float().clone() for g in [p.grad for p in model.parameters()] + averaged]
                    losses[name] = [x.float().clone() for x in losses[name]]
                rows.append(dict(stage=stage.name,
                                 losses_graphs_vs_eager=differences(losses["graphs"], losses["eager"]),
                                 losses_eager_vs_eager=differences(losses["eager_again"], losses["eager"]),
                                 grads_graphs_vs_eager=differences(grads["graphs"], grads["eager"]),
                                 grads_eager_vs_eager=differences(grads["eager_again"], grads["eager"]),
                                 grads_graphs_vs_graphs=differences(grads["graphs_again"], grads["graphs"])))
    finally:
        trainer.graphs = graphs
        model.zero_grad(set_to_none=True)
        model.yarn.reset()
    return dict(what="one step per stage from the same weights and batches: each micro-batch's loss and the "
                     "step's gradients (with several processes also DistAdam's reduce-scattered averages)",
                world_size=trainer.runtime.world_size, captures=graphs.captures, stages=rows)


def measure_optimizers(trainer, args, repeats: int = 20) -> dict:
    """Each optimizer's step alone, on real gradients of one stage-3 micro-batch."""
    stage = tg.stages(args)[-2]  # the last scheduled stage: the largest batch and window
    batches = trainer.new_batches(stage.batch_size)
    inputs, targets, cu = batches.get()
    trainer.model(inputs, targets, cu, stage.ws_short, stage.ws_long, args.train_max_seq_len).backward()
    trainer.adam.should_sync = False
    with tg.no_compiles_allowed():
        muon_ms = statistics.median(timed(trainer.muon.step, repeats))
        adam_ms = statistics.median(timed(trainer.adam.step, repeats))
    trainer.model.zero_grad(set_to_none=True)
    return dict(normuon_ms=muon_ms, distadam_ms=adam_ms, repeats=repeats)


def polar_flops(matrices: int, rows: int, cols: int, iterations: int) -> float:
    """FLOPs of the orthogonalizer on `matrices` (rows, cols) matrices, each in its wide orientation (m <= k): per
    iteration the Gram A = X Xᵀ (2 m² k), B = b·A + c·A·A (2 m³) and X <- a·X + B·X (2 m² k), every product counted
    whole (the symmetric kernels compute all tiles). Elementwise passes are left out."""
    m, k = min(rows, cols), max(rows, cols)
    return matrices * iterations * (4.0 * m * m * k + 2.0 * m ** 3)


@torch.no_grad()  # as NorMuon.step
def measure_normuon_groups(muon, peak_flops: float, repeats: int = 10) -> dict:
    """This rank's NorMuon update, group by group, as GPU time: the kernels of `repeats` calls of the group's
    shard update (momentum, orthogonalizer, second moment, cautious update; no collectives) summed from a profile,
    per call; beside it the orthogonalizer's FLOPs and their time at the bf16 peak measured in this run."""
    iterations = len(tg.TURBO_MUON_COEFFS if muon.turbo else tg.POLAR_EXPRESS_COEFFS)
    out, total = {}, 0.0
    for group, layout in zip(muon.param_groups, muon._layout):
        n = layout["hi"] - layout["lo"]
        if n == 0:
            continue
        grads = layout["shard"][:n]
        rows, cols = grads.shape[-2:]
        matrices, rows = (4 * n, rows // 4) if layout["is_attn"] else (n, rows)
        snapshot = [p.detach().clone() for p in group["params"][layout["lo"]:layout["hi"]]]
        ms = gpu_ms(lambda: muon._update_shard(group, layout, grads), repeats)
        for p, saved in zip(group["params"][layout["lo"]:layout["hi"]], snapshot):  # the weights as they were
            p.copy_(saved)
        flops = polar_flops(matrices, rows, cols, iterations)
        out[group["label"]] = dict(matrices=matrices, shape=[rows, cols], gpu_ms=ms, orthogonalizer_flops=flops,
                                   flop_time_ms=1e3 * flops / peak_flops, ratio=ms / (1e3 * flops / peak_flops))
        total += ms
    return dict(groups=out, gpu_ms=total, repeats=repeats, iterations=iterations,
                flops_counted="the orthogonalizer's three products per iteration, whole; elementwise passes not")


def measure_orthogonalizer(muon, svd_matrices: int = 4) -> dict:
    import triton.testing
    results = {}
    fns = {mode: torch.compile(lambda x, t=turbo: tg.polar_express(x, turbo=t), dynamic=False, fullgraph=True)
           for mode, turbo in (("polar", False), ("turbo", True))}
    for group, layout in zip(muon.param_groups, muon._layout):
        buf = group.get("momentum_buffer")
        if buf is None:
            continue
        n, rows, cols = buf.shape
        G = buf.view(4 * n, rows // 4, cols) if layout["is_attn"] else buf
        ref = polar_factor(G[:svd_matrices])
        row = {}
        for mode, fn in fns.items():
            out = fn(G)
            ms = triton.testing.do_bench(lambda: fn(G), warmup=10, rep=100, return_mode="median")
            row[mode] = dict(ms=ms, polar_rel_err=relative_error(out[:svd_matrices], ref))
        results[f"{group['label']} {'x'.join(map(str, G.shape))}"] = row
    return results


def stage3_step(trainer, args):
    """A function running one stage-3 training step (odd: NorMuon + DistAdam), after one step that fills the loader
    and a synchronisation, so that what is measured around it is that step alone."""
    stage = tg.stages(args)[-2]  # the last scheduled stage
    batches = trainer.new_batches(stage.batch_size)
    windows = (stage.ws_short, stage.ws_long)
    trainer.train_step(0, batches, None, *windows, trainer.runtime.grad_accum_steps)
    torch.cuda.synchronize()
    return lambda: trainer.train_step(1, batches, None, *windows, trainer.runtime.grad_accum_steps)


def count_host_syncs(trainer, args) -> dict:
    """Synchronising CUDA calls PyTorch reports (torch.cuda.set_sync_debug_mode) during one stage-3 step: a step
    should have none, because the CPU must stay ahead of the GPU to keep it busy."""
    import warnings
    step = stage3_step(trainer, args)
    with warnings.catch_warnings(record=True) as caught, tg.no_compiles_allowed():
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    # (set_sync_debug_mode itself warns once that it is a prototype: that notice is not a synchronisation)
    syncs = [str(w.message).splitlines()[0][:160] for w in caught
             if "synchroniz" in str(w.message).lower() and "prototype" not in str(w.message)]
    return dict(count=len(syncs), first=syncs[:3])


def host_time_by_op(prof, rows: int = 20) -> str:
    """The ops that took the CPU longest (self time: what the op's own code cost, its children excluded); custom
    ops that call Python kernels libraries (FA4, quack) show their whole dispatch here."""
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
    return "host time by op (CPU self time, profiler overhead included):\n" + table


def gpu_time_by_op_and_shape(prof, rows: int = 25) -> str:
    """The ops whose own kernels took the GPU longest, one row per (op, input shapes): ties an eager kernel of the
    kernel list (an ATen addition or copy) to the operation and tensors that launched it."""
    table = prof.key_averages(group_by_input_shape=True).table(sort_by="self_cuda_time_total", row_limit=rows,
                                                               max_name_column_width=40, max_shapes_column_width=70)
    return "GPU time by op and input shapes (self CUDA time):\n" + table


def profile_of(step, record_shapes: bool = False):
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=record_shapes) as prof:
        step()
        torch.cuda.synchronize()
    return prof


def gpu_ms(fn, repeats: int) -> float:
    """GPU time of fn per call: fn once outside the profile (its buffers made, its kernels compiled), then the kernels
    of `repeats` calls summed from a profile."""
    fn()
    prof = profile_of(lambda: [fn() for _ in range(repeats)])
    return sum(b - a for _, a, b in profile_kernels(prof)) / repeats


def profiled(step, title: str) -> str:
    prof = profile_of(step, record_shapes=True)
    return (summarize_profile(prof, title) + "\n" + host_time_by_op(prof) + "\n"
            + gpu_time_by_op_and_shape(prof))


def measure_profile(trainer, args, out_path: Path, master: bool = True) -> str:
    text = profiled(stage3_step(trainer, args), f"bench: stage-3 step (odd: NorMuon + DistAdam), world size "
                                                f"{trainer.runtime.world_size}")
    if master:
        out_path.write_text(text)
    return text


def as_world_size(args: tg.Hyperparameters, world: int, as_world: int) -> tg.Hyperparameters:
    """Batch sizes for W processes that each run a rank of an as_world-GPU run: every batch shrinks by
    W / as_world, so that a micro-batch keeps the as_world run's token count (batch / 8)."""
    def scale(tokens: int) -> int:
        return tokens * world // as_world
    return dataclasses.replace(args, train_bs_schedule=tuple(map(scale, args.train_bs_schedule)),
                               train_bs_extension=scale(args.train_bs_extension),
                               val_batch_size=scale(args.val_batch_size), val_tokens=scale(args.val_tokens))


def emulate_rank(rank: int, world_size: int) -> str:
    """Make this one process rank `rank` of a `world_size`-process run: a process group of torch's fake backend,
    whose collectives move nothing between GPUs (a reduce-scatter or all-gather copies this rank's own part, or does
    nothing, by torch version), so that the trainer built next runs exactly that rank's micro-batch and optimizer
    shard: its NorMuon matrices and gates and its DistAdam rows. Returns the line that says so."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    return (f"one process as rank {rank} of {world_size}: its micro-batch and its optimizer shard; collectives: "
            f"torch's fake process group (no data crosses GPUs: each is a local copy or nothing)")


def rank_work(muon, adam) -> dict:
    """What this rank's optimizers update, read off the optimizers themselves: per NorMuon group the matrices of its
    shard that hold parameters (the zero padding of a group is not updated) and their shape, per DistAdam parameter
    its rows (padding included: every rank updates as many)."""
    rows = []
    for group in adam.param_groups:
        for p in group["params"]:
            lo, hi = adam._slice_rows(p)
            rows.append((p.label, hi - lo, *p.shape[1:]))
    matrices = [(group["label"], layout["hi"] - layout["lo"], *layout["params"].shape[1:])
                for group, layout in zip(muon.param_groups, muon._layout)]
    return dict(normuon=matrices, distadam=rows)


def bench_args(data_dir: Path, seed: int, train_flags=()) -> tg.Hyperparameters:
    """The trainer's settings from its own command line (the record's defaults plus `train_flags`); only the data
    (synthetic, cycled) and the validation set (one batch) are the benchmark's."""
    args = tg.parse_args(list(train_flags))
    return dataclasses.replace(args, data_path=str(data_dir), seed=seed, train_epochs=100,
                               val_tokens=args.val_batch_size)


def compile_report() -> dict:
    """Graphs compiled so far and where torch.compile spent its time (dynamo, AOT autograd, inductor phases)."""
    from torch._dynamo.utils import compile_times
    try:
        table = compile_times(repr="str", aggregate=True)
    except Exception as e:  # the helper's signature moves between torch versions; this is diagnostics only
        table = f"unavailable: {type(e).__name__}: {e}"
    counts = tg.compile_cache_counts()
    return dict(graphs=tg.compiled_graph_count(), compile_times=table, inductor_cache=counts["inductor"],
                aot_autograd_cache=counts["aot_autograd"])


def runtime_record(runtime) -> dict:
    """The trainer's resolved runtime, JSON-ready (the kernels as the names of the fused ones in use)."""
    record = {f.name: getattr(runtime, f.name) for f in dataclasses.fields(runtime) if f.name != "kernels"}
    return dict(record, kernel_notes=list(runtime.kernel_notes), fused=runtime.fused)


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    except OSError:
        return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/bench.json")
    ap.add_argument("--steps", type=int, default=24, help="timed steps per stage (median reported)")
    ap.add_argument("--data-dir", default=os.path.join(tempfile.gettempdir(), "speedrun_bench_data"))
    ap.add_argument("--cached-start", action="store_true",
                    help="afterwards, measure the cold start again in a new process with this run's caches")
    ap.add_argument("--cold-start-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--commit", default="", help="recorded in the JSON instead of .git's HEAD (a copied working tree "
                                                 "may carry a stale .git)")
    ap.add_argument("--stages-only", action="store_true",
                    help="cold start and per-stage timings only (no optimizer, orthogonalizer, profile; "
                         "--cached-start still applies)")
    ap.add_argument("--profile-stages", default="",
                    help="comma-separated stage numbers (1-4): profile one step of each after its timing, written "
                         "to <out>_profile_stage<N>.txt (works with --stages-only)")
    ap.add_argument("--check-graphs", action="store_true",
                    help="after the timings, compare one step's gradients per stage with and without the CUDA "
                         "graphs, next to two eager runs' difference (also with --stages-only)")
    ap.add_argument("--as-world-size", type=int, default=0, metavar="K",
                    help="run each rank as a rank of a K-GPU run does: 8 // K micro-batches per step of 1/8 of the "
                         "stage's batch each (the global batch shrinks by W/K; timing only). Default: this run's W")
    ap.add_argument("--as-rank", type=int, default=0, metavar="R",
                    help="with --as-world-size K on one process: run exactly what rank R of a K-GPU run computes, its "
                         "micro-batch and its optimizer shard (collectives: torch's fake process group). Default 0")
    ap.add_argument("train_flags", nargs="*", metavar="-- TRAIN_FLAGS",
                    help="train_gpt.py flags for an A/B, after `--` (e.g. -- --kernels plain)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench.py needs a CUDA GPU (it times the real kernels)", file=sys.stderr)
        return 2
    cache = inductor_cache_dir()
    cache_present = folder_mb(cache) > 1.0
    world = int(os.environ.get("WORLD_SIZE", 1))
    master = int(os.environ.get("RANK", 0)) == 0
    as_world = a.as_world_size or world
    try:
        if as_world not in (1, 2, 4, 8) or as_world % world:
            raise tg.ConfigError(f"--as-world-size {as_world} with {world} process(es): give 1, 2, 4 or 8, a "
                                 f"multiple of the processes")
        if a.cached_start and world > 1:
            raise tg.ConfigError("--cached-start measures one process: run it without torchrun")
        emulated = world == 1 and as_world > 1  # one process as one rank of as_world: the batch is the real one
        if not 0 <= a.as_rank < as_world or (a.as_rank and not emulated):
            raise tg.ConfigError(f"--as-rank {a.as_rank}: give a rank below --as-world-size {as_world}, on one process")
        args = bench_args(Path(a.data_dir), seed=1234, train_flags=a.train_flags)
        if not emulated:  # W processes share out a rank's micro-batches: the global batch shrinks by W / as_world
            args = as_world_size(args, world, as_world)
    except tg.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    parts = {"imports, CUDA check, flags": time.time() - tg.PROCESS_START}  # where the time before the warm-up goes
    t_data = time.time()
    make_synthetic_shards(Path(a.data_dir), train_tokens=60_000_000, val_tokens=args.val_batch_size + 1)
    data_s = time.time() - t_data  # the benchmark's own synthetic data: not part of the trainer's cold start
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t = time.time()
    cache_path, cache_loaded, cache_line = tg.open_compile_cache(args)  # -- --compile-cache FILE, as the trainer
    parts["compile cache"] = time.time() - t
    t = time.time()
    rt = tg.resolve_runtime(args)
    rt = dataclasses.replace(rt, grad_accum_steps=tg.grad_accum_steps_for(as_world))
    collectives = "the processes' own (NCCL)" if world > 1 else "none: one process"
    if emulated:
        collectives = emulate_rank(a.as_rank, as_world)
        rt = dataclasses.replace(rt, world_size=as_world, rank=a.as_rank, launched=True)
    parts["kernel libraries"] = time.time() - t  # resolving the backends imports FA4's and quack's CuTe DSL
    t = time.time()
    trainer = tg.build_trainer(args, rt, out.with_name(out.stem + "_trainer_log.txt"), replace_log=True)
    parts["process group, model and optimizers"] = time.time() - t
    t = time.time()
    trainer.warm_up_kernels()
    warm_up_s = time.time() - t
    warm_up_peak = dict(zip(("allocated_mib", "reserved_mib", "graphs_pool_mib"), tg.peak_memory("cuda")))
    this_process_s = time.time() - tg.PROCESS_START - data_s
    cache_note = tg.compile_cache_after_warm_up(cache_path, cache_loaded) if master else ""  # as the trainer
    if cache_note:
        cache_line = (cache_line + "; " if cache_line else "") + cache_note
    cold = dict(this_process_s=this_process_s, synthetic_data_s=data_s, warm_up_s=warm_up_s,
                cache_present_at_start=cache_present, cache_dir=str(cache), cache_mb_after=folder_mb(cache),
                triton_cache_dir=os.environ.get("TRITON_CACHE_DIR", ""),
                triton_cache_mb_after=folder_mb(Path(os.environ.get("TRITON_CACHE_DIR", "/nonexistent"))),
                before_warm_up_parts_s=parts, warm_up_parts_s=dict(trainer.warm_up_times),
                peak_memory_through_warm_up=warm_up_peak,
                compile_cache=cache_line, **compile_report())
    say = print if master else (lambda *_, **__: None)
    say(f"collectives: {collectives}", flush=True)
    say(f"cold start {cold['this_process_s']:.1f}s (warm-up {warm_up_s:.1f}s)", flush=True)
    if a.cold_start_only:
        out.write_text(json.dumps(cold))
        trainer.log.close()
        return 0
    write = out.write_text if master else (lambda _: None)

    n_params = matmul_params(trainer.model)
    peak = bf16_peak_flops()
    result = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=__import__("triton").__version__,
        cuda=torch.version.cuda, python=platform.python_version(), commit=a.commit or git_commit(),
        date=datetime.date.today().isoformat(), command=" ".join([Path(sys.executable).name, *sys.argv]),
        world_size=world, as_world_size=as_world, as_rank=a.as_rank if emulated else None, collectives=collectives,
        rank_work=rank_work(trainer.muon, trainer.adam),
        data="synthetic document-structured tokens (log-normal lengths, median 600)",
        train_flags=a.train_flags, runtime=runtime_record(trainer.runtime), kernels=args.kernels,
        fused=trainer.runtime.fused, matmul_params=n_params, bf16_peak_tflops=peak / 1e12, fp8=trainer.runtime.fp8)
    result["cold_start"] = cold
    result["timed_steps_recompiles"] = "none: every timed step ran under train_gpt.no_compiles_allowed()"
    profile_stages = tuple(int(n) for n in a.profile_stages.split(",") if n.strip())
    result["stages"] = measure_stages(trainer, args, a.steps, n_params, peak, profile_stages,
                                      out.with_name(out.stem + "_profile"),
                                      REFERENCE_H100_MS if world == as_world == 1 else None, master=master)
    result["stage_profiles"] = [f"{out.stem}_profile_stage{n}.txt" for n in profile_stages]
    if world > 1:  # the timed steps' optimizers kept every rank's copy of the weights the same
        result["replicas_identical_after_timing"] = tg.replicas_identical(trainer.model)
        say(f"replicas after the timed steps: {'bit-identical' if result['replicas_identical_after_timing'] else 'DIFFER'}",
            flush=True)
    if a.check_graphs:
        result["cuda_graphs_check"] = check_cuda_graphs(trainer, args)
        say(f"CUDA graphs check: {result['cuda_graphs_check']}", flush=True)
    result["host_syncs_in_a_stage3_step"] = count_host_syncs(trainer, args)
    write(json.dumps(result, indent=1))  # partial results survive a later failure
    if not a.stages_only:
        result["optimizers"] = measure_optimizers(trainer, args)
        result["normuon_groups"] = measure_normuon_groups(trainer.muon, peak)
        say("NorMuon per group (GPU ms; orthogonalizer FLOP time at the peak): " + ", ".join(
            f"{label} {g['gpu_ms']:.3f} ({g['flop_time_ms']:.3f})" for label, g in
            result["normuon_groups"]["groups"].items()) + f"; {result['normuon_groups']['gpu_ms']:.3f} ms in all",
            flush=True)
        result["orthogonalizer"] = measure_orthogonalizer(trainer.muon)
        write(json.dumps(result, indent=1))
        profile_path = out.with_name(out.stem + "_profile.txt")
        measure_profile(trainer, args, profile_path, master)
        result["profile"] = profile_path.name
    if a.cached_start:
        tmp = out.with_name(out.stem + "_cached_start.json")
        subprocess.run([sys.executable, __file__, "--cold-start-only", "--out", str(tmp), "--data-dir", a.data_dir,
                        "--", *a.train_flags], check=True)
        cold["cached_s"] = json.loads(tmp.read_text())["this_process_s"]
        cold["cached_warm_up_s"] = json.loads(tmp.read_text())["warm_up_s"]
        tmp.unlink()
    result["cold_start"] = cold
    write(json.dumps(result, indent=1))
    say(format_table(result))
    trainer.log.close()  # and the run id's lock
    return 0


if __name__ == "__main__":
    sys.exit(main())
