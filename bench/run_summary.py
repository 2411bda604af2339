"""Per-run numbers from training logs of the 90+6-step proxy schedule (or any schedule with validation lines at the
stage boundaries): validation losses, per-stage tokens/s from the train_time of consecutive validation lines,
warm-up time, peak memory and the replica check.

    python bench/run_summary.py DIR_OR_LOG... [--json out.json]

A stage's throughput is (steps between two validation lines x its tokens/step) / (train_time difference), which
is exact when the validation lines sit at the stage boundaries (steps 30, 60, 90 of the 90-step schedule) and
validation itself is not timed. Console copies (console*.txt) and profiles (*_profile.txt) are skipped."""
import argparse
import json
import re
import sys
from pathlib import Path

VAL_RE = re.compile(r"^step:(\d+)/(\d+) val_loss:([\d.]+) train_time:(\d+)ms")


def log_files(specs):
    for spec in specs:
        p = Path(spec)
        files = sorted(p.glob("*.txt")) if p.is_dir() else [p]
        yield from (f for f in files if not f.name.startswith("console") and not f.name.endswith("_profile.txt"))


def summarize(path: Path, stage_tokens=(131072, 262144, 393216)) -> dict:
    text = path.read_text()
    vals = [(int(m[1]), float(m[3]), int(m[4])) for m in (VAL_RE.match(line) for line in text.splitlines()) if m]
    out = dict(log=path.name, val_loss={step: loss for step, loss, _ in vals})
    for (s0, _, t0), (s1, _, t1), (i, tokens) in zip(vals, vals[1:], enumerate(stage_tokens)):
        out[f"stage{i + 1}_tokens_per_s"] = (s1 - s0) * tokens / ((t1 - t0) / 1000)
        out[f"stage{i + 1}_ms_per_step"] = (t1 - t0) / (s1 - s0)
    for key, pattern in (("warm_up", r"^Kernel warm-up done in .*$"), ("peak_memory", r"^peak memory .*$"),
                         ("replica_check", r"^replica check: .*$"), ("run_config", r"^Run config: .*$")):
        m = re.search(pattern, text, re.M)
        if m:
            out[key] = m.group(0)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    rows = [summarize(f) for f in log_files(a.paths)]
    for r in rows:
        tps = " ".join(f"{r.get(f'stage{i}_tokens_per_s', float('nan')) / 1e3:7.0f}k" for i in (1, 2, 3))
        print(f"{r['log']:28s} val@96 {r['val_loss'].get(96, float('nan')):.4f}  tokens/s by stage {tps}")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
