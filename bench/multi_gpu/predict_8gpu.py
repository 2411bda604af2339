"""A model of the 8-GPU speedrun built from measurements on fewer GPUs: predicted ms per step and stage, and the
time to the last step, beside the record's own 8xH100 log.

    python bench/multi_gpu/predict_8gpu.py --rank-bench RANK8.json --w1-bench W1.json --nccl NCCL.json \
        [--out PREDICTION.json]

    python bench/multi_gpu/predict_8gpu.py --rank-bench RANK0.json RANK7.json ... --exposure RANK8_W2.json \
        --nccl NCCL.json [--w1-bench W1.json] [--out PREDICTION.json]

Two methods, by what --rank-bench holds:
  ranks of 8 emulated on one GPU (bench.py --as-world-size 8 [--as-rank R] on one process): per stage, the slowest
      of the given ranks' own step (its micro-batch and its optimizer shard, its idle time included; a rank given
      several times: the median of its runs; the steps run back to back, as the trainer runs them, where every
      input has that figure, else each synchronised alone: that adds the host's time before a step's first kernel,
      which the trainer hides behind the previous step) + the W=8 collectives the step leaves exposed: their time at W=8
      (--nccl) x the exposed share that a rank of 8 run on several GPUs measured (--exposure, a torchrun bench with
      its GPU timeline). The one-GPU step / 8 is shown beside.
  ranks run under torchrun on K = 2 or 4 GPUs (the earlier method, below).
Inputs (result JSONs, so the model is rerun, not retyped):
  --rank-bench  bench/bench.py run as ranks of an 8-GPU run (torchrun --nproc_per_node=K bench/bench.py --stages-only
                --as-world-size 8, K = 2 or 4): per stage, a rank that runs the 8-GPU run's one micro-batch per step,
                its host enqueue time, and its GPU timeline (idle time; communication busy and the part no compute
                hides)
  --w1-bench    bench/bench.py on one GPU (--stages-only): the whole step, 8 micro-batches and the optimizers
  --nccl        bench/multi_gpu/nccl_bandwidth.py --for-world-size 8: the collectives of one step at W=8, each timed
                at W=8's sizes, as bus bandwidth, and so their time at W=8
Per stage:      predicted = one GPU's step / 8 + the rank's idle time + the communication W=8 leaves exposed.
  - One GPU's step / 8 is a W=8 rank's compute: its micro-batch is an eighth of the step's, and so is its share of
    the optimizers (DistAdam's rows, NorMuon's matrices: 4 of the 32 large ones at W=8, against 16 of 32 at K=2 and
    9 at K=4, which is why the rank's own step is longer by that excess). It leaves out whatever a rank does per
    step that does not shrink with W.
  - The exposed share at W=8 is the rank run's (what the schedule hides is a property of the step, not of the
    link), applied to the W=8 collectives' time.
Beside it:      the rank's own measured steps summed over the run, a second estimate: it carries 8/K times an 8-GPU
                rank's optimizer share and K ranks' collectives, but no assumption about what shrinks with W (on
                4 H200s a rank's compute came out below one GPU's step / 8 at stage 3, its share included).
Leaves out: the link (W=8's NVSwitch taken to give the bus bandwidth the K NVLinked GPUs give; this workplace measured
            329 / 355 / 361 GB/s for a 1 GiB all-reduce on 2 / 4 / 8 H100s); stragglers among 8 ranks (on 2 and 4
            H200s the collectives inside a step took 1.0-2.1x the microbenchmark's time, ranks waiting for a late
            peer; the rank method's slowest rank covers the compute side only); validation
            (outside the train time); the GPUs' own speed (the prediction is of the machine the inputs ran on).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "records"))
import compare  # noqa: E402  (the log parser records/ uses)
import train_gpt as tg  # noqa: E402

RECORD_LOGS = ROOT / "tests" / "fixtures" / "records"  # the upstream record's two 8xH100 logs


def record_stage_ms(logs: list, args: tg.Hyperparameters) -> tuple[dict, float]:
    """({stage name: median ms per step over the logs' steps of that stage}, mean train time in s) of full runs."""
    per_stage, totals = {}, []
    for log in logs:
        run = compare.parse_log(log)
        clock = {step: ms for step, _total, ms, _avg in run.train}
        totals.append(run.time_s)
        for step in range(args.num_iterations):
            if step in clock and step + 1 in clock:  # line k is printed after step k-1
                name = tg.stage_at(step, args).name
                per_stage.setdefault(name, []).append(clock[step + 1] - clock[step])
    return {name: statistics.median(ms) for name, ms in per_stage.items()}, statistics.fmean(totals)


def exposed_share(timeline: dict) -> float:
    """The share of a step's collectives (their busy time) that no compute hides."""
    busy = timeline["communication_busy_ms"]
    return timeline["communication_exposed_ms"] / busy if busy else 0


def steps_per_stage(args: tg.Hyperparameters) -> dict:
    steps = {}
    for step in range(args.num_iterations):
        name = tg.stage_at(step, args).name
        steps[name] = steps.get(name, 0) + 1
    return steps


def total_s(rows: list, steps: dict, key: str) -> float:
    """The run's time to its last step, in s, from each stage's ms per step under `key`."""
    by_name = {r["stage"]: r for r in rows}
    return sum(n * by_name[name][key] for name, n in steps.items()) / 1000


def source(j: dict) -> dict:
    """Where an input was measured."""
    return dict(device=j.get("device"), commit=j.get("commit"), date=j.get("date"), world_size=j.get("world_size"),
                as_world_size=j.get("as_world_size"))


def predict(rank: dict, w1: dict, nccl: dict, record_ms: dict, record_total_s: float,
            args: tg.Hyperparameters) -> dict:
    comm_w8 = nccl["per_step_ms_at_target"]
    one_gpu = {stage["name"]: stage["median_ms"] for stage in w1["stages"]}
    rows = []
    for stage in rank["stages"]:
        t = stage["timeline"]
        share = exposed_share(t)
        compute = one_gpu[stage["name"]] / 8
        predicted = compute + t["idle_ms"] + comm_w8 * share
        ref = record_ms.get(stage["name"])
        rows.append(dict(stage=stage["name"], one_gpu_step_ms=one_gpu[stage["name"]], rank_compute_ms=compute,
                         rank_idle_ms=t["idle_ms"], rank_step_ms=stage["median_ms"],
                         rank_host_ms=stage["host_ms"], host_share=stage["host_ms"] / stage["median_ms"],
                         rank_compute_beyond_one_gpu_ms=t["compute_busy_ms"] - compute,
                         communication_busy_ms_rank=t["communication_busy_ms"],
                         communication_exposed_ms_rank=t["communication_exposed_ms"], exposed_share=share,
                         communication_ms_w8=comm_w8, communication_exposed_ms_w8=comm_w8 * share,
                         predicted_ms=predicted, record_ms=ref, ratio=predicted / ref if ref else None))
    steps = steps_per_stage(args)
    total = total_s(rows, steps, "predicted_ms")
    return dict(stages=rows, steps_per_stage=steps, predicted_total_s=total, record_total_s=record_total_s,
                total_ratio=total / record_total_s, rank_world_size=rank.get("world_size"),
                rank_step_total_s=total_s(rows, steps, "rank_step_ms"),
                inputs={name: source(j) for name, j in (("rank_bench", rank), ("w1_bench", w1), ("nccl", nccl))})


RANK_STEP_MEASURES = {
    "back_to_back_ms": "back_to_back_ms: steps run back to back as the trainer runs them, one synchronisation after "
                       "the last (the host's work before a step overlaps the previous step)",
    "median_ms": "median_ms: the median of steps synchronised one by one (inputs without back-to-back times)"}


def predict_from_ranks(ranks: list, exposure: dict, nccl: dict, record_ms: dict, record_total_s: float,
                       args: tg.Hyperparameters, w1: dict = None) -> dict:
    """The rank method: per stage the slowest emulated rank's step + the W=8 collectives x the exposed share."""
    comm_w8 = nccl["per_step_ms_at_target"]
    shared = {stage["name"]: stage["timeline"] for stage in exposure["stages"]}
    one_gpu = {stage["name"]: stage["median_ms"] for stage in w1["stages"]} if w1 else {}
    # the steps as the trainer runs them (back to back) where every input has them, else each synchronised alone
    key = "back_to_back_ms" if all("back_to_back_ms" in s for r in ranks for s in r["stages"]) else "median_ms"
    rows = []
    for stage in ranks[0]["stages"]:
        name = stage["name"]
        runs = {}  # rank -> its runs' ms at this stage
        for r in ranks:
            runs.setdefault(r["as_rank"], []).append(next(s[key] for s in r["stages"] if s["name"] == name))
        steps = {rank: statistics.median(ms) for rank, ms in runs.items()}  # a rank run several times: the median
        slowest = max(steps, key=steps.get)
        share = exposed_share(shared[name])
        predicted = steps[slowest] + comm_w8 * share
        ref = record_ms.get(name)
        rows.append(dict(stage=name, rank_steps_ms={str(r): ms for r, ms in sorted(steps.items())},
                         slowest_rank=slowest, rank_step_ms=steps[slowest], exposed_share=share,
                         communication_ms_w8=comm_w8, communication_exposed_ms_w8=comm_w8 * share,
                         one_gpu_step_over_8_ms=one_gpu[name] / 8 if name in one_gpu else None,
                         predicted_ms=predicted, record_ms=ref, ratio=predicted / ref if ref else None))
    steps = steps_per_stage(args)
    total = total_s(rows, steps, "predicted_ms")
    return dict(method="rank: the slowest emulated rank's step + the W=8 collectives x the exposed share",
                rank_step=RANK_STEP_MEASURES[key], stages=rows, steps_per_stage=steps, predicted_total_s=total,
                record_total_s=record_total_s, total_ratio=total / record_total_s,
                inputs=dict(ranks=[dict(source(r), as_rank=r["as_rank"]) for r in ranks], exposure=source(exposure),
                            nccl=source(nccl), w1_bench=source(w1) if w1 else None))


def rank_table(p: dict) -> str:
    lines = [f"{'stage':<10} {'slowest':>8} {'of ranks':>9} {'1 GPU/8':>8} {'comm W8':>8} {'exposed':>8} "
             f"{'predicted':>9} {'record':>7} {'x record':>8}"]
    for r in p["stages"]:
        ref = f"{r['record_ms']:.1f}" if r["record_ms"] else ""
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else ""
        over8 = f"{r['one_gpu_step_over_8_ms']:.1f}" if r["one_gpu_step_over_8_ms"] else ""
        lines.append(f"{r['stage']:<10} {r['rank_step_ms']:>8.1f} {','.join(r['rank_steps_ms']):>9} {over8:>8} "
                     f"{r['communication_ms_w8']:>8.2f} {r['communication_exposed_ms_w8']:>8.2f} "
                     f"{r['predicted_ms']:>9.1f} {ref:>7} {ratio:>8}")
    src = p["inputs"]
    lines.append(f"time to step {sum(p['steps_per_stage'].values())}: predicted {p['predicted_total_s']:.1f} s, "
                 f"the record {p['record_total_s']:.1f} s ({p['total_ratio']:.3f}x)")
    lines.append(f"a rank's step: {p['rank_step']}")
    lines.append(f"inputs: ranks {', '.join(str(r['as_rank']) for r in src['ranks'])} on {src['ranks'][0]['device']} "
                 f"at {src['ranks'][0]['commit']}; exposed share from W={src['exposure']['world_size']} on "
                 f"{src['exposure']['device']} at {src['exposure']['commit']}; collectives' time from "
                 f"{src['nccl']['device']} at {src['nccl']['commit']}")
    return "\n".join(lines)


def table(p: dict) -> str:
    rank = f"W={p['rank_world_size']} rank"
    lines = [f"{'stage':<10} {rank:>8} {'host %':>7} {'1 GPU/8':>8} {'idle':>5} {'comm W8':>8} {'exp W8':>7} "
             f"{'predicted':>9} {'record':>7} {'x record':>8}"]
    for r in p["stages"]:
        ref = f"{r['record_ms']:.1f}" if r["record_ms"] else ""
        ratio = f"{r['ratio']:.3f}" if r["ratio"] else ""
        lines.append(f"{r['stage']:<10} {r['rank_step_ms']:>8.1f} {100 * r['host_share']:>6.0f}% "
                     f"{r['rank_compute_ms']:>8.1f} {r['rank_idle_ms']:>5.2f} {r['communication_ms_w8']:>8.2f} "
                     f"{r['communication_exposed_ms_w8']:>7.2f} {r['predicted_ms']:>9.1f} {ref:>7} {ratio:>8}")
    lines.append(f"time to step {sum(p['steps_per_stage'].values())}: predicted {p['predicted_total_s']:.1f} s, "
                 f"the record {p['record_total_s']:.1f} s ({p['total_ratio']:.3f}x); the {rank}'s own steps "
                 f"{p['rank_step_total_s']:.1f} s")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank-bench", required=True, nargs="+",
                    help="bench.py JSON(s) of ranks of 8: emulated on one GPU (one or more ranks), or one torchrun run")
    ap.add_argument("--w1-bench", help="bench.py JSON of one GPU (its stage times); needed by the torchrun method")
    ap.add_argument("--exposure", help="bench.py JSON of ranks of 8 under torchrun (its GPU timeline): the exposed "
                                       "share of the collectives; needed by the emulated ranks")
    ap.add_argument("--nccl", required=True, help="nccl_bandwidth.py JSON (--for-world-size 8)")
    ap.add_argument("--record-logs", default=str(RECORD_LOGS), help="folder of the record's 8xH100 logs")
    ap.add_argument("--out", help="write the prediction as JSON here too")
    a = ap.parse_args(argv)
    try:
        ranks = [json.loads(Path(f).read_text()) for f in a.rank_bench]
        nccl = json.loads(Path(a.nccl).read_text())
        w1 = json.loads(Path(a.w1_bench).read_text()) if a.w1_bench else None
        exposure = json.loads(Path(a.exposure).read_text()) if a.exposure else None
        logs = sorted(Path(a.record_logs).glob("*.txt"))
        emulated = all(r.get("world_size", 1) == 1 and r.get("as_world_size") == 8 and r.get("as_rank") is not None
                       for r in ranks)
        if nccl.get("for_world_size") != 8:
            raise ValueError("--nccl must come from nccl_bandwidth.py --for-world-size 8")
        if w1 is not None and (w1.get("world_size", 1) != 1 or w1.get("as_world_size", 1) != 1):
            raise ValueError("--w1-bench must come from bench.py on one GPU")
        if emulated:
            if exposure is None or exposure.get("world_size", 1) < 2 or exposure.get("as_world_size") != 8:
                raise ValueError("emulated ranks need --exposure: bench.py --as-world-size 8 under torchrun")
        elif len(ranks) != 1 or ranks[0].get("as_world_size") != 8 or ranks[0].get("world_size", 1) < 2 or w1 is None:
            raise ValueError("--rank-bench must come from bench.py --as-world-size 8, on one GPU per rank (--as-rank) "
                             "or under torchrun with --w1-bench from bench.py on one GPU")
        if not logs:
            raise ValueError(f"no record logs (*.txt) in {a.record_logs}")
        args = tg.Hyperparameters()
        record_ms, record_total = record_stage_ms(logs, args)
    except (OSError, ValueError, KeyError, compare.LogError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if emulated:
        p = predict_from_ranks(ranks, exposure, nccl, record_ms, record_total, args, w1)
        print(rank_table(p))
    else:
        p = predict(ranks[0], w1, nccl, record_ms, record_total, args)
        print(table(p))
    if a.out:
        Path(a.out).write_text(json.dumps(p, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
