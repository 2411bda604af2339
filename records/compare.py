#!/usr/bin/env python3
"""Read speedrun training logs, summarise and compare sets of runs, and file new records.

  python records/compare.py summary SET... [--target 3.28]
  python records/compare.py compare NEW PRIOR [--target 3.28]
  python records/compare.py diff NEW PRIOR                         (log, .py file, or a folder with one log)
  python records/compare.py plot NEW [PRIOR] -o OUT.png                (or .pdf, .svg, ...)
  python records/compare.py new NAME SET... [--description TEXT] [--not-a-record] [--out DIR] [--force] ...
  python records/compare.py run NAME N [--nproc K] [--not-a-record] [--out DIR] ... [--] [TRAIN_ARGS...]

A SET (also NEW, PRIOR) is a log file, a folder (its *.txt files) or a comma-separated list of logs.
A run counts only if its log ends with the final validation line `step:N/N val_loss:...`; any other
file is named on a `SKIPPED <file>: <reason>` line and left out. Each run counts once: a file given twice, or a
log with the same step lines as another (whatever its name, whitespace or line endings), is a SKIPPED line too; two
finished logs with one run id (the file name's stem, the trainer's --run-id) but different step lines are refused.
Bad input (a path that does not exist, too): one line on stderr, exit 2.
See records/README.md for what counts as a record and a worked example.

Log format (train_gpt.py): script source, a line of 100 '=', `Running Python/PyTorch/Triton ...`, `Run config:
k=v ...` (not in upstream logs), nvidia-smi output, a line of 100 '=', then `step:250/2160 val_loss:4.3032
train_time:8385ms step_avg:33.54ms` (validation), `step:251/2160 train_time:...` (training), `peak memory ...`.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import difflib
import hashlib
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy import stats

SEPARATOR = "=" * 100
DEFAULT_TARGET = 3.28
P_THRESHOLD = 0.01
RUNS_NEEDED_CAP = 100_000
RECORD_STEPS = 2160        # the full schedule of a record run
RECORD_GPUS = 8            # records are 8-GPU runs
SMOKE_STEPS = 33           # train_gpt.py's --smoke preset: 30 + 3 steps
FINAL_STRETCH = 0.15       # plot: the last 15% of the training time, zoomed
REPO_ROOT = Path(__file__).resolve().parents[1]
TRAINER = "train_gpt.py"
TABLE_HEADER = "| Date | Time | Mean val loss | Runs | Hardware | Description | Link |"
TABLE_RULE = "|------|-----:|--------------:|-----:|----------|-------------|------|"

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?nan|[-+]?inf"
_EXTRA = r"(?:\s+\S.*)?\s*$"  # tolerate extra fields after step_avg
VAL_RE = re.compile(rf"^step:(\d+)/(\d+) val_loss:({_NUM}) train_time:({_NUM})ms step_avg:({_NUM})ms{_EXTRA}")
TRAIN_RE = re.compile(rf"^step:(\d+)/(\d+) train_time:({_NUM})ms step_avg:({_NUM})ms{_EXTRA}")
PEAK_RE = re.compile(r"^peak memory allocated: (\d+) MiB reserved: (\d+) MiB(?: graphs' pool: \d+ MiB)?\s*$")
PY_RE = re.compile(r"^Running Python (.+?)\s*$")
TORCH_RE = re.compile(r"^Running PyTorch (\S+) compiled for CUDA (\S+)\s*$")
TRITON_RE = re.compile(r"^Running Triton version (.+?)\s*$")
CONFIG_RE = re.compile(r"^Run config:\s*(.*)$")
WARMUP_RE = re.compile(rf"^Kernel warm-up done in ({_NUM})s \(process start to timed loop: ({_NUM})s[;)]")
SMI_GPU_RE = re.compile(r"^\|\s+(\d+)\s+(.+?)\s+(?:On|Off)\s+\|")
LOG_PATH_RE = re.compile(r"(\S+\.txt)\s*$")  # the trainer's first console line: logs/<run_id>.txt


class LogError(Exception):
    """A file that cannot be counted as a finished run; the message says why."""


class UsageError(Exception):
    """Bad input: main() prints the message as one line on stderr and exits with status 2."""


# ---------------------------------------------------------------------------------------------- parsing

@dataclass
class Run:
    path: Path
    digest: str | None = None  # sha256 of the log's bytes: two logs with the same digest are one run
    steps_key: str | None = None  # sha256 of the parsed step lines (val, train): equal ones are one run too
    script: str | None = None
    python: str | None = None
    torch: str | None = None
    cuda: str | None = None
    triton: str | None = None
    config: dict = field(default_factory=dict)
    smi_gpus: list = field(default_factory=list)   # [(index, name)] from the nvidia-smi table
    smi_available: bool | None = None
    val: list = field(default_factory=list)        # [(step, total, loss, train_time_ms, step_avg_ms)]
    train: list = field(default_factory=list)      # [(step, total, train_time_ms, step_avg_ms)]
    peak_alloc: int | None = None
    peak_reserved: int | None = None
    warmup_s: float | None = None
    startup_s: float | None = None

    name = property(lambda self: self.path.name)
    run_id = property(lambda self: self.path.stem)  # the trainer writes logs/<run_id>.txt
    final = property(lambda self: self.val[-1])
    loss = property(lambda self: self.final[2])
    time_ms = property(lambda self: self.final[3])
    time_s = property(lambda self: self.final[3] / 1000.0)
    step_avg = property(lambda self: self.final[4])
    steps = property(lambda self: self.final[1])
    device = property(lambda self: self.config.get("device"))
    kernels = property(lambda self: self.config.get("fused") or self.config.get("attn_backend"))  # older logs
    orthogonalizer = property(lambda self: self.config.get("orthogonalizer"))

    @property
    def on_gpu(self) -> bool:
        return self.device is None or self.device.startswith("cuda")

    @property
    def gpu_name(self) -> str | None:
        if not self.on_gpu:
            return None
        if self.config.get("gpu_name"):
            return self.config["gpu_name"]
        return Counter(n for _, n in self.smi_gpus).most_common(1)[0][0] if self.smi_gpus else None

    @property
    def n_procs(self) -> int | None:
        try:
            return int(self.config["world_size"])
        except (KeyError, ValueError):
            return len({i for i, _ in self.smi_gpus}) or None

    @property
    def hardware(self) -> str:
        n = self.n_procs
        if not self.on_gpu:
            return f"{self.device.upper()} ({n} procs)" if n else self.device.upper()
        if self.gpu_name:
            return f"{n}x {self.gpu_name}" if n else self.gpu_name
        return "no GPU (nvidia-smi not available)" if self.smi_available is False else "unknown"


def extract_script(text: str) -> str | None:
    """The script source embedded at the top of a log: everything before the first line of 100 '='."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.rstrip("\r\n") == SEPARATOR:
            return "".join(lines[:i])
    return None


def parse_run_config(rest: str) -> dict:
    try:
        tokens = shlex.split(rest)
    except ValueError:  # unbalanced quotes: whitespace splitting
        tokens = rest.split()
    return dict(tok.split("=", 1) for tok in tokens if "=" in tok)


