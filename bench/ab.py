"""A/B of two command lines on one machine: A and B alternate, each run writes a bench.py JSON, and one summary
compares them stage by stage (bench/README.md, "Speed A/B", has examples and the summary's fields).

    python3 bench/ab.py --out DIR [--pairs 3] [--lanes 0 1] [--budget S | --deadline EPOCH] [--min-left S]
        [--a-dir DIR] [--b-dir DIR] [--commit SHA] --a 'COMMAND ... {out} ...' --b 'COMMAND ... {out} ...'

A command is a bash command line run in --a-dir / --b-dir (default: here; an older commit's files there make a
commit-vs-commit A/B); {out} becomes DIR/a<k>.json or DIR/b<k>.json, its console DIR/a<k>.log. Pair k runs A then B
on one lane; --lanes gives each lane a CUDA_VISIBLE_DEVICES value and odd lanes run B first. Under a deadline a pair
starts only with time for both runs (each: its side's latest run, or the other side's before it has one, at least
--min-left; a first, cold-compiling run does not hold back the warm ones after it), a run still going at the deadline
is cut, and only pairs with both runs finished count: A and B stay balanced. The first failed run stops new
pairs. Writes DIR/ab.json, then prints the table. Exit status 0 with a pair counted and no run failed, else 1; 2 on
bad arguments; 130/143 when interrupted (after writing what finished).
"""
import argparse
import contextlib
import datetime
import json
import os
import random
import re
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MEMORY = ("peak_allocated_gib", "peak_in_use_gib")  # per stage in bench.py's JSON; peak_in_use_gib since CUDA graphs
# Per stage in bench.py's JSON: the median of steps synchronised one by one, and the mean step of steps run back to
# back as the trainer runs them (from one host's enqueue, the steadier of the two where the host is slow).
TIMES = ("median_ms", "back_to_back_ms")


def welch_p(a: list, b: list):
    """Two-sided p of Welch's t-test (scipy's); None with fewer than two runs a side, or when neither side varies."""
    if min(len(a), len(b)) < 2 or statistics.variance(a) + statistics.variance(b) == 0:
        return None
    from scipy import stats
    return float(stats.ttest_ind(b, a, equal_var=False).pvalue)


def read_result(path: Path):
    """({stage name: {"median_ms": .., "back_to_back_ms": .., peak memory fields}}, the whole JSON) of a bench.py
    JSON."""
    d = json.loads(path.read_text())
    stages = {s["name"]: {k: s[k] for k in (*TIMES, *MEMORY) if k in s} for s in d.get("stages", [])
              if "median_ms" in s}
    return stages, d


def bootstrap_interval(a: list, b: list, draws: int = 10000, seed: int = 0) -> tuple:
    """95 % percentile-bootstrap interval of median(b) - median(a): each side's runs drawn again with replacement,
    `draws` times; seeded, so a summary reads the same every time."""
    rng = random.Random(seed)
    diffs = sorted(statistics.median(rng.choices(b, k=len(b))) - statistics.median(rng.choices(a, k=len(a)))
                   for _ in range(draws))
    return diffs[int(0.025 * draws)], diffs[int(0.975 * draws) - 1]


def median_difference(a: list, b: list) -> dict:
    """B's median over its runs minus A's, in ms and in % of A's, with their 95 % bootstrap intervals."""
    base = statistics.median(a)
    low, high = bootstrap_interval(a, b)
    d = statistics.median(b) - base
    return dict(b_minus_a_ms=d, ci95_ms=[low, high], b_minus_a_pct=100 * d / base,
                ci95_pct=[100 * low / base, 100 * high / base])


def run_one(s, side: str, pair: int, lane_no: int, lane) -> dict:
    name = f"{side}{pair}"
    out, log = s.out / f"{name}.json", s.out / f"{name}.log"
    cmd = getattr(s.args, side).replace("{out}", shlex.quote(str(out)))
    folder = getattr(s.args, f"{side}_dir")
    # Lanes side by side: one OpenMP thread each, as torchrun gives every rank of a multi-GPU run (with a thread per
    # core in each, four W=1 runs on one host were host-bound at stage 3).
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": lane} if lane is not None else {}))
    env.setdefault("OMP_NUM_THREADS", "1")
    with s.lock:
        run = dict(name=name, side=side, pair=pair, order=len(s.runs), lane=lane_no, cuda_visible_devices=lane,
                   command=cmd, dir=folder, started=iso(), log=log.name)
        s.runs.append(run)
    t = time.time()
    with open(log, "w") as f:  # a session of its own: a cut or an interrupt kills torchrun's workers with it
        p = subprocess.Popen(["bash", "-c", cmd], cwd=folder, env=env, stdout=f, stderr=subprocess.STDOUT,
                             start_new_session=True)
        s.procs.add(p.pid)
        if s.stop:  # an interrupt between the lane's last look and this start
            kill_group(p.pid)
        try:
            p.wait(timeout=None if s.deadline is None else max(s.deadline - time.time(), 0.0))
        except subprocess.TimeoutExpired:
            run["cut_at_deadline"] = True
        kill_group(p.pid)  # all of it when cut; otherwise whatever the command left behind
        rc = p.wait()
        s.procs.discard(p.pid)
    run.update(seconds=round(time.time() - t, 2), exit=rc, ok=False)
    if rc == 0 and not run.get("cut_at_deadline"):
        try:
            run["stages"], d = read_result(out)
            run.update(json=out.name, device=d.get("device"), commit=d.get("commit"), ok=True)
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            run["error"] = f"no bench JSON at {{out}}: {type(e).__name__}: {e}"
    summary = ", ".join(f"{n} {v['median_ms']:.1f} ms" for n, v in run.get("stages", {}).items())
    print(f"{name} (lane {lane_no}): exit {rc} in {run['seconds']:.0f} s"
          f"{'; cut at the deadline' if run.get('cut_at_deadline') else ''}{'; ' + summary if summary else ''}"
          f"{'; ' + run['error'] if 'error' in run else ''}", flush=True)
    return run


def kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def run_needs(s, side: str) -> float:
    """Seconds a run of this side is taken to need: its latest finished run (the other side's latest before it has
    one), at least --min-left."""
    other = s.latest.get("b" if side == "a" else "a", 0.0)
    return max(s.args.min_left, s.latest.get(side, other))


def lane_loop(s, lane_no: int, lane) -> None:
    sides = ("a", "b") if lane_no % 2 == 0 else ("b", "a")
    while True:
        with s.lock:
            need = run_needs(s, "a") + run_needs(s, "b")
            if s.stop or s.next_pair > s.args.pairs or (s.deadline and s.deadline - time.time() < need):
                return
            pair, s.next_pair = s.next_pair, s.next_pair + 1
        for i, side in enumerate(sides):
            if s.stop:
                return
            if i and s.deadline and s.deadline - time.time() < run_needs(s, side):
                print(f"{side}{pair}: not started, too little time before the deadline", flush=True)
                return
            run = run_one(s, side, pair, lane_no, lane)
            with s.lock:
                if run["ok"]:
                    s.latest[side] = run["seconds"]
                elif not run.get("cut_at_deadline"):
                    s.stop = s.failed = True
            if not run["ok"]:
                return


def summarize(runs: list) -> tuple:
    ok = {(r["side"], r["pair"]): r for r in runs if r["ok"]}
    pairs = sorted(p for side, p in ok if side == "a" and ("b", p) in ok)
    stages = {}
    for name in (ok["a", pairs[0]]["stages"] if pairs else {}):
        a = [ok["a", p]["stages"].get(name) for p in pairs]
        b = [ok["b", p]["stages"].get(name) for p in pairs]
        if None in a + b:
            continue
        a_ms, b_ms = [x["median_ms"] for x in a], [x["median_ms"] for x in b]
        ma, mb = statistics.mean(a_ms), statistics.mean(b_ms)
        medians = {}
        for t in TIMES:
            if all(t in x for x in a + b):
                ta, tb = [x[t] for x in a], [x[t] for x in b]
                medians[t] = dict(a=ta, b=tb, **median_difference(ta, tb))
        row = dict(a_ms=a_ms, b_ms=b_ms, a_mean_ms=ma, b_mean_ms=mb, b_minus_a_ms=mb - ma,
                   b_minus_a_pct=100 * (mb - ma) / ma, welch_p=welch_p(a_ms, b_ms), medians=medians)
        for field in MEMORY:
            if all(field in x for x in a + b):
                ga, gb = statistics.mean(x[field] for x in a), statistics.mean(x[field] for x in b)
                row[field] = dict(a_mean=ga, b_mean=gb, b_minus_a=gb - ga)
        stages[name] = row
    return pairs, stages


def table(pairs: list, stages: dict) -> str:
    lines = [f"{len(pairs)} pair(s) counted: A and B {len(pairs)} run(s) each",
             f"{'stage':<10} {'A ms':>9} {'B ms':>9} {'B-A ms':>8} {'B-A %':>7} {'Welch p':>8}  peak GiB A / B"]
    for name, r in stages.items():
        mem = r.get("peak_in_use_gib") or r.get("peak_allocated_gib")
        p = "-" if r["welch_p"] is None else f"{r['welch_p']:.3f}"
        gib = f"  {mem['a_mean']:.2f} / {mem['b_mean']:.2f}" if mem else ""
        lines.append(f"{name:<10} {r['a_mean_ms']:>9.2f} {r['b_mean_ms']:>9.2f} {r['b_minus_a_ms']:>+8.2f} "
                     f"{r['b_minus_a_pct']:>+6.2f}% {p:>8}{gib}")
    for t, label in (("median_ms", "synchronised"), ("back_to_back_ms", "back to back")):
        rows = [(name, r["medians"][t]) for name, r in stages.items() if t in r.get("medians", {})]
        if rows:
            lines.append(f"{label}, B - A of the medians (95 % bootstrap interval):")
            lines += [f"{name:<10} {m['b_minus_a_ms']:>+8.2f} ms ({m['ci95_ms'][0]:+.2f} .. {m['ci95_ms'][1]:+.2f}) "
                      f"{m['b_minus_a_pct']:>+6.2f}% ({m['ci95_pct'][0]:+.2f} .. {m['ci95_pct'][1]:+.2f})"
                      for name, m in rows]
    return "\n".join(lines)


