"""Validation loss per checkpoint step across several runs, and two sets compared step by step.

    python bench/loss/val_steps.py NEW_DIR [PRIOR_DIR] [--json out.json]

Each DIR holds training logs (one per run, e.g. one per seed). Prints mean, std and the runs' values at every
validation step, and with two sets per step: the difference of the means, Welch's t-test p-value, its 95 % interval,
and the smallest shift these runs could detect (two-sided 5 %, 80 % power: (t_0.975 + t_0.8) x the standard error,
at Welch's degrees of freedom). The "same loss at the same step" check: an optimisation must not move these beyond
run-to-run noise, and the detectable shift says how small a move the check could have seen.
"""
import argparse
import json
import sys
from pathlib import Path

from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "records"))
import compare  # noqa: E402


def load_finished_runs(specs) -> tuple[list, list]:
    """compare.load_runs over log files and folders, where a folder's console copies of its runs (names with
    "console": the same lines again) and profiles (*_profile.txt) are not runs."""
    files = []
    for spec in specs:
        p = Path(spec)
        files += [str(f) for f in sorted(p.glob("*.txt")) if "console" not in f.name
                  and not f.name.endswith("_profile.txt")] if p.is_dir() else [spec]
    return compare.load_runs(files)


def losses_by_step(runs) -> dict:
    """{step: [loss of every run that validated at that step]}, steps in order."""
    table = {}
    for run in runs:
        for step, _total, loss, _t, _avg in run.val:
            table.setdefault(step, []).append(loss)
    return dict(sorted(table.items()))


def summarise(runs) -> dict:
    out = {}
    for step, losses in losses_by_step(runs).items():
        mean, std = compare.mean_std(losses)
        out[step] = dict(mean=mean, std=std, n=len(losses), losses=losses)
    return out


def compare_sets(new: dict, prior: dict) -> dict:
    out = {}
    for step in new:
        if step in prior and new[step]["n"] >= 2 and prior[step]["n"] >= 2:
            t = compare.welch(new[step]["losses"], prior[step]["losses"])
            detectable = (stats.t.ppf(0.975, t["df"]) + stats.t.ppf(0.8, t["df"])) * t["se"] if t["se"] > 0 else 0.0
            out[step] = dict(diff=new[step]["mean"] - prior[step]["mean"], p=t["p"], ci95=list(t["ci"]), df=t["df"],
                             detectable_shift=float(detectable), n_new=new[step]["n"], n_prior=prior[step]["n"])
    return out


def text(name: str, s: dict) -> str:
    lines = [f"{name}:"]
    for step, row in s.items():
        values = " ".join(f"{x:.4f}" for x in row["losses"])
        std = f"{row['std']:.4f}" if row["n"] > 1 else "-"
        lines.append(f"  step {step:>5}: mean {row['mean']:.4f} std {std} (n={row['n']}: {values})")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", help="NEW_DIR [PRIOR_DIR]")
    ap.add_argument("--json", help="also write the numbers here")
    a = ap.parse_args(argv)
    if len(a.dirs) > 2:
        ap.error("give one or two folders")
    sets, result = [], {}
    for d in a.dirs:
        runs, skipped = load_finished_runs([d])
        for path, why in skipped:
            print(f"skipped {path}: {why}", file=sys.stderr)
        if not runs:
            print(f"error: no finished run logs in {d}", file=sys.stderr)
            return 2
        s = summarise(runs)
        sets.append(s)
        result[d] = dict(runs=[r.name for r in runs], steps=s)
        print(text(d, s))
    if len(sets) == 2:
        diff = compare_sets(*sets)
        result["new_minus_prior"] = diff
        print("new - prior:")
        for step, row in diff.items():
            print(f"  step {step:>5}: {row['diff']:+.4f} (Welch p = {row['p']:.3f}; 95 % interval "
                  f"{row['ci95'][0]:+.4f} to {row['ci95'][1]:+.4f}; detectable shift {row['detectable_shift']:.4f}; "
                  f"n = {row['n_new']} v {row['n_prior']})")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
