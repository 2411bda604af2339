#!/usr/bin/env python3
"""Read speedrun training logs, summarise and compare sets of runs, and file new records.

Usage (run from the repository root; see records/README.md for a worked example):

  python records/compare.py summary LOG_OR_DIR... [--target 3.28]
  python records/compare.py compare NEW PRIOR [--target 3.28]
  python records/compare.py compare --new A.txt B.txt --prior DIR [--target 3.28]
  python records/compare.py diff NEW PRIOR
  python records/compare.py plot NEW [PRIOR] -o out.png
  python records/compare.py new NAME LOG_OR_DIR... [--description TEXT] [--hardware TEXT] [--force]
  python records/compare.py run [--nproc K] [--launcher CMD] [options] NAME N [--] [TRAIN_ARGS...]

NEW / PRIOR / LOG_OR_DIR: a log file, a directory (its *.txt files, sorted), or a comma-separated
list of log files. A run counts only when its log holds a final validation line at step N/N; every
other file (unfinished, no validation line, unreadable) is reported by name with the reason and skipped.

Log format (SPEC §8.4): script source verbatim, a line of 100 '=', `Running Python/PyTorch/Triton`
lines, an optional `Run config: k=v ...` line, nvidia-smi output (or `nvidia-smi: not available`),
another line of 100 '=', then the run lines:
  step:250/2160 val_loss:4.3032 train_time:8385ms step_avg:33.54ms      (validation)
  step:251/2160 train_time:8421ms step_avg:33.55ms                       (training)
  peak memory allocated: 29816 MiB reserved: 44176 MiB                   (end of run)
"""
from __future__ import annotations

import argparse
import datetime as _dt
import difflib
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
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
REPO_ROOT = Path(__file__).resolve().parents[1]
TABLE_HEADER = "| Date | Time | Mean val loss | Runs | Hardware | Description | Link |"
TABLE_RULE = "|------|-----:|--------------:|-----:|----------|-------------|------|"

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?nan|[-+]?inf"
_EXTRA = r"(?:\s+\S.*)?\s*$"  # tolerate extra fields appended after step_avg
VAL_RE = re.compile(rf"^step:(\d+)/(\d+) val_loss:({_NUM}) train_time:({_NUM})ms step_avg:({_NUM})ms{_EXTRA}")
TRAIN_RE = re.compile(rf"^step:(\d+)/(\d+) train_time:({_NUM})ms step_avg:({_NUM})ms{_EXTRA}")
PEAK_RE = re.compile(r"^peak memory allocated: (\d+) MiB reserved: (\d+) MiB\s*$")
PY_RE = re.compile(r"^Running Python (.+?)\s*$")
TORCH_RE = re.compile(r"^Running PyTorch (\S+) compiled for CUDA (\S+)\s*$")
TRITON_RE = re.compile(r"^Running Triton version (.+?)\s*$")
CONFIG_RE = re.compile(r"^Run config:\s*(.*)$")
# (newer logs add "; N compiled graphs" before the closing parenthesis)
WARMUP_RE = re.compile(rf"^Kernel warm-up done in ({_NUM})s \(process start to timed loop: ({_NUM})s[;)]")
SMI_GPU_RE = re.compile(r"^\|\s+(\d+)\s+(.+?)\s+(?:On|Off)\s+\|")


class LogError(Exception):
    """A log that cannot be counted as a finished run; the message says why."""


# ----------------------------------------------------------------------------------------------
# Parsing

@dataclass
class Run:
    path: Path
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

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def final(self):
        return self.val[-1]

    @property
    def loss(self) -> float:
        return self.final[2]

    @property
    def time_ms(self) -> float:
        return self.final[3]

    @property
    def time_s(self) -> float:
        return self.final[3] / 1000.0

    @property
    def step_avg(self) -> float:
        return self.final[4]

    @property
    def steps(self) -> int:
        return self.final[1]

    @property
    def device(self) -> str | None:
        return self.config.get("device")

    @property
    def attn_backend(self) -> str | None:
        return self.config.get("attn_backend")

    @property
    def orthogonalizer(self) -> str | None:
        return self.config.get("orthogonalizer")

    @property
    def gpu_name(self) -> str | None:
        if self.device and not self.device.startswith("cuda"):
            return None
        if self.config.get("gpu_name"):
            return self.config["gpu_name"]
        if self.smi_gpus:
            return Counter(n for _, n in self.smi_gpus).most_common(1)[0][0]
        return None

    @property
    def n_procs(self) -> int | None:
        ws = self.config.get("world_size")
        if ws is not None:
            try:
                return int(ws)
            except ValueError:
                pass
        if self.smi_gpus:
            return len({i for i, _ in self.smi_gpus})
        return None

    @property
    def hardware(self) -> str:
        n = self.n_procs
        if self.device and not self.device.startswith("cuda"):
            return f"{self.device.upper()} ({n} procs)" if n else self.device.upper()
        name = self.gpu_name
        if name:
            return f"{n}x {name}" if n else name
        if self.smi_available is False:
            return "no GPU (nvidia-smi not available)"
        return "unknown"


def _f(text: str) -> float:
    return float(text)


