"""Where a cold start's seconds go, by Python function: run a script in this process while a thread samples the
main thread's stack every few milliseconds, until the trainer's kernel warm-up returns (or the script ends).

    python3 bench/startup/startup_profile.py --out DIR [--interval-ms 5] bench/bench.py --stages-only [-- TRAIN_FLAGS]

Writes DIR/startup_profile.txt (the functions with the most wall time, inclusive and self, and the same split by
before the warm-up and the warm-up) and DIR/startup_stacks.txt (collapsed stacks with their milliseconds, the
input format of flamegraph.pl and speedscope). Each sample counts the wall time since the previous one, so a long
call that holds the GIL is charged to the stack seen when it returns. Sampling costs the process a few per cent.
"""
import argparse
import collections
import runpy
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class StackSampler:
    """Samples one thread's Python stack at a fixed interval; each sample weighs the wall time since the last."""

    def __init__(self, thread_id: int, interval_s: float):
        self.thread_id, self.interval_s = thread_id, interval_s
        self.samples = []  # (time, seconds, stack as a tuple of "file:function" from the outermost frame)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self):
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self):
        last = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self.thread_id)
            now = time.perf_counter()
            if frame is None:
                break
            stack = []
            while frame is not None:
                code = frame.f_code
                path = Path(code.co_filename)  # folder/file: "torch/__init__.py" names a package, not any __init__
                stack.append(f"{path.parent.name}/{path.name}:{code.co_name}")
                frame = frame.f_back
            self.samples.append((time.time(), now - last, tuple(reversed(stack))))
            last = now


def top_functions(samples, n: int = 40) -> tuple[list, list]:
    """([(function, inclusive s)], [(function, self s)]), largest first; a recursive function counts once."""
    inclusive, own = collections.Counter(), collections.Counter()
    for _, seconds, stack in samples:
        for name in set(stack):
            inclusive[name] += seconds
        if stack:
            own[stack[-1]] += seconds
    return inclusive.most_common(n), own.most_common(n)


def phase_of(t: float, marks: list) -> str:
    """The startup phase a sample's wall time falls in: marks are (label, end time) in order; after the last
    one, the warm-up."""
    for label, end in marks:
        if t <= end:
            return label
    return "warm-up"


def report(samples, marks: list, total_s: float) -> str:
    lines = [f"{len(samples)} samples over {total_s:.1f}s of wall time"]
    inclusive, own = top_functions(samples)
    lines += ["", "inclusive seconds:"] + [f"{s:8.2f}  {name}" for name, s in inclusive]
    lines += ["", "self seconds:"] + [f"{s:8.2f}  {name}" for name, s in own]
    by_phase = collections.defaultdict(list)
    for sample in samples:
        by_phase[phase_of(sample[0], marks)].append(sample)
    for label, group in by_phase.items():
        seconds = sum(s for _, s, _ in group)
        incl, self_ = top_functions(group, 15)
        lines += ["", f"== {label}: {seconds:.2f}s sampled", "  inclusive:"]
        lines += [f"  {s:8.2f}  {name}" for name, s in incl]
        lines += ["  self:"] + [f"  {s:8.2f}  {name}" for name, s in self_]
    return "\n".join(lines) + "\n"


def collapsed(samples) -> str:
    """flamegraph.pl's input: one line per distinct stack, frames joined by ';', then its milliseconds."""
    weight = collections.Counter()
    for _, seconds, stack in samples:
        weight[";".join(stack)] += seconds * 1000
    return "".join(f"{stack} {ms:.0f}\n" for stack, ms in weight.most_common() if ms >= 1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for startup_profile.txt and startup_stacks.txt")
    ap.add_argument("--interval-ms", type=float, default=5.0)
    ap.add_argument("script", help="the script to run (e.g. bench/bench.py), followed by its own arguments")
    ap.add_argument("script_args", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    sampler = StackSampler(threading.get_ident(), a.interval_ms / 1000).start()
    sys.path.insert(0, str(ROOT))
    import train_gpt as tg  # the script imports this same module; its warm-up's return ends the sampling

    warm_up = tg.Trainer.warm_up_kernels
    marks = []  # (phase, when it ended): everything before the warm-up, then the warm-up itself

    def warm_up_then_stop(self):
        marks.append(("before the warm-up", time.time()))
        try:
            return warm_up(self)
        finally:
            sampler.stop()
            write(out, sampler, tg, marks)

    tg.Trainer.warm_up_kernels = warm_up_then_stop
    sys.argv = [a.script, *strip_separator(a.script_args)]
    try:
        runpy.run_path(a.script, run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 0
    finally:
        if not sampler._stop.is_set():  # the script ended before any warm-up
            sampler.stop()
            write(out, sampler, tg, marks)
    return 0


def strip_separator(args: list) -> list:
    """The script's arguments: everything after the first `--` (argparse keeps it in REMAINDER)."""
    return args[1:] if args and args[0] == "--" else args


def write(out: Path, sampler: StackSampler, tg, marks: list) -> None:
    total = time.time() - tg.PROCESS_START
    (out / "startup_profile.txt").write_text(report(sampler.samples, marks, total))
    (out / "startup_stacks.txt").write_text(collapsed(sampler.samples))
    print(f"startup profile: {out / 'startup_profile.txt'} ({len(sampler.samples)} samples)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
