"""Per-run numbers from training logs of the 90+6-step proxy schedule (or any schedule with validation lines at the
stage boundaries): validation losses, per-stage tokens/s from the train_time of consecutive validation lines,
warm-up time, peak memory and the replica check.

    python bench/loss/run_summary.py DIR_OR_LOG... [--json out.json]

A stage's throughput is (steps between two validation lines x its tokens/step) / (train_time difference), which
is exact when the validation lines sit at the stage boundaries (steps 30, 60, 90 of the 90-step schedule) and
validation itself is not timed. Logs are parsed by records/compare.py; unfinished or foreign files are named and
skipped, console copies and profiles are left out (bench/loss/val_steps.py's rule)."""
import argparse
import json
import re
import sys
from pathlib import Path

from val_steps import load_finished_runs

REPLICA_RE = re.compile(r"^replica check: .*$", re.M)


def summarize(run, stage_tokens=(131072, 262144, 393216)) -> dict:
    """One compare.Run as a flat dict (val_loss by step, stage throughputs, warm-up, memory, replica check)."""
    vals = [(step, loss, t_ms) for step, _total, loss, t_ms, _avg in run.val]
    out = dict(log=run.name, val_loss={step: loss for step, loss, _ in vals})
    for (s0, _, t0), (s1, _, t1), (i, tokens) in zip(vals, vals[1:], enumerate(stage_tokens)):
        out[f"stage{i + 1}_tokens_per_s"] = (s1 - s0) * tokens / ((t1 - t0) / 1000)
        out[f"stage{i + 1}_ms_per_step"] = (t1 - t0) / (s1 - s0)
    out.update(warm_up_s=run.warmup_s, process_start_to_timed_loop_s=run.startup_s,
               peak_allocated_mib=run.peak_alloc, peak_reserved_mib=run.peak_reserved, run_config=run.config)
    m = REPLICA_RE.search(run.path.read_text())
    if m:
        out["replica_check"] = m.group(0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    runs, skipped = load_finished_runs(a.paths)
    for path, why in skipped:
        print(f"skipped {path}: {why}", file=sys.stderr)
    rows = [summarize(r) for r in runs]
    for r in rows:
        tps = " ".join(f"{r[f'stage{i}_tokens_per_s'] / 1e3:7.0f}k" for i in (1, 2, 3) if f"stage{i}_tokens_per_s" in r)
        print(f"{r['log']:28s} val@{max(r['val_loss'])} {r['val_loss'][max(r['val_loss'])]:.4f}  tokens/s by stage {tps}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