def parse_text(text: str, path: Path | str = "<text>") -> Run:
    """Parse a log's text. Raises LogError when it is not a finished run."""
    run = Run(path=Path(path), script=extract_script(text))
    lines = text.splitlines()
    seps = [i for i, line in enumerate(lines) if line.rstrip("\r") == SEPARATOR]
    header = lines[seps[0] + 1: seps[1] if len(seps) > 1 else len(lines)] if seps else lines
    body = lines[seps[0] + 1:] if seps else lines
    for line in header:
        if m := PY_RE.match(line):
            run.python = m.group(1)
        elif m := TORCH_RE.match(line):
            run.torch, run.cuda = m.group(1), m.group(2)
        elif m := TRITON_RE.match(line):
            run.triton = m.group(1)
        elif m := CONFIG_RE.match(line):
            run.config.update(parse_run_config(m.group(1)))
        elif m := SMI_GPU_RE.match(line):
            run.smi_gpus.append((int(m.group(1)), m.group(2).strip()))
        elif line.strip().startswith("nvidia-smi:") and "not available" in line:
            run.smi_available = False
    if run.smi_gpus:
        run.smi_available = True
    for line in map(str.strip, body):  # a copy re-saved with other whitespace holds the same lines
        if m := VAL_RE.match(line):
            g = m.groups()
            run.val.append((int(g[0]), int(g[1]), float(g[2]), float(g[3]), float(g[4])))
        elif m := TRAIN_RE.match(line):
            g = m.groups()
            run.train.append((int(g[0]), int(g[1]), float(g[2]), float(g[3])))
        elif m := PEAK_RE.match(line):
            run.peak_alloc, run.peak_reserved = int(m.group(1)), int(m.group(2))
        elif m := WARMUP_RE.match(line):
            run.warmup_s, run.startup_s = float(m.group(1)), float(m.group(2))
    if not run.val:
        if not text.strip():
            raise LogError("empty file")
        if not seps and not run.train:
            raise LogError("not a training log (no separator line and no step lines)")
        last = f"; last training step {run.train[-1][0]}/{run.train[-1][1]}" if run.train else ""
        raise LogError(f"no validation line (step:N/M val_loss:...) found{last}")
    if run.final[0] != run.steps:
        raise LogError(f"unfinished run: last validation at step {run.final[0]}/{run.steps}, no final validation line")
    if not math.isfinite(run.loss):
        raise LogError(f"final val_loss is {run.loss} (diverged)")
    # Parsed numbers, not the lines' text: CRLF, trailing blanks or a missing last newline leave the key as it is.
    # repr, not the tuples themselves: a nan on a step line must equal the nan of its copy.
    run.steps_key = hashlib.sha256(repr((run.val, run.train)).encode()).hexdigest()
    return run


def read_bytes(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise LogError(f"unreadable: {e.strerror or e}") from None


def decode_log(data: bytes) -> str:
    if b"\x00" in data:
        raise LogError("binary file (contains NUL bytes), not a text log")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LogError(f"not UTF-8 text ({e.reason} at byte {e.start}), not a text log") from None


def read_text(path: Path) -> str:
    return decode_log(read_bytes(path))


def parse_log(path: Path | str) -> Run:
    data = read_bytes(Path(path))
    run = parse_text(decode_log(data), path)
    run.digest = hashlib.sha256(data).hexdigest()
    return run


def folder_logs(folder: Path) -> list[Path]:
    return sorted(q for q in folder.glob("*.txt") if not q.is_dir())  # a broken link too: it is named as skipped


def spec_paths(spec) -> list[Path]:
    """The paths one SET names: itself, or the parts of a comma-separated list (a path with a comma that exists is
    itself)."""
    spec = str(spec)
    parts = [spec] if (Path(spec).exists() or "," not in spec) else [p for p in spec.split(",") if p]
    return [Path(p) for p in parts]


def expand_paths(specs) -> tuple[list[Path], list[tuple[str, str]]]:
    """Files named by specs (file, folder -> its sorted *.txt, comma-separated list). Returns (files, skipped)."""
    files, skipped = [], []
    for part in (p for spec in specs for p in spec_paths(spec)):
        if part.is_dir():
            found = folder_logs(part)
            files += found
            if not found:
                skipped.append((str(part), "directory holds no *.txt logs"))
        elif part.is_file():
            files.append(part)
        elif part.exists():  # a FIFO, a device: reading it could block
            skipped.append((str(part), "not a regular file or folder"))
        else:
            skipped.append((str(part), "no such file or directory"))
    return files, skipped


def check_paths_exist(specs) -> None:
    """UsageError naming every path of specs that does not exist. On the command line a typo is bad input: as a
    SKIPPED line it would head a set of its own (`## typo.txt: 0 finished run(s)`) or quietly shrink one.
    (load_runs itself, for the bench tools, still names such a path as skipped.)"""
    missing = [str(p) for spec in specs for p in spec_paths(spec) if not p.exists()]
    if missing:
        raise UsageError(f"{', '.join(missing)}: no such file or directory; give a log, a folder of logs or a "
                         "comma-separated list of logs")


def file_key(path: Path):
    """(device, inode): the same file under two names (a path given twice, a folder and a file in it, a link)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def same_run(a: Run, b: Run) -> str | None:
    """Why a and b are one run ("identical content", or "the same step lines" for a copy whose bytes differ:
    CRLF line endings, a newline more or less), None if they are two. A run is its step lines, whatever the log's
    name: no other run repeats all their losses and times to the millisecond. UsageError if the logs share a run id
    but their step lines differ: the trainer writes one log per run id, so one of them was edited or the run id
    reused, and counting both could count one run twice."""
    if a.digest is not None and a.digest == b.digest:
        return "identical content"
    if a.steps_key is not None and a.steps_key == b.steps_key:
        return "the same step lines"
    if a.run_id == b.run_id:
        raise UsageError(f"{a.path} and {b.path} have the same run id '{a.run_id}' but different content (a run id "
                         "names one run: a log edited, or a --run-id used twice); keep only one of them, or rename "
                         "the other log after its own run")
    return None


def load_runs(specs) -> tuple[list[Run], list[tuple[str, str]]]:
    """Parse every log named by specs. Returns (finished runs, [(name, reason)] of skipped files). Each run counts
    once: a file met again, or a log with the same content as a counted one, is skipped with the first one named."""
    files, skipped = expand_paths(specs)
    runs, seen = [], {}
    for f in files:
        key = file_key(f)
        if key is not None and key in seen:
            skipped.append((str(f), f"the same file as {seen[key]} (given twice)"))
            continue
        if key is not None:
            seen[key] = f
        try:
            run = parse_log(f)
        except LogError as e:
            skipped.append((str(f), str(e)))
            continue
        except Exception as e:  # one odd file must not take the whole report down
            skipped.append((str(f), f"could not be parsed ({type(e).__name__}: {e})"))
            continue
        first = next(((r, why) for r in runs if (why := same_run(r, run))), None)
        if first:
            skipped.append((str(f), f"the same run as {first[0].path} ({first[1]})"))
        else:
            runs.append(run)
    return runs, skipped


def disjoint_sets(new: list[Run], prior: list[Run]) -> None:
    """UsageError naming a run that is in both NEW and PRIOR: a comparison of a set with itself means nothing."""
    for a in new:
        for b in prior:
            key = file_key(a.path)
            why = "the same file" if key is not None and key == file_key(b.path) else same_run(a, b)
            if why:
                raise UsageError(f"NEW {a.path} and PRIOR {b.path} are the same run ({why}); a run counts in one "
                                 "set only: take it out of NEW or PRIOR")


# ---------------------------------------------------------------------------------------------- record check

def record_problems(smoke=False, device=None, nproc=None, steps=None, data_path=None, epochs=None) -> list[str]:
    """Why runs with these settings are not a record attempt ([] when nothing is known to be off)."""
    out = ["smoke preset"] if smoke else []
    if device and not device.startswith("cuda"):
        out.append(device.upper())
    elif nproc is None:
        out.append("GPU count unknown")
    elif nproc != RECORD_GPUS:
        out.append(f"{nproc} GPU{'' if nproc == 1 else 's'}")
    if steps is not None and steps != RECORD_STEPS:
        out.append(f"{steps} steps")
    if data_path and "fineweb" not in data_path.lower():
        out.append(f"not FineWeb ({data_path})")
    if epochs not in (None, "", "1"):
        out.append(f"{epochs} epochs over the data")
    return out


def run_problems(runs) -> list[str]:
    """record_problems of each run, from its log (upstream logs have no Run config: steps and nvidia-smi)."""
    out = []
    for r in runs:
        smoke = r.config.get("smoke") == "1" if "smoke" in r.config else r.steps == SMOKE_STEPS  # older logs: steps
        for p in record_problems(smoke, r.device, r.n_procs, r.steps, r.config.get("data_path"),
                                 r.config.get("train_epochs")):
            out += [p] if p not in out else []
    return out


# ---------------------------------------------------------------------------------------------- statistics

def mean_std(xs) -> tuple[float, float]:
    a = np.asarray(xs, dtype=float)
    if a.size == 0:
        return math.nan, math.nan
    return float(a.mean()), (float(a.std(ddof=1)) if a.size > 1 else math.nan)


def p_value_below(losses, target: float = DEFAULT_TARGET) -> float:
    """One-sided t-test p-value that the mean loss is below target (nan for fewer than 2 runs)."""
    a = np.asarray(losses, dtype=float)
    if a.size < 2:
        return math.nan
    if np.all(a == a[0]):  # zero variance: scipy would warn; the answer is clear
        return 0.0 if a[0] < target else 1.0
    return float(stats.ttest_1samp(a, target, alternative="less").pvalue)


def runs_needed(mean: float, std: float, target: float = DEFAULT_TARGET, alpha: float = P_THRESHOLD,
                cap: int = RUNS_NEEDED_CAP) -> int | None:
    """Smallest n >= 2 for which a one-sided t-test on n runs with this mean/std gives p < alpha.
    None when mean >= target, when more than cap runs would be needed, or when the inputs are undefined."""
    if not (math.isfinite(mean) and math.isfinite(std)) or mean >= target:
        return None
    if std == 0:
        return 2
    n = np.arange(2, cap + 1)
    hit = np.nonzero(stats.t.cdf((mean - target) / (std / np.sqrt(n)), df=n - 1) < alpha)[0]
    return int(n[hit[0]]) if hit.size else None


def welch(a, b) -> dict:
    """Welch comparison of mean(a) - mean(b): diff, two-sided p, Welch-Satterthwaite df, 95% CI."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    out = {"diff": float(a.mean() - b.mean()) if a.size and b.size else math.nan,
           "p": math.nan, "df": math.nan, "ci": (math.nan, math.nan), "se": math.nan}
    if a.size < 2 or b.size < 2:
        return out
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    out["se"] = se = math.sqrt(va + vb)
    if se == 0:
        out.update(p=1.0 if out["diff"] == 0 else 0.0, ci=(out["diff"], out["diff"]))
        return out
    df = (va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1))
    half = float(stats.t.ppf(0.975, df)) * se
    out.update(p=float(stats.ttest_ind(a, b, equal_var=False).pvalue), df=float(df),
               ci=(out["diff"] - half, out["diff"] + half))
    return out