def extract_script(text: str) -> str | None:
    """The script source embedded at the top of a log: everything before the first line of 100 '='."""
    lines = text.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.rstrip("\r\n") == SEPARATOR:
            return "".join(lines[:i])
    return None


def parse_text(text: str, path: Path | str = "<text>") -> Run:
    """Parse a log's text. Raises LogError when it is not a finished run."""
    run = Run(path=Path(path))
    lines = text.splitlines()
    seps = [i for i, line in enumerate(lines) if line.rstrip("\r") == SEPARATOR]
    if seps:
        run.script = "".join(text.splitlines(keepends=True)[: seps[0]])
        header_end = seps[1] if len(seps) > 1 else len(lines)
        header = lines[seps[0] + 1: header_end]
        body = lines[seps[0] + 1:]
    else:
        header, body = lines, lines
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
    for line in body:
        if m := VAL_RE.match(line):
            run.val.append((int(m.group(1)), int(m.group(2)), _f(m.group(3)), _f(m.group(4)), _f(m.group(5))))
        elif m := TRAIN_RE.match(line):
            run.train.append((int(m.group(1)), int(m.group(2)), _f(m.group(3)), _f(m.group(4))))
        elif m := PEAK_RE.match(line):
            run.peak_alloc, run.peak_reserved = int(m.group(1)), int(m.group(2))
        elif m := WARMUP_RE.match(line):
            run.warmup_s, run.startup_s = _f(m.group(1)), _f(m.group(2))
    if not run.val:
        if not text.strip():
            raise LogError("empty file")
        if not seps and not run.train:
            raise LogError("not a training log (no separator line and no step lines)")
        raise LogError(f"no validation line (step:N/M val_loss:...) found"
                       + (f"; last training step {run.train[-1][0]}/{run.train[-1][1]}" if run.train else ""))
    step, total = run.final[0], run.final[1]
    if step != total:
        raise LogError(f"unfinished run: last validation at step {step}/{total}, no final validation line")
    if not math.isfinite(run.loss):
        raise LogError(f"final val_loss is {run.loss} (diverged)")
    return run


def parse_run_config(rest: str) -> dict:
    try:
        tokens = shlex.split(rest)
    except ValueError:  # unbalanced quotes: fall back to whitespace splitting
        tokens = rest.split()
    out = {}
    for tok in tokens:
        if "=" in tok:
            k, v = tok.split("=", 1)
            out[k.strip()] = v
    return out


def read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise LogError(f"unreadable: {e.strerror or e}") from None
    if b"\x00" in data:
        raise LogError("binary file (contains NUL bytes), not a text log")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LogError(f"not UTF-8 text ({e.reason} at byte {e.start}), not a text log") from None


def parse_log(path: Path | str) -> Run:
    path = Path(path)
    return parse_text(read_text(path), path)


def expand_paths(specs) -> tuple[list[Path], list[tuple[str, str]]]:
    """Files for path specs (file, directory -> sorted *.txt, comma-separated list). Returns (files, missing)."""
    files, missing = [], []
    for spec in specs:
        spec = str(spec)
        parts = [spec] if (Path(spec).exists() or "," not in spec) else [p for p in spec.split(",") if p]
        for part in parts:
            p = Path(part)
            if p.is_dir():
                found = sorted(q for q in p.glob("*.txt") if q.is_file())
                if not found:
                    missing.append((part, "directory holds no *.txt logs"))
                files.extend(found)
            elif p.is_file():
                files.append(p)
            else:
                missing.append((part, "no such file or directory"))
    return files, missing


def load_runs(specs) -> tuple[list[Run], list[tuple[str, str]]]:
    """Parse every log named by specs. Returns (finished runs, [(name, reason)] of skipped files)."""
    files, skipped = expand_paths(specs)
    runs = []
    for f in files:
        try:
            runs.append(parse_log(f))
        except LogError as e:
            skipped.append((str(f), str(e)))
        except Exception as e:  # never let one bad file take the whole report down
            skipped.append((str(f), f"could not be parsed ({type(e).__name__}: {e})"))
    return runs, skipped