def iso(unix_time=None) -> str:
    when = datetime.datetime.fromtimestamp(unix_time or time.time(), datetime.timezone.utc)
    return when.isoformat(timespec="seconds")


def git_head(folder) -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=folder, capture_output=True, text=True).stdout.strip()
    except OSError:  # no git on the machine
        return ""


class OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        print(f"ab.py: {message} (see --help)", file=sys.stderr)
        sys.exit(2)


def main(argv=None) -> int:
    ap = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="command line A, with {out} where its JSON goes")
    ap.add_argument("--b", required=True, help="command line B, with {out} where its JSON goes")
    ap.add_argument("--a-dir", default=".", help="folder A runs in (default: here)")
    ap.add_argument("--b-dir", default=".", help="folder B runs in (default: here)")
    ap.add_argument("--out", required=True, help="a new or empty folder: the runs' JSONs and logs, and ab.json")
    ap.add_argument("--pairs", type=int, default=3, help="A/B pairs, on all lanes together (default 3)")
    ap.add_argument("--lanes", nargs="+", help="CUDA_VISIBLE_DEVICES of each lane (default: one lane, as set)")
    ap.add_argument("--deadline", type=float, help="unix time by which every run has ended")
    ap.add_argument("--budget", type=float, help="seconds from now: --deadline now + S")
    ap.add_argument("--min-left", type=float, default=0.0,
                    help="seconds a run is taken to need at least (its side's latest run, once longer)")
    ap.add_argument("--commit", default="", help="recorded instead of .git's HEAD (a copied tree's may be stale)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # --help, or the one line of error() above
        return e.code
    out = Path(args.out).resolve()
    deadline = args.deadline if args.budget is None else time.time() + args.budget
    problem = next((msg for bad, msg in [
        ("{out}" not in args.a, "--a has no {out}: the command must write its JSON there (bench.py --out {out})"),
        ("{out}" not in args.b, "--b has no {out}: the command must write its JSON there (bench.py --out {out})"),
        (not Path(args.a_dir).is_dir(), f"--a-dir {args.a_dir} is not a folder"),
        (not Path(args.b_dir).is_dir(), f"--b-dir {args.b_dir} is not a folder"),
        (args.pairs < 1, f"--pairs {args.pairs}: give 1 or more"),
        (args.deadline is not None and args.budget is not None, "give --deadline or --budget, not both"),
        (deadline is not None and deadline <= time.time(), "the deadline has passed: give a later --deadline or a "
                                                           "positive --budget"),
        (any(not re.fullmatch(r"\d+(,\d+)*", lane) for lane in args.lanes or []),
         f"--lanes {' '.join(args.lanes or [])}: give GPU numbers, a lane's several joined by commas (0 1 or 0,1 2,3)"),
        (out.exists() and (not out.is_dir() or any(out.iterdir())),
         f"--out {out} exists and is not an empty folder: give a new one (ab.py overwrites nothing)"),
    ] if bad), None)
    if problem:
        print(f"ab.py: {problem}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    args.a_dir, args.b_dir = str(Path(args.a_dir).resolve()), str(Path(args.b_dir).resolve())
    s = argparse.Namespace(args=args, out=out, deadline=deadline, lock=threading.Lock(), runs=[], procs=set(),
                           next_pair=1, latest={}, stop=False, failed=False, signal=None)

    def interrupted(signum, _frame):
        s.stop, s.signal = True, signum
        for pgid in list(s.procs):
            kill_group(pgid)
    old = {sig: signal.signal(sig, interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        lanes = [threading.Thread(target=lane_loop, args=(s, i, lane)) for i, lane in enumerate(args.lanes or [None])]
        for t in lanes:
            t.start()
        for t in lanes:
            while t.is_alive():
                t.join(0.2)  # a bounded wait lets the signal handler run
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    pairs, stages = summarize(s.runs)
    devices = sorted({r["device"] for r in s.runs if r.get("device")})
    summary = dict(
        tool="bench/ab.py", date=iso(), device=", ".join(devices), commit=args.commit or git_head(ROOT),
        command=shlex.join([Path(sys.executable).name, *sys.argv]) if argv is None else shlex.join(["ab.py", *argv]),
        a=dict(command=args.a, dir=args.a_dir), b=dict(command=args.b, dir=args.b_dir),
        lanes=args.lanes, pairs_asked=args.pairs, pairs_counted=pairs, deadline=deadline and iso(deadline),
        interrupted_by=None if s.signal is None else signal.Signals(s.signal).name,
        order=[r["name"] for r in s.runs], runs=s.runs, stages=stages)
    tmp = out / "ab.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, out / "ab.json")
    print(table(pairs, stages))
    if s.signal is not None:
        return 128 + s.signal
    return 0 if pairs and not s.failed else 1


if __name__ == "__main__":
    sys.exit(main())