@dataclass
class SetStats:
    """The finished runs (and skipped files) of one set of logs."""
    label: str
    runs: list
    skipped: list
    target: float = DEFAULT_TARGET

    n = property(lambda self: len(self.runs))
    losses = property(lambda self: [r.loss for r in self.runs])
    times = property(lambda self: [r.time_s for r in self.runs])
    p = property(lambda self: p_value_below(self.losses, self.target))

    def loss_ms(self):
        return mean_std(self.losses)

    def time_ms(self):
        return mean_std(self.times)

    def needed_text(self) -> str:
        m, s = self.loss_ms()
        if self.n < 2:
            return "n/a (needs >= 2 runs)"
        if m >= self.target:
            return "n/a (mean >= target)"
        k = runs_needed(m, s, self.target)
        return str(k) if k is not None else f"> {RUNS_NEEDED_CAP}"


def load_set(specs, target=DEFAULT_TARGET, label=None) -> SetStats:
    specs = [str(x) for x in specs]
    check_paths_exist(specs)
    if label is None:
        label = (Path(specs[0].rstrip("/")).name or specs[0]) if len(specs) == 1 else f"{len(specs)} paths"
    return SetStats(label, *load_runs(specs), target)


# ---------------------------------------------------------------------------------------------- text output

def table(headers, rows, align=None) -> str:
    """A pipe table, aligned as plain text and valid markdown. align: one 'l' or 'r' per column."""
    rows = [["" if c is None else str(c) for c in r] for r in rows]
    align = align or "l" * len(headers)
    widths = [max([3, len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def fmt(cells):
        return "| " + " | ".join(c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(cells, widths, align)) + " |"
    rule = "|" + "|".join("-" * (w + 1) + ":" if a == "r" else "-" * (w + 2) for w, a in zip(widths, align)) + "|"
    return "\n".join([fmt(headers), rule] + [fmt(r) for r in rows])


def fnum(x, spec) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def fp(p) -> str:
    if p is None or not math.isfinite(p):
        return "n/a"
    return f"{p:.4g}" if p >= 1e-4 else f"{p:.2e}"


def short(v) -> str:
    return "-" if v in (None, "") else str(v)


def skipped_lines(s: SetStats, prefix: str = "") -> list[str]:
    return [f"{prefix}SKIPPED {name}: {reason}" for name, reason in s.skipped]


def consistency_notes(runs) -> list[str]:
    notes = []
    for label, key in (("step counts", lambda r: r.steps), ("hardware", lambda r: r.hardware),
                       ("torch versions", lambda r: r.torch)):
        vals = sorted({str(key(r)) for r in runs})
        if len(vals) > 1:
            notes.append(f"runs differ in {label}: {', '.join(vals)}")
    return notes


def summary_text(s: SetStats, level: int = 2) -> str:
    parts = [f"{'#' * level} {s.label}: {s.n} finished run(s), {len(s.skipped)} skipped"]
    if s.runs:
        runs = table(["run", "val_loss", "time_s", "step_avg_ms", "steps", "peak_alloc_MiB", "peak_reserved_MiB"],
                     [[r.name, f"{r.loss:.4f}", f"{r.time_s:.3f}", f"{r.step_avg:.2f}", r.steps, short(r.peak_alloc),
                       short(r.peak_reserved)] for r in s.runs], "lrrrrrr")
        env = table(["run", "torch", "triton", "hardware", "fused kernels", "orthogonalizer", "warmup_s"],
                    [[r.name, short(r.torch), short(r.triton), r.hardware, short(r.kernels),
                      short(r.orthogonalizer), "-" if r.warmup_s is None else f"{r.warmup_s:.1f}"] for r in s.runs])
        (lm, ls), (tm, ts) = s.loss_ms(), s.time_ms()
        stat = table(["metric", "n", "mean", "std", "min", "max"], [
            ["val_loss", s.n, fnum(lm, ".4f"), fnum(ls, ".4f"), f"{min(s.losses):.4f}", f"{max(s.losses):.4f}"],
            ["time_s", s.n, fnum(tm, ".4f"), fnum(ts, ".4f"), f"{min(s.times):.3f}", f"{max(s.times):.3f}"]],
            "lrrrrr")
        problems = run_problems(s.runs)
        parts += ["", runs, "", env, "", stat, "",
                  f"p-value (one-sided t-test, mean val_loss < {s.target}): {fp(s.p)}",
                  f"runs needed for p < {P_THRESHOLD} at this mean/std: {s.needed_text()}",
                  f"record check: not a record ({', '.join(problems)})" if problems else
                  f"record check: record conditions met ({RECORD_GPUS} GPUs, {RECORD_STEPS} steps)"]
        parts += [f"note: {n}" for n in consistency_notes(s.runs)]
    return "\n".join(parts + ([""] + skipped_lines(s) if s.skipped else []))


def compare_text(new: SetStats, prior: SetStats) -> str:
    def col(s: SetStats):
        (lm, ls), (tm, ts) = s.loss_ms(), s.time_ms()
        pa = [r.peak_alloc for r in s.runs if r.peak_alloc is not None]
        return [s.n, len(s.skipped), f"{fnum(lm, '.4f')} ± {fnum(ls, '.4f')}", f"{fnum(tm, '.3f')} ± {fnum(ts, '.3f')}",
                fnum(mean_std([r.step_avg for r in s.runs])[0], ".2f"), max(pa) if pa else "-", fp(s.p),
                s.needed_text(), ", ".join(sorted({r.hardware for r in s.runs})) or "-",
                ", ".join(sorted({short(r.torch) for r in s.runs})) or "-"]
    names = ["runs", "skipped", "val_loss mean ± std", "time_s mean ± std", "step_avg_ms (mean)",
             "peak_alloc_MiB (max)", f"p (loss < {new.target})", f"runs for p<{P_THRESHOLD}", "hardware", "torch"]
    out = [table(["", f"NEW: {new.label}", f"PRIOR: {prior.label}"],
                 [list(row) for row in zip(names, col(new), col(prior))]), ""]
    t, lo = welch(new.times, prior.times), welch(new.losses, prior.losses)
    out.append(f"time diff (new - prior): {fnum(t['diff'], '+.4f')} s, 95% CI [{fnum(t['ci'][0], '+.4f')}, "
               f"{fnum(t['ci'][1], '+.4f')}] (Welch t-test p={fp(t['p'])}, df={fnum(t['df'], '.1f')})")
    out.append(f"loss diff (new - prior): {fnum(lo['diff'], '+.4f')}, 95% CI [{fnum(lo['ci'][0], '+.4f')}, "
               f"{fnum(lo['ci'][1], '+.4f')}] (Welch t-test p={fp(lo['p'])})")
    out.append("verdict: " + verdict(new, prior, t))
    out += [f"warning: not like-for-like, {n}" for n in consistency_notes(new.runs + prior.runs)]
    return "\n".join(out + skipped_lines(new, "NEW ") + skipped_lines(prior, "PRIOR "))


def verdict(new: SetStats, prior: SetStats, t: dict) -> str:
    d = t["diff"]
    if not math.isfinite(d):
        speed = "time difference unknown"
    else:
        word = "faster" if d < 0 else ("slower" if d > 0 else "same speed")
        amount = f" by {abs(d):.3f} s ({abs(d) / prior.time_ms()[0] * 100:.2f}%)" if d != 0 else ""
        sig = ("significance unknown (needs >= 2 runs per set)" if not math.isfinite(t["p"]) else
               f"{'significant' if t['p'] < 0.05 else 'NOT significant'} (Welch p={fp(t['p'])}, threshold 0.05)")
        speed = f"NEW is {word}{amount}, {sig}"
    p = new.p
    if not math.isfinite(p):
        loss = f"loss target {new.target}: unknown (needs >= 2 new runs)"
    elif p < P_THRESHOLD:
        loss = f"loss target {new.target} held (p={fp(p)} < {P_THRESHOLD})"
    else:
        loss = f"loss target {new.target} NOT held (p={fp(p)} >= {P_THRESHOLD}; runs needed: {new.needed_text()})"
    return f"{speed}; {loss}"


def script_of(spec: str) -> tuple[str, str]:
    """(label, code) of a .py file, a log (the script at its top) or a folder holding exactly one log."""
    p = Path(spec)
    if p.is_dir():
        logs = folder_logs(p)
        if len(logs) != 1:
            names = ", ".join(q.name for q in logs[:5]) + (f", ... ({len(logs)} in all)" if len(logs) > 5 else "")
            raise UsageError(f"{spec} holds no *.txt log; give a log or .py file" if not logs else
                             f"{spec} holds {len(logs)} logs ({names}); give the one to diff as a file")
        p = logs[0]
    if not p.is_file():
        raise UsageError(f"{spec}: no such file or directory; give a log, a .py file or a folder with one log")
    try:
        text = read_text(p)
    except LogError as e:
        raise UsageError(f"{p}: {e}") from None
    code = text if p.suffix == ".py" else extract_script(text)
    if code is None:
        raise UsageError(f"{p}: no line of 100 '=' found, so no embedded script; give a training log or a .py file")
    return str(p), code.rstrip("\n") + "\n"


def diff_text(new_spec, prior_spec) -> str:
    (new_label, new_code), (prior_label, prior_code) = script_of(new_spec), script_of(prior_spec)
    lines = list(difflib.unified_diff(prior_code.splitlines(keepends=True), new_code.splitlines(keepends=True),
                                      fromfile=f"PRIOR {prior_label}", tofile=f"NEW {new_label}"))
    if not lines:
        return f"(no code differences between PRIOR {prior_label} and NEW {new_label})\n"
    return "".join(x if x.endswith("\n") else x + "\n" for x in lines)


# ---------------------------------------------------------------------------------------------- plot

def _step_ms(run: Run):
    """(steps, ms per step) from consecutive training lines, smoothed by a rolling median."""
    if len(run.train) < 2:
        return np.array([]), np.array([])
    s = np.array([t[0] for t in run.train], float)
    ms = np.array([t[2] for t in run.train], float)
    ok = np.diff(s) > 0
    s, y = s[1:][ok], np.diff(ms)[ok] / np.diff(s)[ok]
    half = max(1, min(25, len(y) // 5)) // 2
    return s, np.array([np.median(y[max(0, i - half): i + half + 1]) for i in range(len(y))])


def _mean_curve(runs):
    """Steps all runs validated at, with the mean val loss and the mean training time (s) there."""
    steps = sorted(set.intersection(*[{v[0] for v in r.val} for r in runs]))
    at = [{v[0]: v for v in r.val} for r in runs]
    return (np.array(steps), np.array([np.mean([a[st][2] for a in at]) for st in steps]),
            np.array([np.mean([a[st][3] for a in at]) / 1000 for st in steps]))


def _ylim(ax, ys, pad_frac=0.05):
    if ys:
        lo, hi = min(ys), max(ys)
        pad = pad_frac * (hi - lo) if hi > lo else 0.005
        ax.set_ylim(lo - pad, hi + pad)


def plot_figure(sets: list[SetStats], title: str | None = None):
    """A matplotlib Figure: val loss vs training time and vs step, the final stretch of the training time
    zoomed (axis titled 'final stretch'), and the step time."""
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, nothing global to close

    fig = Figure(figsize=(13, 9), dpi=110)
    (ax_t, ax_s), (ax_z, ax_st) = fig.subplots(2, 2)
    runs = [r for s in sets for r in s.runs]
    tgt = sets[0].target if sets else DEFAULT_TARGET
    z_lo = (1 - FINAL_STRETCH) * min(r.time_s for r in runs)
    z_hi = max(r.time_s for r in runs)
    z_ys = []
    for s, c in zip(sets, ["tab:blue", "tab:orange", "tab:green", "tab:red"]):
        for r in s.runs:
            vl, vt = [v[2] for v in r.val], [v[3] / 1000 for v in r.val]
            for ax, x in ((ax_t, vt), (ax_s, [v[0] for v in r.val]), (ax_z, vt)):
                ax.plot(x, vl, color=c, lw=0.8, alpha=0.35)
            z_ys += [y for x, y in zip(vt, vl) if x >= z_lo]
            st, ms = _step_ms(r)
            ax_st.plot(st, ms, color=c, lw=0.7, alpha=0.6)
            ax_st.plot([t[0] for t in r.train], [t[3] for t in r.train], color=c, lw=0.8, alpha=0.5, ls="--")
        steps, loss, secs = _mean_curve(s.runs)
        lab = f"{s.label} mean (n={s.n}, final {np.mean(s.losses):.4f} @ {np.mean(s.times):.2f} s)"
        for ax, x in ((ax_t, secs), (ax_s, steps), (ax_z, secs)):
            ax.plot(x, loss, color=c, lw=2.6, marker="o", ms=3, label=lab)
        ax_z.axvline(np.mean(s.times), color=c, lw=1, ls="--")
        ax_st.plot([], [], color=c, lw=1, label=f"{s.label}: ms per step (rolling median); dashed: step_avg")
    later = [v[2] for r in runs for v in r.val[1:]] or [v[2] for r in runs for v in r.val]
    for ax in (ax_t, ax_s):  # the step-0 loss (~10.8) would squash the curves
        _ylim(ax, later + ([tgt] if min(later) < tgt * 1.1 else []), 0.04)
        ax.set_ylabel("validation loss (step 0 off-scale)")
    pad = 0.03 * (z_hi - z_lo) or 1.0
    ax_z.set_xlim(z_lo - pad, z_hi + pad)
    _ylim(ax_z, z_ys)
    for ax in (ax_t, ax_s, ax_z):
        ax.axhline(tgt, color="k", lw=0.8, ls=":", label=f"target {tgt}")
    ax_z.set_ylabel("validation loss")
    ax_st.set_ylabel("ms per step")
    allms = np.concatenate([_step_ms(r)[1] for r in runs])
    if allms.size:  # outliers (compilation, validation hiccups) would hide the typical range
        ax_st.set_ylim(0, float(np.percentile(allms, 99)) * 1.3)
    for ax, xl, ttl in ((ax_t, "training time (s)", "validation loss vs training time"),
                        (ax_s, "step", "validation loss vs step"),
                        (ax_z, "training time (s)", f"final stretch: last {FINAL_STRETCH:.0%} of training time "
                                                    "(dashed: mean final time)"),
                        (ax_st, "step", "step time")):
        ax.set(xlabel=xl, title=ttl)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(title or " vs ".join(f"{s.label} ({s.n} runs)" for s in sets))
    fig.tight_layout()
    return fig


def plot_target(out: Path | str) -> Path:
    """out, checked: its folder exists (a typo must not create folders) and matplotlib writes its suffix."""
    from matplotlib.backend_bases import FigureCanvasBase

    out = Path(out)
    if not out.parent.is_dir():
        what = "is not a folder" if out.parent.exists() else "does not exist"
        raise UsageError(f"-o {out}: the folder {out.parent} {what}; create it or pick another path; nothing written")
    kinds = FigureCanvasBase.get_supported_filetypes()
    if out.suffix[1:].lower() not in kinds:
        got = f"'{out.suffix}' is not an image format matplotlib writes" if out.suffix else "no suffix names the format"
        raise UsageError(f"-o {out}: {got}; end the name in .png, .pdf or .svg (or another suffix matplotlib "
                         "writes, e.g. .jpg, .eps); nothing written")
    return out


def make_plot(sets: list[SetStats], out: Path | str, title: str | None = None) -> Path:
    """Write the plot to out in the format its suffix names. Written aside and renamed, so a writer that fails
    halfway (e.g. .pgf without LaTeX) leaves no partial file."""
    out = plot_target(out)
    tmp = out.with_name(f".{out.stem}.tmp{os.getpid()}{out.suffix}")  # same suffix: matplotlib infers the format
    try:
        plot_figure(sets, title).savefig(tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


# ---------------------------------------------------------------------------------------------- records

def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def append_record_row(readme: Path, row: str, link: str) -> None:
    """Append row to the records table in readme (created if missing); a row with the same link is replaced."""
    lines = readme.read_text().splitlines() if readme.exists() else [
        "# Records", "", "<!-- Rows are appended by `python records/compare.py new`. -->", "", TABLE_HEADER, TABLE_RULE]
    lines = [ln for ln in lines if not (ln.startswith("|") and f"]({link})" in ln)]
    h = next((i for i, ln in enumerate(lines) if ln.strip().startswith("| Date |")), None)
    if h is None:
        lines += ["", TABLE_HEADER, TABLE_RULE]
        h = len(lines) - 2
    end = h + 1
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    lines.insert(end, row)
    tmp = readme.with_name(f".{readme.name}.tmp{os.getpid()}")  # readers never see a half-written file
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, readme)


def default_out(not_a_record: bool) -> Path:
    """Where the run's folder goes without --out (read at call time, so tests can move REPO_ROOT)."""
    return REPO_ROOT / ("logs/not_records" if not_a_record else "records")


def record_folder(out_dir, name: str, date: str | None, force: bool, not_a_record: bool = False) -> Path:
    """out_dir/<date>_<name> (out_dir None: default_out), after checking the name, the date, that it is free (or
    --force) and that a non-record stays out of records/."""
    out_dir = Path(out_dir) if out_dir is not None else default_out(not_a_record)
    records = REPO_ROOT / "records"
    if not_a_record and records.resolve() in (out_dir.resolve(), *out_dir.resolve().parents):
        raise UsageError(f"--out {out_dir}: with --not-a-record the runs stay out of {records} (that folder holds "
                         f"records only); leave --out out to use {default_out(True)}, or pick another folder")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise UsageError(f"record name {name!r}: use letters, digits, '.', '_' or '-' (starting with a letter or digit)")
    try:
        _dt.date.fromisoformat(date)
    except (TypeError, ValueError):
        raise UsageError(f"--date {date!r}: give the date as YYYY-MM-DD") from None
    folder = out_dir / f"{date}_{name}"
    if os.path.lexists(folder) and not force:
        raise UsageError(f"{folder} already exists: pick another NAME, or add --force to replace it")
    if os.path.lexists(folder) and (folder.is_symlink() or not folder.is_dir()):
        raise UsageError(f"{folder} exists and is not a folder this tool made: pick another NAME")
    if folder.exists():  # --force replaces only what this tool wrote: the logs, README.md, plot.png
        others = sorted(f.name for f in folder.iterdir()
                        if f.is_dir() or not (f.suffix == ".txt" or f.name in ("README.md", "plot.png")))
        if others:
            raise UsageError(f"{folder} holds files this tool did not write ({', '.join(others)}): --force replaces "
                             "only a folder it made; move them away, or pick another NAME")
    return folder


def new_record(name, specs, out_dir=None, description=None, hardware=None, force=False, date=None,
               target=DEFAULT_TARGET, command=None, not_a_record=False) -> Path:
    """Create out_dir/<date>_<name>/ (logs, README.md, plot.png); for a record, add its row to out_dir/README.md.
    Refuses runs that are not record attempts unless not_a_record: then the folder (default logs/not_records/)
    is labelled in its README and no table gets a row. The folder is built aside and moved into place, so a
    failure leaves neither a half-written folder nor a row."""
    date = date or _dt.date.today().isoformat()
    folder = record_folder(out_dir, name, date, force, not_a_record)
    out_dir = folder.parent
    s = load_set(specs, target, label=folder.name)
    for line in skipped_lines(s):
        print(line)
    if not s.runs:
        raise UsageError("no finished runs among the given logs (see the SKIPPED lines); nothing recorded")
    problems = run_problems(s.runs)
    if problems and not not_a_record:
        raise UsageError(f"not a record ({', '.join(problems)}); nothing recorded. Add --not-a-record to file "
                         "it, labelled, under logs/not_records/ (records/README.md says what counts)")
    why = ", ".join(problems or ["marked --not-a-record"])
    (lm, _), (tm, _) = s.loss_ms(), s.time_ms()
    hw = hardware or ", ".join(sorted({r.hardware for r in s.runs}))
    copied = []
    for i, r in enumerate(s.runs):
        copied.append(r.name if r.name not in copied else f"{i:02d}_{r.name}")
    readme = [f"# {name}", ""] + ([f"**Not a record**: {why}.", ""] if not_a_record else []) + [
        f"Date: {date} · Hardware: {hw} · Runs: {s.n} · Mean time: {tm:.3f} s ({tm / 60:.3f} min) · "
        f"Mean val loss: {lm:.4f} · p(loss < {target}) = {fp(s.p)}", "",
        "## What changed", "",
        description or "TODO: describe the change: what, why, and the expected effect on time and loss.", "",
        "## Results", "", summary_text(s, level=3), "",
        "![validation loss and step time](plot.png)", "",
        "## Reproduce", "", "```",
        command or f"TODO: the command that made these runs, e.g. ./run.sh record {name} {s.n} --nproc 8 -- TRAIN_ARGS",
        "```", "", "## Logs", ""] + [f"- [{c}]({c})" for c in copied]
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.new-", dir=out_dir))
    old, placed = out_dir / f".{folder.name}.old-{os.getpid()}", False
    try:
        for r, dest in zip(s.runs, copied):
            shutil.copy2(r.path, tmp / dest)
        make_plot([s], tmp / "plot.png", title=f"{folder.name} ({s.n} runs)")
        (tmp / "README.md").write_text("\n".join(readme) + "\n")
        if folder.exists():  # --force: keep the old folder aside until the row is written
            folder.rename(old)
        tmp.rename(folder)
        placed = True
        link = f"{folder.name}/README.md"
        if not not_a_record:  # records/README.md lists records only
            append_record_row(out_dir / "README.md", f"| {date} | {tm:.3f} s | {lm:.4f} | {s.n} | {_md_cell(hw)} | "
                              f"{_md_cell(description or 'TODO: describe the change')} | [{folder.name}]({link}) |",
                              link)
    except BaseException:  # undo: remove what was placed, put the replaced folder back
        if placed:
            shutil.rmtree(folder, ignore_errors=True)
        if old.exists():
            old.rename(folder)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    what = f"{s.n} run(s) in {folder} (mean {tm:.3f} s, val_loss {lm:.4f})"
    print(f"filed {what} as not a record ({why}); no row added to {REPO_ROOT / 'records' / 'README.md'}"
          if not_a_record else f"recorded {what}; row added to {out_dir / 'README.md'}")
    return folder


# ---------------------------------------------------------------------------------------------- run

def visible_gpus() -> int:
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is not None:
        return len([x for x in cvd.split(",") if x.strip() and x.strip() != "-1"])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for ln in out.splitlines() if ln.startswith("GPU"))


def trainer_arg(train_args, flag: str) -> str | None:
    """The value train_gpt.py gets for `flag` from train_args (last one wins): '' for a bare flag, None if absent."""
    value = None
    for i, a in enumerate(train_args):
        if a == flag:
            nxt = train_args[i + 1] if i + 1 < len(train_args) else "-"
            value = "" if nxt.startswith("-") else nxt
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def is_smoke(train_args) -> bool:
    v = trainer_arg(train_args, "--smoke")
    return v is not None and v.lower() not in ("0", "false", "no", "off")


def default_nproc(train_args) -> int:
    n = visible_gpus()
    if n >= 1:
        return next(k for k in (8, 4, 2, 1) if n >= k)  # the trainer takes 1, 2, 4 or 8 processes per node
    if trainer_arg(train_args, "--device") == "cpu" or is_smoke(train_args):
        return 2  # a CPU run (each launch prints its command, --nproc_per_node included)
    raise UsageError("no GPU visible: add --nproc K after NAME N (any position before `--`), e.g. "
                     "`./run.sh record NAME N --nproc 2 --device cpu --smoke`, or set SPEEDRUN_NPROC")


class Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP while `run` works. A BaseException, like KeyboardInterrupt, so that no
    `except Exception` (a log that fails to parse, say) swallows it."""

    def __init__(self, signum: int, log: Path | None = None):
        super().__init__(signum)
        self.signum, self.log = signum, log  # log: the unfinished run's log, if the trainer had printed its path


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STOP_GRACE_S = 45.0  # torchrun gives its workers 30 s to exit after it passes a signal on, then kills them
_signals = {"hold": 0, "got": []}


def _on_signal(signum, frame):
    _signals["got"].append(signum)
    if not _signals["hold"]:
        raise Interrupted(signum)


class held:
    """A block that a stop signal does not cut short: the signal is raised as Interrupted when the block ends
    (nested: when the outermost one ends; raise_at_end=False: not at all, the caller looks at _signals['got'])."""

    def __init__(self, raise_at_end: bool = True):
        self.raise_at_end = raise_at_end

    def __enter__(self):
        _signals["hold"] += 1
        self.seen = len(_signals["got"])
        return self

    def __exit__(self, *exc):
        _signals["hold"] -= 1
        late = _signals["got"][self.seen:]
        if late and self.raise_at_end and not _signals["hold"] and exc[0] is None:
            raise Interrupted(late[0])
        return False


class stop_signals_raise:
    """While active, SIGINT, SIGTERM and SIGHUP raise Interrupted in the main thread (elsewhere: left alone)."""

    def __enter__(self):
        self.old = {}
        if threading.current_thread() is threading.main_thread():
            _signals["got"].clear()
            for sig in STOP_SIGNALS:
                self.old[sig] = signal.signal(sig, _on_signal)
        return self

    def __exit__(self, *exc):
        for sig, old in self.old.items():
            signal.signal(sig, old)
        _signals["hold"] = 0  # the handler raised, and stop_launch or the caller held the later signals
        return False


def _proc_stat(pid: int):
    """(ppid, start time, state) of a live process from /proc (Linux); None when it is gone or there is no /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after the name (may hold spaces)
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[19], fields[0]


def _descendants(root: int) -> set[tuple[int, str]]:
    """(pid, start time) of every process below root, whatever its session: torchrun starts each worker in a
    session of its own, which a signal to torchrun's process group does not reach."""
    children = {}
    for entry in Path("/proc").glob("[0-9]*"):
        st = _proc_stat(int(entry.name))
        if st:
            children.setdefault(st[0], []).append((int(entry.name), st[1]))
    out, todo = set(), [root]
    while todo:
        for pid, start in children.get(todo.pop(), []):
            if (pid, start) not in out:
                out.add((pid, start))
                todo.append(pid)
    return out


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_launch(proc: subprocess.Popen, signum: int) -> None:
    """End a launch on a stop signal: pass the signal to the launcher's process group, give it STOP_GRACE_S to
    exit (a second signal cuts that short), then SIGKILL whatever is left of it, workers in other sessions too."""
    with held(raise_at_end=False) as h:
        tree = _descendants(proc.pid)  # now: a worker whose launcher has died is no longer found below it
        if proc.returncode is None:  # not reaped yet, so its pid is still its process group's id
            _killpg(proc.pid, signum)
            deadline = time.monotonic() + STOP_GRACE_S
            while time.monotonic() < deadline and len(_signals["got"]) == h.seen:
                # WNOWAIT leaves the launcher unreaped: its group id cannot be reused before the kill below
                try:
                    if os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                        break
                except ChildProcessError:  # reaped after all (the signal came as Popen.wait returned)
                    break
                time.sleep(0.05)
            tree |= _descendants(proc.pid)
            _killpg(proc.pid, signal.SIGKILL)
        for pid, start in tree:
            st = _proc_stat(pid)
            if st and st[1] == start and st[2] != "Z":  # the same process still (not a new one with its pid)
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        proc.wait()


def _echo(stream, printed: list, base: Path, muted: threading.Event) -> None:
    """Copy the launch's output to ours (until muted) and collect the log paths it prints."""
    for line in stream:
        if m := LOG_PATH_RE.search(line.strip()):
            printed.append(base / m.group(1))  # an absolute path stays absolute
        if not muted.is_set():
            try:
                sys.stdout.write(line)
                sys.stdout.flush()
            except (OSError, ValueError):  # our stdout closed: keep draining the pipe so the launch never blocks
                muted.set()


def run_once(cmd, workdir: Path, base: Path) -> tuple[int, Path | None]:
    """Launch cmd once in workdir, echoing its output. Returns (exit status, the log whose path the trainer printed,
    relative to base). The launch is a process group of its own, so that on a stop signal it is ended whole
    (stop_launch) and nothing of it outlives `run`; Interrupted then carries the unfinished run's log."""
    print(f"$ {shlex.join(cmd)}", flush=True)
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    printed, muted, proc, reader = [], threading.Event(), None, None
    try:
        with held():  # the Popen object must exist before a signal may end the launch
            group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
            # stdin: a process outside the terminal's foreground group is stopped if it reads the terminal
            proc = subprocess.Popen(cmd, cwd=workdir, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, errors="replace", bufsize=1, env=env, **group)
            reader = threading.Thread(target=_echo, args=(proc.stdout, printed, base, muted), daemon=True)
            reader.start()
        rc = proc.wait()
        reader.join()
    except Interrupted as e:
        muted.set()  # the launcher's and workers' reports of the signal (tracebacks) are not echoed
        if proc is not None:
            stop_launch(proc, e.signum)
        if reader is not None:
            reader.join(timeout=5)
        e.log = next((p for p in printed if p.is_file()), None)
        raise
    finally:
        if proc is not None and proc.stdout:
            proc.stdout.close()
    return rc, next((p for p in printed if p.is_file()), None)


def interrupted_line(e: Interrupted, n: int, logs: list, name: str, not_a_record: bool) -> str:
    """The one line `run` ends with on a stop signal: which runs finished, which did not, and how to file them."""
    sig = signal.Signals(e.signum).name
    done = " ".join(map(str, logs)) or "none"
    if len(logs) < n:
        where = f"during run {len(logs) + 1}/{n}"
        unfinished = (f"; unfinished run: {e.log} (left where it is, not filed)" if e.log else
                      "; unfinished run: no log (the trainer had not printed its path)")
    else:
        where, unfinished = f"after all {n} runs, while filing them", ""
    refile = (f"; to file the finished runs: records/compare.py new {name} {' '.join(map(str, logs))}"
              f"{' --not-a-record' if not_a_record else ''}") if logs else ""
    return f"run: interrupted by {sig} {where}; finished runs: {done}{unfinished}; nothing filed{refile}"


def cmd_run(args) -> int:
    train = args.train_args
    if args.n < 1:
        raise UsageError(f"N = {args.n}: the number of runs must be >= 1")
    date = args.date or _dt.date.today().isoformat()
    record_folder(args.out, args.name, date, args.force, args.not_a_record)  # fail before launching anything
    launcher_text = args.launcher or os.environ.get("SPEEDRUN_LAUNCHER")
    env_nproc = os.environ.get("SPEEDRUN_NPROC", "")
    if not env_nproc.isdigit() and env_nproc:
        raise UsageError(f"SPEEDRUN_NPROC={env_nproc!r}: set it to a process count, or unset it")
    nproc = args.nproc if args.nproc is not None else int(env_nproc or 0) or default_nproc(train)
    if nproc < 1:
        raise UsageError(f"--nproc {nproc}: give a process count >= 1")
    device = trainer_arg(train, "--device") or ("cpu" if is_smoke(train) and not visible_gpus() else None)
    problems = record_problems(is_smoke(train), device, nproc,
                               data_path=trainer_arg(train, "--data-path"), epochs=trainer_arg(train, "--train-epochs"))
    if problems and not args.not_a_record:
        raise UsageError(f"these runs would not be a record ({', '.join(problems)}); nothing launched. Add "
                         "--not-a-record to run them and file them, labelled, under logs/not_records/ "
                         "(see records/README.md)")
    workdir = Path(args.workdir).resolve()
    if launcher_text:
        cmd, base = shlex.split(launcher_text) + [f"--nproc_per_node={nproc}", TRAINER] + train, workdir
    else:  # run.sh checks the settings first (bad input: one line, exit 2) and runs from the repository root
        cmd, base = [str(REPO_ROOT / "run.sh"), "launch", str(nproc)] + train, REPO_ROOT
    run_id = trainer_arg(train, "--run-id")
    if run_id and args.n > 1:
        raise UsageError(f"--run-id {run_id} with N = {args.n}: a run id names one run (each run would write over "
                         "the last one's log); leave --run-id out, each run then gets its own")
    if run_id and (log := base / (trainer_arg(train, "--log-dir") or "logs") / f"{run_id}.txt").exists():
        raise UsageError(f"--run-id {run_id}: {log} already exists and the trainer would write over it; pick "
                         "another run id, or leave --run-id out")
    logs = []
    with stop_signals_raise():
        try:
            for k in range(args.n):
                print(f"=== run {k + 1}/{args.n} ===", flush=True)
                try:
                    rc, log = run_once(cmd, workdir, base)
                except OSError as e:
                    raise UsageError(f"cannot start the launcher {cmd[0]} ({e.strerror or e}); check --launcher or "
                                     "SPEEDRUN_LAUNCHER" + (f" (logs so far: {' '.join(map(str, logs))})"
                                                            if logs else "")) from None
                so_far = "logs collected so far: " + " ".join(map(str, logs))
                if rc == 2:  # bad input, which the trainer (or run.sh) has reported in one line: nothing to add
                    if logs:
                        print(so_far, file=sys.stderr)
                    return 2
                if rc != 0 or log is None:
                    why = (f"launcher exited with status {rc}" if rc != 0 else
                           "the trainer printed no path of an existing log file (its first line: logs/<run_id>.txt)")
                    print(f"error: run {k + 1}/{args.n} failed: {why}", file=sys.stderr)
                    if logs:
                        print(so_far, file=sys.stderr)
                    return 1
                if log in logs:  # the same run id twice (e.g. set by a custom launcher): one log overwrote the other
                    raise UsageError(f"run {k + 1}/{args.n} wrote {log} again, over an earlier run's log: each run "
                                     "needs its own run id; nothing filed")
                logs.append(log)
                print(f"run {k + 1}/{args.n}: log {log}", flush=True)
            reproduce = (["./run.sh", "record", args.name, str(args.n), "--nproc", str(nproc)]
                         + (["--launcher", launcher_text] if launcher_text else [])
                         + (["--not-a-record"] if args.not_a_record else []) + (["--", *train] if train else []))
            try:
                new_record(args.name, logs, args.out, args.description, args.hardware, args.force, date,
                           args.target, command=shlex.join(reproduce), not_a_record=args.not_a_record)
            except UsageError as e:
                raise UsageError(f"{e}. The logs are kept; to file them: records/compare.py new {args.name} "
                                 f"{' '.join(map(str, logs))} [--not-a-record]") from None
        except Interrupted as e:
            _signals["hold"] += 1  # a further signal must not cut this line short (released on leaving the with)
            print(interrupted_line(e, args.n, logs, args.name, args.not_a_record), file=sys.stderr, flush=True)
            return 128 + e.signum
    return 0


# ---------------------------------------------------------------------------------------------- CLI

class Parser(argparse.ArgumentParser):
    """argparse with exact option names only, and errors as one line (UsageError -> exit 2)."""

    def __init__(self, *a, **kw):
        kw.setdefault("allow_abbrev", False)
        super().__init__(*a, **kw)

    def error(self, message):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} -h)")


def target_loss(text: str) -> float:
    """--target: a finite number. float() takes nan and inf, and with them every test against the target (p-value,
    runs needed, verdict) would print a meaningless answer."""
    try:
        x = float(text)
    except ValueError:
        x = None
    if x is None or not math.isfinite(x):
        what = "a number" if x is None else "a finite number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}; give the val loss to reach, e.g. "
                                         f"--target {DEFAULT_TARGET}")
    return x


RECORD_OPTS = [  # options of `new` and `run`
    ("--out", dict(metavar="DIR", help="folder the run's folder goes into; default records/ for a record, "
                                       "logs/not_records/ with --not-a-record")),
    ("--description", dict(help="what changed (README and table row)")),
    ("--hardware", dict(help="hardware text for README and row (default: from the logs)")),
    ("--date", dict(help="YYYY-MM-DD (default today)")),
    ("--force", dict(action="store_true", help="replace an existing folder of that name (and a record's row)")),
    ("--not-a-record", dict(action="store_true", help="file runs that are not a record attempt (smoke, CPU, "
                                                      "not 8 GPUs, not 2160 steps, not FineWeb), labelled so, "
                                                      "outside records/ and with no row in its table")),
    ("--target", dict(type=target_loss, default=DEFAULT_TARGET, help="val loss target (default 3.28)")),
]
RUN_OPTS = [
    ("--nproc", dict(type=int, help="processes per run (default: visible GPUs rounded down to 1/2/4/8; "
                                    "no GPU and --device cpu or --smoke: 2; env SPEEDRUN_NPROC)")),
    ("--launcher", dict(metavar="CMD", help="launcher command, run as CMD --nproc_per_node=K train_gpt.py TRAIN_ARGS (default: "
                             "./run.sh launch K TRAIN_ARGS, which checks the settings, then runs torchrun; env "
                             "SPEEDRUN_LAUNCHER)")),
    ("--workdir", dict(default=str(REPO_ROOT), help="folder to launch in (default: the repository root; the "
                                                    "default launcher always runs from there)")),
]


def split_run_argv(argv) -> tuple[list[str], list[str]]:
    """Split `run` arguments into ours (options and NAME N) and the trainer's. Our options (RECORD_OPTS,
    RUN_OPTS, -h) are taken anywhere before `--`; NAME and N are the first two other arguments; every other
    argument, and everything after `--`, goes to train_gpt.py in order. (No trainer flag has one of our names.)"""
    with_value = {f for f, kw in RECORD_OPTS + RUN_OPTS if kw.get("action") != "store_true"}
    flags = {f for f, kw in RECORD_OPTS + RUN_OPTS if kw.get("action") == "store_true"} | {"-h", "--help"}
    ours, pos, train, i = [], [], [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            train += argv[i + 1:]
            break
        if a in flags or a.split("=", 1)[0] in with_value:
            ours.append(a)
            if a in with_value:
                if i + 1 >= len(argv):
                    raise UsageError(f"run: {a} needs a value")
                ours.append(argv[i + 1])
                i += 1
        elif len(pos) < 2:
            if a.startswith("-"):
                raise UsageError(f"run: NAME and N come before the trainer's arguments ({a}): "
                                 "run NAME N [OPTIONS] [TRAIN_ARGS...] (see run -h)")
            pos.append(a)
        else:
            train.append(a)
        i += 1
    return ours + pos, train


def build_parser() -> Parser:
    p = Parser(prog="records/compare.py", description=__doc__.split("\n\n")[0],
               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="cmd", required=True)
    set_help = "a log, a folder (its *.txt logs) or a comma-separated list of logs"
    sp = sub.add_parser("summary", help="per-run table and set statistics")
    sp.add_argument("logs", nargs="+", metavar="SET", help=set_help)
    sp.add_argument("--target", type=target_loss, default=DEFAULT_TARGET, help="val loss target (default 3.28)")
    for name, hlp in (("compare", "NEW vs PRIOR: Welch t-test on time, loss target check"),
                      ("plot", "validation loss (with a zoom on the final stretch) and step time, to an image")):
        sp = sub.add_parser(name, help=hlp)
        sp.add_argument("new", metavar="NEW", help=set_help)
        sp.add_argument("prior", metavar="PRIOR", nargs="?" if name == "plot" else None, help=set_help)
        sp.add_argument("--target", type=target_loss, default=DEFAULT_TARGET, help="val loss target (default 3.28)")
        if name == "plot":
            sp.add_argument("-o", "--output", required=True, help="the image to write (required); its suffix picks "
                                                                  "the format: .png, .pdf, .svg, ...")
    sp = sub.add_parser("diff", help="unified diff PRIOR -> NEW of the scripts embedded in two logs")
    sp.add_argument("new", metavar="NEW", help="a log, a .py file, or a folder holding exactly one log")
    sp.add_argument("prior", metavar="PRIOR", help="the same kinds as NEW")
    sp = sub.add_parser("new", help="file logs as records/<date>_NAME and add a row to records/README.md "
                                    "(--not-a-record: as logs/not_records/<date>_NAME, no row)")
    sp.add_argument("name", metavar="NAME")
    sp.add_argument("logs", nargs="+", metavar="SET", help=set_help)
    for flag, kw in RECORD_OPTS:
        sp.add_argument(flag, **kw)
    sp = sub.add_parser(
        "run", help="run the trainer N times, then `new` on the logs",
        usage="records/compare.py run NAME N [OPTIONS] [TRAIN_ARGS...] [-- TRAIN_ARGS...]",
        description="Run train_gpt.py N times under the launcher, then file the logs like `new`. The options "
                    "below may go anywhere before `--`; all other arguments after NAME N go to train_gpt.py.")
    sp.add_argument("name", metavar="NAME")
    sp.add_argument("n", type=int, metavar="N")
    for flag, kw in RUN_OPTS + RECORD_OPTS:
        sp.add_argument(flag, **kw)
    return p


def cmd_summary(args) -> int:
    s = load_set(args.logs, args.target)
    print(summary_text(s))
    if not s.runs:
        raise UsageError("no finished runs to summarise (see the SKIPPED lines)")
    return 0


def cmd_compare(args) -> int:
    new, prior = load_set([args.new], args.target), load_set([args.prior], args.target)
    disjoint_sets(new.runs, prior.runs)
    if not new.runs or not prior.runs:  # nothing to compare: the skipped files, then why
        for s, prefix in ((new, "NEW "), (prior, "PRIOR ")):
            for line in skipped_lines(s, prefix):
                print(line)
        raise UsageError(f"{'NEW' if not new.runs else 'PRIOR'} has no finished runs (see the SKIPPED lines)")
    print(compare_text(new, prior))
    return 0


def cmd_plot(args) -> int:
    plot_target(args.output)  # before reading any log
    sets = [load_set([x], args.target) for x in (args.new, args.prior) if x]
    for s, prefix in zip(sets, ("NEW ", "PRIOR ")):
        for line in skipped_lines(s, prefix):
            print(line)
    sets = [s for s in sets if s.runs]
    if not sets:
        raise UsageError("no finished runs to plot (see the SKIPPED lines); nothing written")
    try:
        print(f"wrote {make_plot(sets, args.output)}")
    except (OSError, RuntimeError) as e:  # RuntimeError: e.g. .pgf needs a LaTeX install
        raise UsageError(f"-o {args.output}: cannot write it ({getattr(e, 'strerror', None) or ' '.join(str(e).split())}); "
                         "give a writable .png, .pdf or .svg path") from None
    return 0


def cmd_diff(args) -> int:
    sys.stdout.write(diff_text(args.new, args.prior))
    return 0


def cmd_new(args) -> int:
    new_record(args.name, args.logs, args.out, args.description, args.hardware, args.force, args.date,
               args.target, not_a_record=args.not_a_record)
    return 0


COMMANDS = {"summary": cmd_summary, "compare": cmd_compare, "diff": cmd_diff, "plot": cmd_plot, "new": cmd_new,
            "run": cmd_run}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        train = []
        if argv[:1] == ["run"]:
            ours, train = split_run_argv(argv[1:])
            argv = ["run"] + ours
        args = build_parser().parse_args(argv)
        args.train_args = train
        return COMMANDS[args.cmd](args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