# ----------------------------------------------------------------------------------------------
# Statistics

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
    None when mean >= target (never), or when more than cap runs would be needed / inputs undefined."""
    if not (math.isfinite(mean) and math.isfinite(std)) or mean >= target:
        return None
    if std == 0:
        return 2
    n = np.arange(2, cap + 1)
    tstat = (mean - target) / (std / np.sqrt(n))
    p = stats.t.cdf(tstat, df=n - 1)
    hit = np.nonzero(p < alpha)[0]
    return int(n[hit[0]]) if hit.size else None


@dataclass
class SetStats:
    label: str
    runs: list
    skipped: list
    target: float

    @property
    def n(self):
        return len(self.runs)

    @property
    def losses(self):
        return [r.loss for r in self.runs]

    @property
    def times(self):
        return [r.time_s for r in self.runs]

    def loss_ms(self):
        return mean_std(self.losses)

    def time_ms(self):
        return mean_std(self.times)

    @property
    def p(self):
        return p_value_below(self.losses, self.target)

    @property
    def needed(self):
        m, s = self.loss_ms()
        return runs_needed(m, s, self.target)

    def needed_text(self) -> str:
        m, s = self.loss_ms()
        if self.n < 2 or not math.isfinite(m):
            return "n/a (needs >= 2 runs)"
        if m >= self.target:
            return "n/a (mean >= target)"
        k = self.needed
        return str(k) if k is not None else f"> {RUNS_NEEDED_CAP}"


def welch(a, b) -> dict:
    """Welch comparison of mean(a) - mean(b): diff, two-sided p, Welch-Satterthwaite df, 95% CI."""
    a, b = np.asarray(a, float), np.asarray(b, float)
    out = {"diff": float(a.mean() - b.mean()) if a.size and b.size else math.nan,
           "p": math.nan, "df": math.nan, "ci": (math.nan, math.nan), "se": math.nan}
    if a.size < 2 or b.size < 2:
        return out
    va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
    se = math.sqrt(va + vb)
    out["se"] = se
    if se == 0:
        out["p"] = 1.0 if out["diff"] == 0 else 0.0
        out["ci"] = (out["diff"], out["diff"])
        return out
    df = (va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1))
    half = float(stats.t.ppf(0.975, df)) * se
    out.update(p=float(stats.ttest_ind(a, b, equal_var=False).pvalue), df=float(df),
               ci=(out["diff"] - half, out["diff"] + half))
    return out


# ----------------------------------------------------------------------------------------------
# Formatting

def table(headers, rows, align=None) -> str:
    """A pipe table, aligned as plain text and valid markdown. align: string of 'l'/'r' per column."""
    rows = [["" if c is None else str(c) for c in r] for r in rows]
    align = align or "l" * len(headers)
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]
    widths = [max(w, 3) for w in widths]

    def fmt(cells):
        return "| " + " | ".join(c.rjust(w) if a == "r" else c.ljust(w)
                                 for c, w, a in zip(cells, widths, align)) + " |"
    rule = "|" + "|".join(("-" * (w + 1) + ":") if a == "r" else ("-" * (w + 2))
                          for w, a in zip(widths, align)) + "|"
    return "\n".join([fmt(headers), rule] + [fmt(r) for r in rows])


def fnum(x, spec) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return format(x, spec)


def fp(p) -> str:
    if p is None or not math.isfinite(p):
        return "n/a"
    return f"{p:.4g}" if p >= 1e-4 else f"{p:.2e}"


def short(v) -> str:
    return "-" if v in (None, "") else str(v)


def runs_table(runs) -> str:
    rows = [[r.name, f"{r.loss:.4f}", f"{r.time_s:.3f}", f"{r.step_avg:.2f}", f"{r.steps}",
             short(r.peak_alloc), short(r.peak_reserved)] for r in runs]
    return table(["run", "val_loss", "time_s", "step_avg_ms", "steps", "peak_alloc_MiB", "peak_reserved_MiB"],
                 rows, "lrrrrrr")


def env_table(runs) -> str:
    rows = []
    for r in runs:
        warm = f"{r.warmup_s:.1f}" if r.warmup_s is not None else "-"
        rows.append([r.name, short(r.torch), short(r.triton), r.hardware, short(r.attn_backend),
                     short(r.orthogonalizer), warm])
    return table(["run", "torch", "triton", "hardware", "attn_backend", "orthogonalizer", "warmup_s"], rows)


def skipped_lines(skipped) -> list[str]:
    return [f"SKIPPED {name}: {reason}" for name, reason in skipped]


def set_block(s: SetStats) -> str:
    lm, ls = s.loss_ms()
    tm, ts = s.time_ms()
    out = [table(["metric", "n", "mean", "std", "min", "max"], [
        ["val_loss", s.n, fnum(lm, ".4f"), fnum(ls, ".4f"),
         fnum(min(s.losses, default=math.nan), ".4f"), fnum(max(s.losses, default=math.nan), ".4f")],
        ["time_s", s.n, fnum(tm, ".4f"), fnum(ts, ".4f"),
         fnum(min(s.times, default=math.nan), ".3f"), fnum(max(s.times, default=math.nan), ".3f")],
    ], "lrrrrr"), ""]
    out.append(f"p-value (one-sided t-test, mean val_loss < {s.target}): {fp(s.p)}")
    out.append(f"runs needed for p < {P_THRESHOLD} at this mean/std: {s.needed_text()}")
    notes = consistency_notes(s.runs)
    out += [f"note: {n}" for n in notes]
    return "\n".join(out)


def consistency_notes(runs) -> list[str]:
    notes = []
    for label, key in [("step counts", lambda r: r.steps), ("hardware", lambda r: r.hardware),
                       ("torch versions", lambda r: r.torch)]:
        vals = sorted({str(key(r)) for r in runs})
        if len(vals) > 1:
            notes.append(f"runs differ in {label}: {', '.join(vals)}")
    return notes


def summary_text(s: SetStats, level: int = 2) -> str:
    parts = [f"{'#' * level} {s.label}: {s.n} finished run(s), {len(s.skipped)} skipped"]
    if s.runs:
        parts += ["", runs_table(s.runs), "", env_table(s.runs), "", set_block(s)]
    if s.skipped:
        parts += [""] + skipped_lines(s.skipped)
    return "\n".join(parts)


def label_for(specs) -> str:
    specs = [str(x) for x in specs]
    if len(specs) == 1:
        p = Path(specs[0].rstrip("/"))
        return p.name or specs[0]
    return f"{len(specs)} paths"


def make_set(specs, target, label=None) -> SetStats:
    runs, skipped = load_runs(specs)
    return SetStats(label or label_for(specs), runs, skipped, target)


# ----------------------------------------------------------------------------------------------
# Subcommands

def cmd_summary(args) -> int:
    s = make_set(args.logs, args.target)
    print(summary_text(s))
    if not s.runs:
        print("error: no finished runs to summarise", file=sys.stderr)
        return 1
    return 0


def compare_text(new: SetStats, prior: SetStats) -> str:
    def col(s: SetStats):
        lm, ls = s.loss_ms()
        tm, ts = s.time_ms()
        sa = mean_std([r.step_avg for r in s.runs])[0]
        pa = [r.peak_alloc for r in s.runs if r.peak_alloc is not None]
        return [str(s.n), str(len(s.skipped)), f"{fnum(lm, '.4f')} ± {fnum(ls, '.4f')}",
                f"{fnum(tm, '.3f')} ± {fnum(ts, '.3f')}", fnum(sa, ".2f"),
                str(max(pa)) if pa else "-", fp(s.p), s.needed_text(),
                ", ".join(sorted({r.hardware for r in s.runs})) or "-",
                ", ".join(sorted({short(r.torch) for r in s.runs})) or "-"]
    names = ["runs", "skipped", "val_loss mean ± std", "time_s mean ± std", "step_avg_ms (mean)",
             "peak_alloc_MiB (max)", f"p (loss < {new.target})", f"runs for p<{P_THRESHOLD}", "hardware", "torch"]
    cn, cp = col(new), col(prior)
    out = [table(["", f"NEW: {new.label}", f"PRIOR: {prior.label}"],
                 [[a, b, c] for a, b, c in zip(names, cn, cp)]), ""]
    t = welch(new.times, prior.times)
    lo = welch(new.losses, prior.losses)
    out.append(f"time diff (new - prior): {fnum(t['diff'], '+.4f')} s, 95% CI [{fnum(t['ci'][0], '+.4f')}, "
               f"{fnum(t['ci'][1], '+.4f')}] (Welch t-test p={fp(t['p'])}, df={fnum(t['df'], '.1f')})")
    out.append(f"loss diff (new - prior): {fnum(lo['diff'], '+.4f')}, 95% CI [{fnum(lo['ci'][0], '+.4f')}, "
               f"{fnum(lo['ci'][1], '+.4f')}] (Welch t-test p={fp(lo['p'])})")
    out.append("verdict: " + verdict(new, prior, t))
    notes = consistency_notes(new.runs + prior.runs)
    out += [f"warning: not like-for-like, {n}" for n in notes]
    for label, s in (("NEW", new), ("PRIOR", prior)):
        for line in skipped_lines(s.skipped):
            out.append(f"{label} {line}")
    return "\n".join(out)


def verdict(new: SetStats, prior: SetStats, t: dict) -> str:
    parts = []
    d = t["diff"]
    if not math.isfinite(d):
        parts.append("time difference unknown")
    else:
        word = "faster" if d < 0 else ("slower" if d > 0 else "same speed")
        amount = f" by {abs(d):.3f} s ({abs(d) / prior.time_ms()[0] * 100:.2f}%)" if d != 0 else ""
        if math.isfinite(t["p"]):
            sig = "significant" if t["p"] < 0.05 else "NOT significant"
            parts.append(f"NEW is {word}{amount}, {sig} (Welch p={fp(t['p'])}, threshold 0.05)")
        else:
            parts.append(f"NEW is {word}{amount}, significance unknown (needs >= 2 runs per set)")
    p = new.p
    if not math.isfinite(p):
        parts.append(f"loss target {new.target}: unknown (needs >= 2 new runs)")
    elif p < P_THRESHOLD:
        parts.append(f"loss target {new.target} held (p={fp(p)} < {P_THRESHOLD})")
    else:
        parts.append(f"loss target {new.target} NOT held (p={fp(p)} >= {P_THRESHOLD}; "
                     f"runs needed: {new.needed_text()})")
    return "; ".join(parts)


def _two_sets(args, need_prior=True):
    new_specs = list(args.new or [])
    prior_specs = list(args.prior or [])
    pos = list(args.sets or [])
    if not new_specs and pos:
        new_specs = [pos.pop(0)]
    if not prior_specs and pos:
        prior_specs = [pos.pop(0)]
    if pos:
        raise SystemExit(f"error: unexpected extra arguments {pos}; use --new ... --prior ... for several paths")
    if not new_specs or (need_prior and not prior_specs):
        raise SystemExit("error: give NEW and PRIOR (positional, or --new ... --prior ...)")
    return new_specs, prior_specs


def cmd_compare(args) -> int:
    new_specs, prior_specs = _two_sets(args)
    new = make_set(new_specs, args.target)
    prior = make_set(prior_specs, args.target)
    print(compare_text(new, prior))
    if not new.runs or not prior.runs:
        print("error: a set has no finished runs", file=sys.stderr)
        return 1
    return 0


def script_of(spec: str) -> tuple[str, str]:
    """(label, code) for a .py file, a log (script embedded at its top) or a directory (its first log)."""
    p = Path(spec)
    if p.is_dir():
        logs = sorted(q for q in p.glob("*.txt") if q.is_file())
        if not logs:
            raise LogError(f"{spec}: directory holds no *.txt logs")
        p = logs[0]
    if not p.is_file():
        raise LogError(f"{spec}: no such file or directory")
    try:
        text = read_text(p)
    except LogError as e:
        raise LogError(f"{p}: {e}") from None
    if p.suffix == ".py":
        code = text
    else:
        code = extract_script(text)
        if code is None:
            raise LogError(f"{p}: no line of 100 '=' found, so no embedded script")
    return str(p), code.rstrip("\n") + "\n"


def diff_text(new_spec, prior_spec) -> str:
    new_label, new_code = script_of(new_spec)
    prior_label, prior_code = script_of(prior_spec)
    lines = list(difflib.unified_diff(prior_code.splitlines(keepends=True), new_code.splitlines(keepends=True),
                                      fromfile=f"PRIOR {prior_label}", tofile=f"NEW {new_label}"))
    if not lines:
        return f"(no code differences between PRIOR {prior_label} and NEW {new_label})\n"
    return "".join(x if x.endswith("\n") else x + "\n" for x in lines)


def cmd_diff(args) -> int:
    try:
        sys.stdout.write(diff_text(args.new, args.prior))
    except LogError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _rolling_median(y, w):
    y = np.asarray(y, float)
    if w <= 1 or y.size < w:
        return y
    half = w // 2
    return np.array([np.median(y[max(0, i - half): i + half + 1]) for i in range(y.size)])


def _step_ms(run: Run):
    """(steps, per-step ms) from consecutive training lines (validation time is excluded from train_time)."""
    if len(run.train) < 2:
        return np.array([]), np.array([])
    s = np.array([t[0] for t in run.train], float)
    ms = np.array([t[2] for t in run.train], float)
    ds = np.diff(s)
    ok = ds > 0
    return s[1:][ok], (np.diff(ms)[ok] / ds[ok])


def _smooth_step_ms(st, ms):
    return _rolling_median(ms, max(1, min(25, len(st) // 5)))


def _mean_curve(runs):
    """Mean val loss and mean train time (s) at the validation steps all runs share."""
    common = set.intersection(*[{v[0] for v in r.val} for r in runs]) if runs else set()
    steps = sorted(common)
    loss = [np.mean([next(v[2] for v in r.val if v[0] == st) for r in runs]) for st in steps]
    tsec = [np.mean([next(v[3] for v in r.val if v[0] == st) for r in runs]) / 1000 for st in steps]
    return np.array(steps), np.array(loss), np.array(tsec)


def make_plot(sets: list[SetStats], out: Path | str, title: str | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9), dpi=110)
    ax_t, ax_s, ax_z, ax_st = axes[0, 0], axes[0, 1], axes[1, 0], axes[1, 1]
    zoom_lo = []
    for k, s in enumerate(sets):
        c = colors[k % len(colors)]
        for r in s.runs:
            vs = np.array([v[0] for v in r.val]); vl = np.array([v[2] for v in r.val])
            vt = np.array([v[3] for v in r.val]) / 1000
            for ax, x in ((ax_t, vt), (ax_s, vs), (ax_z, vs)):
                ax.plot(x, vl, color=c, lw=0.8, alpha=0.35)
            st, ms = _step_ms(r)
            if st.size:
                ax_st.plot(st, _smooth_step_ms(st, ms), color=c, lw=0.7, alpha=0.45)
                ax_st.plot([t[0] for t in r.train], [t[3] for t in r.train], color=c, lw=0.8, alpha=0.5, ls="--")
        if s.runs:
            ms_steps, mloss, mtime = _mean_curve(s.runs)
            lab = f"{s.label} mean (n={s.n}, final {np.mean(s.losses):.4f} @ {np.mean(s.times):.2f} s)"
            ax_t.plot(mtime, mloss, color=c, lw=2.6, marker="o", ms=3, label=lab)
            ax_s.plot(ms_steps, mloss, color=c, lw=2.6, marker="o", ms=3, label=lab)
            ax_z.plot(ms_steps, mloss, color=c, lw=2.6, marker="o", ms=4, label=lab)
            zoom_lo.append(max(r.steps for r in s.runs) * 0.55)
            curves = [dict(zip(*(lambda st, ms: (st, _smooth_step_ms(st, ms)))(*_step_ms(r)))) for r in s.runs]
            common = sorted(set.intersection(*[set(cv) for cv in curves])) if curves else []
            if common:
                ax_st.plot(common, [np.mean([cv[x] for cv in curves]) for x in common], color=c, lw=2.2)
        ax_st.plot([], [], color=c, lw=2, label=f"{s.label}: per-step ms (rolling median; thick = mean)")
        ax_st.plot([], [], color=c, lw=1, ls="--", label=f"{s.label}: step_avg (cumulative)")
    tgt = sets[0].target if sets else DEFAULT_TARGET
    for ax in (ax_t, ax_s, ax_z):
        ax.axhline(tgt, color="k", lw=0.8, ls=":", label=f"target {tgt}")
    # the step-0 loss (~10.8 for GPT-2 vocab) would squash the curves: clip the top at the later points
    later = [v[2] for s in sets for r in s.runs for v in r.val[1:]] or [v[2] for s in sets for r in s.runs for v in r.val]
    if later:
        lo_y, hi_y = min(later + ([tgt] if min(later) < tgt * 1.1 else [])), max(later)
        pad = 0.04 * (hi_y - lo_y or 1.0)
        for ax in (ax_t, ax_s):
            ax.set_ylim(lo_y - pad, hi_y + pad)
    for ax in (ax_t, ax_s):
        ax.set_ylabel("validation loss (step 0 off-scale)")
        ax.grid(True, alpha=0.3)
    ax_t.set_xlabel("training time (s)")
    ax_s.set_xlabel("step")
    ax_t.set_title("validation loss vs training time")
    ax_s.set_title("validation loss vs step")
    # zoom: the last ~45% of training, where the runs are told apart
    if zoom_lo:
        lo = min(zoom_lo)
        ys = [v[2] for s in sets for r in s.runs for v in r.val if v[0] >= lo]
        if ys:
            ax_z.set_xlim(lo - 0.02 * lo, max(r.steps for s in sets for r in s.runs) * 1.02)
            ymin, ymax = min(ys + ([tgt] if min(ys) < tgt * 1.1 else [])), max(ys)
            pad = 0.05 * (ymax - ymin or 1.0)
            ax_z.set_ylim(ymin - pad, ymax + pad)
    ax_z.set_xlabel("step")
    ax_z.set_ylabel("validation loss")
    ax_z.set_title("validation loss, final stretch (zoom)")
    ax_z.grid(True, alpha=0.3)
    ax_st.set_xlabel("step")
    ax_st.set_ylabel("ms per step")
    ax_st.set_title("step time")
    ax_st.grid(True, alpha=0.3)
    allms = np.concatenate([_step_ms(r)[1] for s in sets for r in s.runs] + [np.array([])])
    if allms.size:  # clip outliers (compile/validation hiccups) so the typical range stays readable
        hi = float(np.percentile(allms, 99)) * 1.3
        ax_st.set_ylim(0, hi)
    for ax in (ax_t, ax_s, ax_z, ax_st):
        ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(title or " vs ".join(f"{s.label} ({s.n} runs)" for s in sets))
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    plt.close(fig)
    return out


def cmd_plot(args) -> int:
    new_specs, prior_specs = _two_sets(args, need_prior=False)
    sets = [make_set(new_specs, args.target)]
    if prior_specs:
        sets.append(make_set(prior_specs, args.target))
    for label, s in zip(("NEW", "PRIOR"), sets):
        for line in skipped_lines(s.skipped):
            print(f"{label} {line}")
    if not any(s.runs for s in sets):
        print("error: no finished runs to plot", file=sys.stderr)
        return 1
    out = make_plot(sets, args.output)
    print(f"wrote {out}")
    return 0


# ---------------------------------------------------------------------------------------------- records

def _md_cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def append_record_row(readme: Path, row: str, link: str) -> None:
    """Append row to the records table in readme (created if missing); replace a row with the same link."""
    if readme.exists():
        lines = readme.read_text().splitlines()
    else:
        lines = ["# Records", "", "<!-- Rows are appended by `python records/compare.py new`. -->", "",
                 TABLE_HEADER, TABLE_RULE]
    lines = [ln for ln in lines if not (ln.startswith("|") and f"]({link})" in ln)]
    try:
        h = next(i for i, ln in enumerate(lines) if ln.strip().startswith("| Date |"))
    except StopIteration:
        lines += ["", TABLE_HEADER, TABLE_RULE]
        h = len(lines) - 2
    end = h + 1
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    lines.insert(end, row)
    readme.write_text("\n".join(lines) + "\n")


def new_record(name: str, specs, records_dir="records", description=None, hardware=None, force=False,
               date=None, target=DEFAULT_TARGET, command=None) -> Path:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
        raise SystemExit(f"error: record name {name!r} must be letters, digits, '.', '_' or '-'")
    date = date or _dt.date.today().isoformat()
    records_dir = Path(records_dir)
    folder = records_dir / f"{date}_{name}"
    if folder.exists() and not force:
        raise SystemExit(f"error: {folder} already exists (use --force to overwrite)")
    s = make_set(specs, target, label=folder.name)
    for line in skipped_lines(s.skipped):
        print(line)
    if not s.runs:
        raise SystemExit("error: no finished runs among the given logs; nothing recorded")
    folder.mkdir(parents=True, exist_ok=True)
    used = set()
    copied = []
    for i, r in enumerate(s.runs):
        dest = r.path.name
        if dest in used:
            dest = f"{i:02d}_{dest}"
        used.add(dest)
        if r.path.resolve() != (folder / dest).resolve():
            shutil.copy2(r.path, folder / dest)
        copied.append(dest)
    make_plot([s], folder / "plot.png", title=f"{folder.name} ({s.n} runs)")
    lm, ls = s.loss_ms()
    tm, ts = s.time_ms()
    hw = hardware or ", ".join(sorted({r.hardware for r in s.runs}))
    desc = description or "TODO: describe the change"
    readme = [f"# {name}", "",
              f"Date: {date} · Hardware: {hw} · Runs: {s.n} · Mean time: {tm:.3f} s ({tm / 60:.3f} min) · "
              f"Mean val loss: {lm:.4f} · p(loss < {target}) = {fp(s.p)}", "",
              "## What changed", "",
              description or "TODO: describe the change: what, why, and the expected effect on time and loss.", "",
              "## Results", "",
              summary_text(s, level=3), "",
              "![validation loss and step time](plot.png)", "",
              "## Reproduce", "", "```",
              command or f"TODO: the command that produced these runs, e.g. ./run.sh record {name} N [TRAIN_ARGS...]",
              "```", "",
              "## Logs", ""] + [f"- [{c}]({c})" for c in copied]
    (folder / "README.md").write_text("\n".join(readme) + "\n")
    link = f"{folder.name}/README.md"
    row = (f"| {date} | {tm:.3f} s | {lm:.4f} | {s.n} | {_md_cell(hw)} | {_md_cell(desc)} | "
           f"[{folder.name}]({link}) |")
    append_record_row(records_dir / "README.md", row, link)
    print(f"recorded {s.n} run(s) in {folder} (mean {tm:.3f} s, val_loss {lm:.4f}); row added to "
          f"{records_dir / 'README.md'}")
    return folder


def cmd_new(args) -> int:
    new_record(args.name, args.logs, args.records_dir, args.description, args.hardware, args.force,
               args.date, args.target)
    return 0


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


def default_nproc() -> int:
    n = visible_gpus()
    if n < 1:
        raise SystemExit("error: no GPU visible; pass --nproc K (e.g. for a CPU smoke run)")
    for k in (8, 4, 2, 1):  # the trainer supports 1, 2, 4 or 8 processes per node
        if n >= k:
            return k
    return 1


LOG_PATH_RE = re.compile(r"(\S+\.txt)\s*$")  # the trainer's first console line: logs/<run_id>.txt


def run_once(cmd, workdir: Path, logs_dir: Path) -> Path:
    before = {p: p.stat().st_mtime for p in logs_dir.glob("*.txt")} if logs_dir.is_dir() else {}
    start = time.time()
    print(f"$ {shlex.join(cmd)}", flush=True)
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    env.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    printed = None
    proc = subprocess.Popen(cmd, cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stdout.write(line)
        sys.stdout.flush()
        if printed is None and (m := LOG_PATH_RE.search(line.strip())):
            cand = Path(m.group(1))
            cand = cand if cand.is_absolute() else workdir / cand
            if cand.is_file():  # the trainer creates the file before printing its path
                printed = cand
    rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"launcher exited with status {rc}")
    if printed is not None and printed.is_file():
        return printed
    new = [p for p in (logs_dir.glob("*.txt") if logs_dir.is_dir() else [])
           if p not in before or p.stat().st_mtime > before[p]]
    new = [p for p in new if p.stat().st_mtime >= start - 1]
    if not new:
        raise RuntimeError(f"run finished but no new log file appeared in {logs_dir}")
    return max(new, key=lambda p: p.stat().st_mtime)


RUN_OPTS_WITH_VALUE = {"--nproc", "--launcher", "--records-dir", "--logs-dir", "--workdir", "--description",
                       "--hardware", "--target", "--date", "--script"}
RUN_FLAGS = {"--force", "-h", "--help"}


def split_run_argv(argv):
    """Split `run` arguments: our options and NAME N come first; everything after N goes to the trainer
    (an optional `--` right after N is dropped). Matches `./run.sh record NAME N ARGS...`."""
    ours, pos, i = [], [], 0
    while i < len(argv) and len(pos) < 2:
        a = argv[i]
        if a == "--":
            raise SystemExit("error: run needs NAME and N before '--'")
        if a.startswith("-") and not _is_number(a):
            ours.append(a)
            if a in RUN_OPTS_WITH_VALUE:
                if i + 1 >= len(argv):
                    raise SystemExit(f"error: {a} needs a value")
                ours.append(argv[i + 1])
                i += 1
            elif a.split("=", 1)[0] not in RUN_OPTS_WITH_VALUE and a not in RUN_FLAGS:
                raise SystemExit(f"error: unknown run option {a} (trainer arguments go after NAME N)")
        else:
            pos.append(a)
        i += 1
    rest = argv[i:]
    if rest and rest[0] == "--":
        rest = rest[1:]
    return ours + pos, rest


def _log_dir_from(train_args):
    for i, a in enumerate(train_args):
        for flag in ("--log-dir", "--log_dir"):
            if a == flag and i + 1 < len(train_args):
                return train_args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
    return None


def _is_number(s):
    try:
        float(s)
        return True
    except ValueError:
        return False


def cmd_run(args, train_args) -> int:
    if args.n < 1:
        raise SystemExit("error: N must be >= 1")
    date = args.date or _dt.date.today().isoformat()
    folder = Path(args.records_dir) / f"{date}_{args.name}"
    if folder.exists() and not args.force:
        raise SystemExit(f"error: {folder} already exists (use --force to overwrite)")
    launcher = args.launcher or os.environ.get("SPEEDRUN_LAUNCHER")
    launcher = shlex.split(launcher) if launcher else [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    nproc = args.nproc or (int(os.environ["SPEEDRUN_NPROC"]) if os.environ.get("SPEEDRUN_NPROC") else None)
    nproc = nproc or default_nproc()
    workdir = Path(args.workdir).resolve()
    logs_dir = Path(args.logs_dir or _log_dir_from(train_args) or "logs")
    logs_dir = logs_dir if logs_dir.is_absolute() else workdir / logs_dir
    cmd = launcher + [f"--nproc_per_node={nproc}", args.script] + list(train_args)
    logs = []
    for k in range(args.n):
        print(f"=== run {k + 1}/{args.n} ===", flush=True)
        try:
            log = run_once(cmd, workdir, logs_dir)
        except (RuntimeError, OSError) as e:
            print(f"error: run {k + 1}/{args.n} failed: {e}", file=sys.stderr)
            if logs:
                print("logs collected so far: " + " ".join(map(str, logs)), file=sys.stderr)
            return 1
        print(f"run {k + 1}/{args.n}: log {log}", flush=True)
        logs.append(log)
    record_cmd = "./run.sh record " + shlex.join([args.name, str(args.n)] + list(train_args))
    new_record(args.name, [str(p) for p in logs], args.records_dir, args.description, args.hardware,
               args.force, date, args.target, command=record_cmd)
    return 0


# ---------------------------------------------------------------------------------------------- CLI

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="records/compare.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="cmd", required=True)

    def add_target(sp):
        sp.add_argument("--target", type=float, default=DEFAULT_TARGET, help="val loss target (default 3.28)")

    sp = sub.add_parser("summary", help="per-run table and set statistics")
    sp.add_argument("logs", nargs="+", metavar="LOG_OR_DIR")
    add_target(sp)

    for name, hlp in (("compare", "NEW vs PRIOR: Welch t-test on time, loss target check"),
                      ("plot", "validation loss and step-time curves to a PNG")):
        sp = sub.add_parser(name, help=hlp)
        sp.add_argument("sets", nargs="*", metavar="NEW PRIOR",
                        help="each a log, a directory or a comma-separated list of logs")
        sp.add_argument("--new", nargs="+", metavar="PATH", help="logs/directories of the new set")
        sp.add_argument("--prior", nargs="+", metavar="PATH", help="logs/directories of the prior set")
        add_target(sp)
        if name == "plot":
            sp.add_argument("-o", "--output", default="plot.png", help="PNG file (default plot.png)")

    sp = sub.add_parser("diff", help="unified diff of the scripts embedded in two logs (or .py files)")
    sp.add_argument("new", metavar="NEW")
    sp.add_argument("prior", metavar="PRIOR")

    sp = sub.add_parser("new", help="create records/<date>_NAME from logs and add a row to records/README.md")
    sp.add_argument("name", metavar="NAME")
    sp.add_argument("logs", nargs="+", metavar="LOG_OR_DIR")
    _add_record_opts(sp)
    # listed for --help only: main() hands `run` to build_run_parser() (trainer args follow NAME N verbatim)
    sub.add_parser("run", help="run the trainer N times, then `new` on the logs (see `run -h`)")
    return p


def _add_record_opts(sp):
    sp.add_argument("--records-dir", default=str(REPO_ROOT / "records"), help="default: this script's folder")
    sp.add_argument("--description", help="what changed (README placeholder and table row)")
    sp.add_argument("--hardware", help="hardware text (default: taken from the logs)")
    sp.add_argument("--date", help="YYYY-MM-DD (default today)")
    sp.add_argument("--force", action="store_true", help="overwrite an existing record folder")
    sp.add_argument("--target", type=float, default=DEFAULT_TARGET)


def build_run_parser() -> argparse.ArgumentParser:
    sp = argparse.ArgumentParser(
        prog="records/compare.py run",
        usage="records/compare.py run [options] NAME N [--] [TRAIN_ARGS...]",
        description="Run the trainer N times, then file the logs as a record (like `new`). Options go "
                    "before NAME; everything after N is passed to train_gpt.py.")
    sp.add_argument("name", metavar="NAME")
    sp.add_argument("n", type=int, metavar="N")
    sp.add_argument("--nproc", type=int, help="processes per node (default: visible GPUs, 1/2/4/8; "
                                              "env SPEEDRUN_NPROC)")
    sp.add_argument("--launcher", help="launcher command (default: python -m torch.distributed.run "
                                       "--standalone, i.e. torchrun; env SPEEDRUN_LAUNCHER)")
    sp.add_argument("--script", default="train_gpt.py", help="trainer script (default train_gpt.py)")
    sp.add_argument("--workdir", default=str(REPO_ROOT), help="directory to launch in (default repo root)")
    sp.add_argument("--logs-dir", help="where the trainer writes logs, relative to workdir (default: the "
                                       "trainer's --log-dir argument, else logs)")
    _add_record_opts(sp)
    return sp


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "run":
        ours, train_args = split_run_argv(argv[1:])
        return cmd_run(build_run_parser().parse_args(ours), train_args)
    args = build_parser().parse_args(argv)
    return {"summary": cmd_summary, "compare": cmd_compare, "diff": cmd_diff, "plot": cmd_plot,
            "new": cmd_new}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
