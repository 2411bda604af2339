"""Tests for records/compare.py: log parsing, statistics, compare/diff/plot/new/run subcommands."""
import hashlib
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from processes import STARTED_GROUPS, group_members, kill_group, run_group

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures" / "records"
RUN1 = FIX / "2025-12-11_record_run1.txt"
RUN2 = FIX / "2025-12-11_record_run2.txt"
CPU = FIX / "local" / "cpu_smoke_run.txt"

_spec = importlib.util.spec_from_file_location("records_compare", REPO / "records" / "compare.py")
rc = importlib.util.module_from_spec(_spec)
sys.modules["records_compare"] = rc
_spec.loader.exec_module(rc)

PR168_LOSSES = [3.2758, 3.2807, 3.2776, 3.2757, 3.2793, 3.2764, 3.2795, 3.2788, 3.2785, 3.2748]
PR168_TIMES = [131.238, 131.291, 131.155, 131.157, 131.254, 131.304, 131.155, 131.130, 131.157, 131.265]
BASE_TIMES = [132.552, 132.817, 132.739, 132.779]
BASE_LOSSES = [3.2796, 3.2781, 3.2798, 3.2793]

SCRIPT = textwrap.dedent('''\
    import torch
    LR = 0.05
    def train():
        return LR * 2
''')


def make_log(loss=3.2770, time_ms=131200.0, total=40, script=SCRIPT, config=None, finish=True, val_every=10):
    """Text of a synthetic log in our trainer's format ending with the given final val_loss/train_time."""
    cfg = config if config is not None else (
        'world_size=8 grad_accum_steps=1 device=cuda attn_backend=varlen orthogonalizer=polar '
        'gpu_name="NVIDIA H100 80GB HBM3"')
    head = [script.rstrip("\n"), "=" * 100, "Running Python 3.11.9", "Running PyTorch 2.9.1+cu128 compiled for CUDA 12.8",
            "Running Triton version 3.5.1", f"Run config: {cfg}", "nvidia-smi: not available", "", "=" * 100,
            "Kernel warm-up done in 93.2s (process start to timed loop: 101.5s)"]
    body = []
    last = total if finish else total - val_every
    for step in range(last + 1):
        t = time_ms * step / total
        if step % val_every == 0 or step == total:
            vl = loss if step == total else loss + 5.0 * (1 - step / total)
            body.append(f"step:{step}/{total} val_loss:{vl:.4f} train_time:{t:.0f}ms step_avg:{t / max(step, 1):.2f}ms")
        if step < last:
            t1 = time_ms * (step + 1) / total
            body.append(f"step:{step + 1}/{total} train_time:{t1:.0f}ms step_avg:{t1 / (step + 1):.2f}ms")
    tail = ["peak memory allocated: 30000 MiB reserved: 44000 MiB"] if finish else []
    return "\n".join(head + body + tail) + "\n"


def write_set(d: Path, losses, times_s=None, prefix="run"):
    d.mkdir(parents=True, exist_ok=True)
    times_s = times_s or [131.2] * len(losses)
    paths = []
    for i, (lo, t) in enumerate(zip(losses, times_s)):
        p = d / f"{prefix}{i:02d}.txt"
        p.write_text(make_log(lo, t * 1000))
        paths.append(p)
    return paths


def cli(capsys, *argv):
    code = rc.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


# ---------------------------------------------------------------------------------------------- parsing

def test_parse_upstream_run1_exact():
    r = rc.parse_log(RUN1)
    assert r.loss == 3.2757
    assert r.time_ms == 131157
    assert r.time_s == pytest.approx(131.157)
    assert r.step_avg == 60.72
    assert r.steps == 2160
    assert (r.peak_alloc, r.peak_reserved) == (29816, 44176)
    assert r.n_procs == 8
    assert r.gpu_name == "NVIDIA H100 80GB HBM3"
    assert r.hardware == "8x NVIDIA H100 80GB HBM3"
    assert r.torch == "2.10.0.dev20251210+cu126"
    assert r.cuda == "12.6"
    assert r.triton == "3.6.0"
    assert r.python.startswith("3.12.7")
    assert r.kernels is None and r.orthogonalizer is None
    assert len(r.val) == 10 and r.val[0][:3] == (0, 2160, 10.8258)
    assert len(r.train) == 2160
    assert r.script.startswith("# (script source elided")


def test_parse_upstream_run2_exact():
    r = rc.parse_log(RUN2)
    assert (r.loss, r.time_ms, r.step_avg, r.steps) == (3.2776, 131155, 60.72, 2160)
    assert (r.peak_alloc, r.peak_reserved) == (30540, 44496)
    assert r.hardware == "8x NVIDIA H100 80GB HBM3"
    assert (r.torch, r.triton) == ("2.10.0.dev20251210+cu126", "3.6.0")
    assert r.val[1][:4] == (250, 2160, 4.3032, 8385)


def test_parse_warm_up_line_with_compiled_graph_count():
    text = make_log().replace("(process start to timed loop: 101.5s)",
                              "(process start to timed loop: 101.5s; 19 compiled graphs)")
    r = rc.parse_text(text, Path("new.txt"))
    assert (r.warmup_s, r.startup_s) == (93.2, 101.5)


def test_parse_our_cpu_format():
    r = rc.parse_log(CPU)
    assert r.device == "cpu" and r.n_procs == 2
    assert r.kernels in ("reference", "none") and r.orthogonalizer == "polar"
    assert r.config["future_key"] == "whatever"  # unknown keys tolerated
    assert r.smi_available is False and r.gpu_name is None
    assert r.hardware == "CPU (2 procs)"
    assert (r.warmup_s, r.startup_s) == (12.3, 15.8)
    assert r.steps == 30 and r.loss == 6.8358 and r.time_ms == 14731
    assert r.script.startswith('"""Tiny stand-in') and "=" * 100 not in r.script


def test_run_config_overrides_nvidia_smi():
    # a 1-GPU run on an 8-GPU box: the Run config's world_size and gpu_name win over the nvidia-smi table
    smi = RUN1.read_text().split("=" * 100)[1]
    smi_lines = [ln for ln in smi.splitlines() if not ln.startswith("Running")]
    text = make_log(config='world_size=1 device=cuda attn_backend=varlen gpu_name="NVIDIA H100 80GB HBM3" x=1')
    text = text.replace("nvidia-smi: not available", "\n".join(smi_lines))
    r = rc.parse_text(text, "one.txt")
    assert len(r.smi_gpus) == 8
    assert r.hardware == "1x NVIDIA H100 80GB HBM3"
    assert r.kernels == "varlen" and r.orthogonalizer is None


def test_run_config_bad_quotes_tolerated():
    assert rc.parse_run_config('a=1 gpu_name="unterminated b=2') == {"a": "1", "gpu_name": '"unterminated', "b": "2"}


# ---------------------------------------------------------------------------------------------- statistics

def test_pvalue_ten_runs_matches_scipy(tmp_path, capsys):
    expected = stats.ttest_1samp(PR168_LOSSES, 3.28, alternative="less").pvalue
    assert expected == pytest.approx(0.002439, abs=5e-6)
    assert rc.p_value_below(PR168_LOSSES, 3.28) == pytest.approx(expected, rel=1e-12)
    write_set(tmp_path / "pr168", PR168_LOSSES, PR168_TIMES)
    code, out, _ = cli(capsys, "summary", tmp_path / "pr168", "--target", "3.28")
    assert code == 0
    assert "10 finished run(s), 0 skipped" in out
    assert f"mean val_loss < 3.28): {expected:.4g}" in out
    assert "0.002439" in out
    assert "3.2777" in out and "131.2106" in out  # means of the upstream record's published runs
    assert "0.0660" in out  # std of times, ddof=1


def _sample_with(mean, std, n):
    z = np.arange(n, dtype=float)
    z = (z - z.mean()) / z.std(ddof=1)
    return mean + std * z


def test_runs_needed_consistent_with_ttest():
    m, s = float(np.mean(PR168_LOSSES)), float(np.std(PR168_LOSSES, ddof=1))
    k = rc.runs_needed(m, s, 3.28)
    assert k is not None and 2 <= k <= 10  # 10 runs already give p = 0.0024
    assert stats.ttest_1samp(_sample_with(m, s, k), 3.28, alternative="less").pvalue < 0.01
    if k > 2:
        assert stats.ttest_1samp(_sample_with(m, s, k - 1), 3.28, alternative="less").pvalue >= 0.01
    # baseline 12-10 re-timing: 4 runs, p = 0.063, needs more
    bm, bs = float(np.mean(BASE_LOSSES)), float(np.std(BASE_LOSSES, ddof=1))
    kb = rc.runs_needed(bm, bs, 3.28)
    assert kb > 4
    assert stats.ttest_1samp(_sample_with(bm, bs, kb), 3.28, alternative="less").pvalue < 0.01
    assert stats.ttest_1samp(_sample_with(bm, bs, kb - 1), 3.28, alternative="less").pvalue >= 0.01
    assert rc.runs_needed(3.2800, 0.002, 3.28) is None
    assert rc.runs_needed(3.2850, 0.002, 3.28) is None


def test_runs_needed_reported_and_na(tmp_path, capsys):
    write_set(tmp_path / "bad", [3.2810, 3.2790, 3.2830])
    code, out, _ = cli(capsys, "summary", tmp_path / "bad")
    assert code == 0
    assert "runs needed for p < 0.01 at this mean/std: n/a (mean >= target)" in out
    write_set(tmp_path / "base", BASE_LOSSES)
    code, out, _ = cli(capsys, "summary", tmp_path / "base")
    k = rc.runs_needed(float(np.mean(BASE_LOSSES)), float(np.std(BASE_LOSSES, ddof=1)), 3.28)
    assert f"runs needed for p < 0.01 at this mean/std: {k}" in out
    assert "0.06323" in out  # the upstream baseline's published p


def test_welch_matches_scipy():
    w = rc.welch(PR168_TIMES, BASE_TIMES)
    ref = stats.ttest_ind(PR168_TIMES, BASE_TIMES, equal_var=False)
    assert w["diff"] == pytest.approx(np.mean(PR168_TIMES) - np.mean(BASE_TIMES))
    assert w["diff"] == pytest.approx(131.2106 - 132.72175, abs=1e-4)
    assert w["p"] == pytest.approx(ref.pvalue, rel=1e-10)
    lo, hi = w["ci"]
    assert lo < w["diff"] < hi < 0
    # the CI endpoints are exactly where the two-sided Welch test reaches p = 0.05
    for shift in (lo, hi):
        p_edge = stats.ttest_ind(np.array(PR168_TIMES) - shift, BASE_TIMES, equal_var=False).pvalue
        assert p_edge == pytest.approx(0.05, abs=1e-9)
    if hasattr(ref, "df"):
        assert w["df"] == pytest.approx(float(ref.df), rel=1e-10)


def test_compare_cli_verdict(tmp_path, capsys):
    new = write_set(tmp_path / "new", PR168_LOSSES, PR168_TIMES, prefix="new")  # a run id names one run
    write_set(tmp_path / "prior", BASE_LOSSES, BASE_TIMES, prefix="prior")
    code, out, _ = cli(capsys, "compare", tmp_path / "new", tmp_path / "prior")
    assert code == 0
    ref = stats.ttest_ind(PR168_TIMES, BASE_TIMES, equal_var=False).pvalue
    assert "time diff (new - prior): -1.5112 s" in out
    assert f"p={rc.fp(ref)}" in out
    assert "verdict: NEW is faster by 1.511 s" in out and ", significant" in out
    assert "loss target 3.28 held (p=0.002439 < 0.01)" in out
    # same comparison with NEW as a comma list of logs
    code, out2, _ = cli(capsys, "compare", ",".join(map(str, new)), tmp_path / "prior")
    assert code == 0 and "verdict: NEW is faster by 1.511 s" in out2
    # reversed: slower and target not held
    code, out3, _ = cli(capsys, "compare", tmp_path / "prior", tmp_path / "new")
    assert "NEW is slower" in out3 and "loss target 3.28 NOT held" in out3


# ---------------------------------------------------------------------------------------------- malformed logs

def test_malformed_logs_are_named_and_skipped(tmp_path, capsys):
    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a_good.txt").write_text(make_log(3.2770))
    (d / "b_empty.txt").write_text("")
    (d / "c_noval.txt").write_text(make_log().split("step:0/")[0] + "step:1/40 train_time:10ms step_avg:10.00ms\n")
    (d / "d_unfinished.txt").write_text(make_log(finish=False))
    (d / "e_binary.txt").write_bytes(bytes(range(256)) * 8)
    (d / "f_nan.txt").write_text(make_log(3.27).replace("val_loss:3.2700", "val_loss:nan"))
    (d / "g_latin1.txt").write_bytes("caf\xe9 step".encode("latin-1"))
    code, out, _ = cli(capsys, "summary", d)
    assert code == 0
    assert "1 finished run(s), 6 skipped" in out
    skipped = {ln.split(": ", 1)[0].split("/")[-1]: ln for ln in out.splitlines() if ln.startswith("SKIPPED")}
    assert "empty file" in skipped["b_empty.txt"]
    assert "no validation line" in skipped["c_noval.txt"]
    assert "unfinished run: last validation at step 30/40" in skipped["d_unfinished.txt"]
    assert "binary" in skipped["e_binary.txt"]
    assert "diverged" in skipped["f_nan.txt"]
    assert "not UTF-8" in skipped["g_latin1.txt"]
    assert "| a_good.txt" in out
    # nothing usable at all -> error exit, files still named
    code, out, err = cli(capsys, "summary", d / "b_empty.txt", d / "e_binary.txt")
    assert code == 2 and "b_empty.txt" in out and "e_binary.txt" in out and "no finished runs" in err
    assert len(err.splitlines()) == 1


# ---------------------------------------------------------------------------------------------- diff

def test_diff_shows_exactly_the_changed_line(tmp_path, capsys):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text(make_log(script=SCRIPT))
    b.write_text(make_log(script=SCRIPT.replace("LR = 0.05", "LR = 0.07"), loss=3.2790))
    code, out, _ = cli(capsys, "diff", b, a)
    assert code == 0
    changed = [ln for ln in out.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    assert changed == ["-LR = 0.05", "+LR = 0.07"]
    assert "---" in out and "PRIOR" in out and "+++" in out and "NEW" in out
    # a .py file against a log holding the same code: no differences
    py = tmp_path / "train_gpt.py"
    py.write_text(SCRIPT)
    code, out, _ = cli(capsys, "diff", py, a)
    assert code == 0 and "no code differences" in out
    # a folder holding exactly one log means that log
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "x.txt").write_text(b.read_text())
    code, out, _ = cli(capsys, "diff", tmp_path / "dir", py)
    assert code == 0 and "+LR = 0.07" in out
    code, out, err = cli(capsys, "diff", tmp_path / "nope.txt", py)
    assert code == 2 and "nope.txt" in err and len(err.splitlines()) == 1


def test_diff_upstream_logs_identical_scripts(capsys):
    code, out, _ = cli(capsys, "diff", RUN2, RUN1)
    assert code == 0 and "no code differences" in out


# ---------------------------------------------------------------------------------------------- plot

def _assert_png(path: Path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.image as mpimg
    img = mpimg.imread(str(path))
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 300


def test_plot_upstream_and_cpu(tmp_path, capsys):
    out = tmp_path / "p.png"
    code, stdout, _ = cli(capsys, "plot", RUN1, RUN2, "-o", out)
    assert code == 0 and "wrote" in stdout
    _assert_png(out)
    (tmp_path / "sub").mkdir()
    out2 = tmp_path / "sub" / "single.png"
    code, _, _ = cli(capsys, "plot", FIX / "local", "-o", out2)
    assert code == 0
    _assert_png(out2)
    code, _, err = cli(capsys, "plot", tmp_path / "missing", "-o", tmp_path / "none.png")
    assert code == 2 and not (tmp_path / "none.png").exists() and len(err.splitlines()) == 1


# ---------------------------------------------------------------------------------------------- new / run

def test_new_creates_record(tmp_path, capsys):
    recs = tmp_path / "records"
    recs.mkdir()
    (recs / "README.md").write_text("# Records\n\n<!-- rows appended by compare.py new -->\n\n"
                                    f"{rc.TABLE_HEADER}\n{rc.TABLE_RULE}\n\n## Usage\n\ntext\n")
    bad = tmp_path / "broken.txt"
    bad.write_text("")
    code, out, _ = cli(capsys, "new", "upstream-1211", RUN1, RUN2, bad, "--out", recs, "--date", "2025-12-11",
                       "--description", "NorMuon speed-ups | Wo pre-multiply")
    assert code == 0
    folder = recs / "2025-12-11_upstream-1211"
    assert (folder / RUN1.name).read_bytes() == RUN1.read_bytes()
    assert (folder / RUN2.name).exists() and not (folder / "broken.txt").exists()
    assert "SKIPPED" in out and "broken.txt" in out
    _assert_png(folder / "plot.png")
    readme = (folder / "README.md").read_text()
    assert "NorMuon speed-ups | Wo pre-multiply" in readme
    assert "![validation loss and step time](plot.png)" in readme
    assert "| 2025-12-11_record_run1.txt |   3.2757 | 131.157 |" in readme
    assert "## What changed" in readme
    top = (recs / "README.md").read_text().splitlines()
    h = top.index(rc.TABLE_HEADER)
    row = top[h + 2]
    assert row.startswith("| 2025-12-11 | 131.156 s | 3.2767 | 2 | 8x NVIDIA H100 80GB HBM3 |")
    assert "NorMuon speed-ups \\| Wo pre-multiply" in row
    assert "[2025-12-11_upstream-1211](2025-12-11_upstream-1211/README.md)" in row
    assert top[h + 3] == "" and "## Usage" in top  # rest of the file untouched
    # refuses to overwrite, --force replaces (no duplicate row)
    code, _, err = cli(capsys, "new", "upstream-1211", RUN1, "--out", recs, "--date", "2025-12-11")
    assert code == 2 and "already exists" in err and "--force" in err
    code, _, _ = cli(capsys, "new", "upstream-1211", RUN1, "--out", recs, "--date", "2025-12-11", "--force",
                     "--hardware", "8xH100 SXM")
    text = (recs / "README.md").read_text()
    assert text.count("](2025-12-11_upstream-1211/README.md)") == 1
    assert "| 1 | 8xH100 SXM | TODO: describe the change |" in text


def test_new_creates_records_readme_and_refuses_empty(tmp_path, capsys):
    recs = tmp_path / "r"
    code, _, _ = cli(capsys, "new", "up", RUN1, "--out", recs, "--date", "2030-01-02")
    assert code == 0
    text = (recs / "README.md").read_text()
    assert rc.TABLE_HEADER in text and "| 2030-01-02 | 131.157 s | 3.2757 | 1 | 8x NVIDIA H100 80GB HBM3 |" in text
    empty = tmp_path / "e.txt"
    empty.write_text("")
    for argv, msg in ((["nothing", empty], "no finished runs"), (["../evil", CPU], "record name"),
                      (["ok", RUN1, "--date", "2030-13-01"], "YYYY-MM-DD")):
        code, _, err = cli(capsys, "new", *argv, "--out", recs)
        assert code == 2 and msg in err and len(err.splitlines()) == 1
    assert sorted(p.name for p in recs.iterdir()) == ["2030-01-02_up", "README.md"]


def test_split_run_argv():
    assert rc.split_run_argv(["exp", "3", "--data-path", "data/proxy", "--smoke"]) == (
        ["exp", "3"], ["--data-path", "data/proxy", "--smoke"])
    assert rc.split_run_argv(["--nproc", "2", "--force", "exp", "3", "--", "--x", "1"]) == (
        ["--nproc", "2", "--force", "exp", "3"], ["--x", "1"])
    assert rc.split_run_argv(["exp", "2"]) == (["exp", "2"], [])
    # the tool's options anywhere before `--`, also after NAME N and between trainer arguments
    assert rc.split_run_argv(["exp", "2", "--smoke", "--nproc", "2", "--data-path", "d", "--not-a-record",
                              "--description=a b", "--", "--nproc", "9"]) == (
        ["--nproc", "2", "--not-a-record", "--description=a b", "exp", "2"], ["--smoke", "--data-path", "d",
                                                                            "--nproc", "9"])
    for argv, msg in ((["--bogus", "exp", "3"], "NAME and N come before"), (["exp", "3", "--nproc"], "needs a value")):
        with pytest.raises(rc.UsageError, match=msg):
            rc.split_run_argv(argv)


def test_run_options_are_not_trainer_flags():
    """split_run_argv takes the tool's options out of the trainer's arguments: no trainer flag may share a name."""
    src = (REPO / "train_gpt.py").read_text()
    body = src[src.index("class Hyperparameters"):src.index("def num_iterations")]
    trainer = {"--" + m.replace("_", "-") for m in re.findall(r"^    (\w+): ", body, flags=8)}
    assert {"--data-path", "--smoke", "--device", "--log-dir", "--seed"} <= trainer
    ours = {flag for flag, _ in rc.RUN_OPTS + rc.RECORD_OPTS}
    assert not ours & trainer


FAKE_LAUNCHER = textwrap.dedent('''\
    import json, os, pathlib, re, subprocess, sys, time, uuid
    args = sys.argv[1:]
    out = pathlib.Path("logs"); out.mkdir(exist_ok=True)
    calls = pathlib.Path("calls.jsonl")
    n = len(calls.read_text().splitlines()) if calls.exists() else 0
    with calls.open("a") as f:
        f.write(json.dumps(args) + "\\n")
    if "--fail" in args:
        print("boom"); sys.exit(3)
    if "--bad" in args:  # what the trainer's settings check does with bad input: one line, exit 2
        print("error: --bad: not a setting of train_gpt.py; see python3 train_gpt.py --help", file=sys.stderr)
        sys.exit(2)
    template = pathlib.Path(sys.argv[0]).with_name("template.txt").read_text()
    path = out / f"{uuid.uuid4()}.txt"
    if "--hang-from" in args and n + 1 >= int(args[args.index("--hang-from") + 1]):
        # an unfinished run: its log so far, a worker in a session of its own (as torchrun starts them), then waits
        path.write_text(template.split("step:1/")[0])
        print(f"logs/{path.name}", flush=True)
        worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True)
        pathlib.Path("pids").write_text(f"{os.getpid()} {worker.pid}")
        time.sleep(120)
    # every real log differs in its step lines (their times): the final validation's time is n ms later, and its
    # loss differs where the template has a 3.2770
    text = template.replace("val_loss:3.2770", f"val_loss:{3.2760 + n / 10000:.4f}")
    path.write_text(re.sub(r"(?m)^(step:(\\d+)/\\2 val_loss:\\S+ train_time:)(\\d+)",
                           lambda m: f"{m[1]}{int(m[3]) + n}", text))
    print(f"logs/{path.name}")
    print("step:0/40 val_loss:8.2770 ...")
''')


def test_run_with_fake_launcher(tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    fake = tmp_path / "fake_launcher.py"
    fake.write_text(FAKE_LAUNCHER)
    (tmp_path / "template.txt").write_text(make_log(3.2770, total=2160, val_every=250))
    recs = tmp_path / "records"
    code = rc.main(["run", "--launcher", f"{sys.executable} {fake}", "--nproc", "8", "--workdir", str(work),
                    "--out", str(recs), "--date", "2026-01-01", "--description", "fake runs",
                    "myexp", "3", "--seed", "7", "--val-loss-every", "250"])
    out = capsys.readouterr().out
    assert code == 0
    calls = [json.loads(x) for x in (work / "calls.jsonl").read_text().splitlines()]
    assert calls == [["--nproc_per_node=8", "train_gpt.py", "--seed", "7", "--val-loss-every", "250"]] * 3
    folder = recs / "2026-01-01_myexp"
    logs = sorted(folder.glob("*.txt"))
    assert len(logs) == 3
    losses = sorted(rc.parse_log(p).loss for p in logs)
    assert losses == [3.2760, 3.2761, 3.2762]
    assert "=== run 3/3 ===" in out
    readme = (folder / "README.md").read_text()
    assert (f"./run.sh record myexp 3 --nproc 8 --launcher '{sys.executable} {fake}' -- --seed 7 "
            "--val-loss-every 250") in readme
    assert "| 2026-01-01 |" in (recs / "README.md").read_text()
    # existing folder -> refused before launching anything
    code = rc.main(["run", "--launcher", f"{sys.executable} {fake}", "--nproc", "8", "--workdir", str(work),
                    "--out", str(recs), "--date", "2026-01-01", "myexp", "1"])
    assert code == 2 and "already exists" in capsys.readouterr().err
    assert len((work / "calls.jsonl").read_text().splitlines()) == 3
    # a failing launcher stops the series and records nothing
    code = rc.main(["run", "--launcher", f"{sys.executable} {fake}", "--nproc", "8", "--workdir", str(work),
                    "--out", str(recs), "--date", "2026-01-01", "failing", "2", "--fail"])
    err = capsys.readouterr().err
    assert code == 1 and "run 1/2 failed" in err and "status 3" in err
    assert not (recs / "2026-01-01_failing").exists()


def test_script_runs_from_command_line():
    res = run_group([sys.executable, str(REPO / "records" / "compare.py"), "summary", str(FIX)],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "2 finished run(s), 0 skipped" in res.stdout
    assert "| 2025-12-11_record_run1.txt |   3.2757 | 131.157 |       60.72 |  2160 |" in res.stdout
    res = run_group([sys.executable, str(REPO / "records" / "compare.py"), "--help"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert res.returncode == 0 and "summary" in res.stdout and "run" in res.stdout


def test_new_appends_to_the_real_records_readme(tmp_path, capsys):
    recs = tmp_path / "records"
    recs.mkdir()
    original = (REPO / "records" / "README.md").read_text()
    (recs / "README.md").write_text(original)
    for name, date in (("first", "2026-02-01"), ("second", "2026-02-02")):
        code, _, _ = cli(capsys, "new", name, RUN1, RUN2, "--out", recs, "--date", date)
        assert code == 0
    lines = (recs / "README.md").read_text().splitlines()
    h = lines.index(rc.TABLE_HEADER)
    assert lines[h + 1] == rc.TABLE_RULE
    orig_lines = original.splitlines()
    oh = orig_lines.index(rc.TABLE_HEADER)
    existing = next(i for i in range(oh + 2, len(orig_lines) + 1)
                    if i == len(orig_lines) or not orig_lines[i].startswith("|")) - (oh + 2)
    end = h + 2 + existing  # new rows go after the records already in the table, in order
    assert "[2026-02-01_first]" in lines[end] and "[2026-02-02_second]" in lines[end + 1]
    assert lines[end + 2] == ""
    # everything else in the file is unchanged
    assert [ln for ln in lines if "2026-02-0" not in ln] == original.splitlines()


def test_trainer_header_variants():
    # the trainer logs the source followed by a newline, so a blank line precedes the separator
    py_text = CPU.read_text().split("\n\n" + "=" * 100)[0] + "\n"
    r = rc.parse_log(CPU)
    assert r.script.rstrip("\n") + "\n" == py_text
    text = make_log().replace("Running Triton version 3.5.1", "Running Triton version not installed")
    r = rc.parse_text(text, "x.txt")
    assert r.triton == "not installed" and r.torch == "2.9.1+cu128" and r.cuda == "12.8"
    r = rc.parse_text(make_log(config='world_size=2 device=cpu gpu_name="cpu"'), "cpu.txt")
    assert r.gpu_name is None and r.hardware == "CPU (2 procs)"
    assert rc.trainer_arg(["--smoke", "--log-dir", "/tmp/x"], "--log-dir") == "/tmp/x"
    assert rc.trainer_arg(["--log-dir=out"], "--log-dir") == "out" and rc.trainer_arg(["--smoke"], "--log-dir") is None
    assert rc.trainer_arg(["--smoke", "--seed", "1"], "--smoke") == "" and rc.is_smoke(["--smoke", "--seed", "1"])
    assert not rc.is_smoke(["--smoke=0"]) and not rc.is_smoke([])


def test_diff_py_against_cpu_log(tmp_path, capsys):
    py = tmp_path / "train_gpt.py"
    py.write_text(CPU.read_text().split("=" * 100)[0].rstrip("\n") + "\n")
    code, out, _ = cli(capsys, "diff", CPU, py)
    assert code == 0 and "no code differences" in out


def test_real_cpu_smoke_log():
    """A real log of `compare.py run --nproc 2 smoke 1 --smoke --data-path data/proxy` on the CPU."""
    r = rc.parse_log(FIX / "local" / "real_cpu_smoke_2proc.txt")
    assert (r.steps, r.loss, r.time_ms, r.step_avg) == (33, 6.3731, 116281, 3523.67)
    assert r.hardware == "CPU (2 procs)" and r.kernels in ("reference", "none") and r.orthogonalizer == "polar"
    assert (r.peak_alloc, r.peak_reserved) == (1327, 1327)
    assert r.torch == "2.13.0+cpu" and r.triton == "3.9.0" and r.warmup_s == 14.8
    assert r.script.lstrip().startswith(("#", '"""', "import", "from")) and "def main" in r.script
    assert len(r.train) == 33 and [v[0] for v in r.val] == [0, 10, 20, 30, 33]


# ---------------------------------------------------------------------------------------------- user reports

REAL_CPU = FIX / "local" / "real_cpu_smoke_2proc.txt"


def _fake_setup(tmp_path, template_text, out=True):
    """A fake launcher writing template_text as each run's log; the options point `run` at it (and, with out,
    put the runs' folder under tmp_path/out)."""
    work = tmp_path / "work"
    work.mkdir()
    fake = tmp_path / "fake_launcher.py"
    fake.write_text(FAKE_LAUNCHER)
    (tmp_path / "template.txt").write_text(template_text)
    return work, ["--launcher", f"{sys.executable} {fake}", "--workdir", str(work), "--date", "2026-01-01"] + (
        ["--out", str(tmp_path / "out")] if out else [])


def _calls(work):
    f = work / "calls.jsonl"
    return [json.loads(x) for x in f.read_text().splitlines()] if f.exists() else []


def test_run_readme_form_on_a_cpu_machine(tmp_path, capsys, monkeypatch):
    """`./run.sh record NAME 2 --smoke --data-path data/proxy --device cpu` with no GPU: 2 processes, not an error;
    the tool's own options are taken after NAME N too, and the Reproduce line holds the whole command."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("SPEEDRUN_NPROC", raising=False)
    work, opts = _fake_setup(tmp_path, REAL_CPU.read_text())
    code = rc.main(["run", "smoke", "2", "--smoke", "--data-path", "data/my proxy", "--device", "cpu",
                    "--not-a-record", *opts])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert _calls(work) == [["--nproc_per_node=2", "train_gpt.py", "--smoke", "--data-path", "data/my proxy",
                             "--device", "cpu"]] * 2
    readme = (tmp_path / "out" / "2026-01-01_smoke" / "README.md").read_text()
    repro = readme.split("## Reproduce")[1].split("```")[1].strip()
    assert repro == ("./run.sh record smoke 2 --nproc 2 --launcher " + shlex.quote(opts[1])
                     + " --not-a-record -- --smoke --data-path 'data/my proxy' --device cpu")
    # the Reproduce line, parsed back, launches the same command
    ours, train = rc.split_run_argv(shlex.split(repro)[2:])
    assert train == ["--smoke", "--data-path", "data/my proxy", "--device", "cpu"]
    assert ours[ours.index("--nproc") + 1] == "2" and ours[-2:] == ["smoke", "2"]
    # --nproc after NAME N is ours (not passed to the trainer)
    code = rc.main(["run", "smoke3", "1", "--device", "cpu", "--nproc", "1", "--smoke", "--not-a-record", *opts])
    assert code == 0 and _calls(work)[-1] == ["--nproc_per_node=1", "train_gpt.py", "--device", "cpu", "--smoke"]


def test_run_without_gpu_says_where_nproc_goes(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("SPEEDRUN_NPROC", raising=False)
    work, opts = _fake_setup(tmp_path, make_log())
    code = rc.main(["run", "exp", "1", "--data-path", "data/fineweb10B", *opts])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1
    assert "no GPU visible" in err and "--nproc K after NAME N" in err and "before `--`" in err
    assert _calls(work) == []


def test_run_refuses_non_record_before_launching(tmp_path, capsys):
    work, opts = _fake_setup(tmp_path, make_log())
    for argv, why in ((["--nproc", "2"], "2 GPUs"), (["--nproc", "8", "--smoke"], "smoke preset"),
                      (["--nproc", "8", "--data-path", "data/proxy"], "not FineWeb (data/proxy)"),
                      (["--nproc", "8", "--device", "cpu"], "CPU")):
        code = rc.main(["run", "exp", "1", *argv, *opts])
        err = capsys.readouterr().err
        assert code == 2 and why in err and "--not-a-record" in err and len(err.splitlines()) == 1
    assert _calls(work) == [] and not (tmp_path / "out").exists()
    # the logs can still show a non-record (here: 40 steps); nothing is filed and the logs are named
    code = rc.main(["run", "exp", "1", "--nproc", "8", *opts])
    err = capsys.readouterr().err
    assert code == 2 and "not a record (40 steps)" in err and ".txt" in err and len(_calls(work)) == 1
    assert not (tmp_path / "out" / "2026-01-01_exp").exists()


def test_record_problems_from_logs():
    assert rc.run_problems([rc.parse_log(RUN1), rc.parse_log(RUN2)]) == []  # upstream: 2160 steps, 8-GPU table
    assert rc.run_problems([rc.parse_log(REAL_CPU)]) == ["smoke preset", "CPU", "33 steps", "not FineWeb (data/proxy)"]
    one = make_log(total=2160, val_every=500, config='world_size=1 device=cuda data_path=data/proxy train_epochs=2')
    assert rc.run_problems([rc.parse_text(one, "a.txt")]) == ["1 GPU", "not FineWeb (data/proxy)",
                                                              "2 epochs over the data"]
    full = make_log(total=2160, val_every=500, config="world_size=8 device=cuda data_path=data/fineweb10B")
    assert rc.run_problems([rc.parse_text(full, "b.txt")]) == []
    smoke_flag = make_log(total=2160, val_every=500, config="world_size=8 device=cuda smoke=1")  # the Run config says
    assert rc.run_problems([rc.parse_text(smoke_flag, "s.txt")]) == ["smoke preset"]
    bare = make_log(total=2160, val_every=500, config="x=1")  # no world size, no nvidia-smi table
    assert rc.run_problems([rc.parse_text(bare, "c.txt")]) == ["GPU count unknown"]
    # the moved proxy runs would be refused as records
    for log in (REPO / "bench" / "results" / "proxy_runs").glob("*/*.txt"):
        problems = rc.run_problems([rc.parse_log(log)])
        assert "96 steps" in problems and "not FineWeb (data/proxy)" in problems


def test_new_refuses_smoke_run_or_labels_it(tmp_path, capsys):
    recs = tmp_path / "records"
    recs.mkdir()
    (recs / "README.md").write_text(f"# Records\n\n{rc.TABLE_HEADER}\n{rc.TABLE_RULE}\n")
    before = (recs / "README.md").read_text()
    code, _, err = cli(capsys, "new", "smoke", REAL_CPU, "--out", recs, "--date", "2026-01-02")
    assert code == 2 and len(err.splitlines()) == 1
    assert "not a record (smoke preset, CPU, 33 steps, not FineWeb (data/proxy))" in err and "--not-a-record" in err
    assert (recs / "README.md").read_text() == before and sorted(os.listdir(recs)) == ["README.md"]
    assert "logs/not_records/" in err
    code, out, err = cli(capsys, "new", "smoke", REAL_CPU, "--out", tmp_path / "elsewhere", "--date", "2026-01-02",
                         "--not-a-record", "--description", "CPU check")
    assert code == 0, err
    assert (recs / "README.md").read_text() == before and sorted(os.listdir(recs)) == ["README.md"]
    readme = (tmp_path / "elsewhere" / "2026-01-02_smoke" / "README.md").read_text()
    assert "**Not a record**: smoke preset, CPU, 33 steps, not FineWeb (data/proxy)." in readme
    assert "CPU check" in readme
    assert "record check: not a record (smoke preset, CPU, 33 steps" in readme


def test_new_leaves_nothing_half_written(tmp_path, capsys, monkeypatch):
    recs = tmp_path / "records"
    code, _, _ = cli(capsys, "new", "rec", RUN1, "--out", recs, "--date", "2026-01-03")
    assert code == 0
    folder = recs / "2026-01-03_rec"
    snapshot = {p.name: p.read_bytes() for p in folder.iterdir()}
    readme = (recs / "README.md").read_text()

    def broken(*a, **k):
        raise RuntimeError("plot failed")
    monkeypatch.setattr(rc, "make_plot", broken)
    for argv in (["other", RUN1], ["rec", RUN1, RUN2, "--force"]):
        with pytest.raises(RuntimeError):
            rc.main(["new", *map(str, argv), "--out", str(recs), "--date", "2026-01-03"])
        assert sorted(os.listdir(recs)) == ["2026-01-03_rec", "README.md"]  # no temp folders, no new record
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == snapshot
        assert (recs / "README.md").read_text() == readme
    # a failure while writing the row restores the replaced folder too
    monkeypatch.undo()
    monkeypatch.setattr(rc, "append_record_row", broken)
    with pytest.raises(RuntimeError):
        rc.main(["new", "rec", str(RUN2), "--force", "--out", str(recs), "--date", "2026-01-03"])
    assert sorted(os.listdir(recs)) == ["2026-01-03_rec", "README.md"]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == snapshot


def test_plot_needs_output_and_never_writes_to_cwd(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = cli(capsys, "plot", RUN1)
    assert code == 2 and "-o/--output" in err and len(err.splitlines()) == 1
    assert os.listdir(tmp_path) == []
    res = run_group([sys.executable, str(REPO / "records" / "compare.py"), "plot", "-h"],
                         capture_output=True, text=True, timeout=60)
    assert "required" in res.stdout


def test_plot_final_stretch_separates_one_second(tmp_path):
    # two sets whose runs differ by 1.0 s in training time (131.2 vs 132.2 s) and 0.002 in loss
    a = rc.load_set([str(p) for p in write_set(tmp_path / "a", [3.2770, 3.2772], [131.2, 131.2])])
    b = rc.load_set([str(p) for p in write_set(tmp_path / "b", [3.2790, 3.2792], [132.2, 132.2])])
    fig = rc.plot_figure([a, b])
    zoom = [ax for ax in fig.axes if "final stretch" in ax.get_title()]
    assert len(zoom) == 1
    ax = zoom[0]
    assert ax.get_xlabel() == "training time (s)"
    x0, x1 = ax.get_xlim()
    y0, y1 = ax.get_ylim()
    assert 0.8 * 131.2 <= x0 < 131.2 and 132.2 < x1 <= 1.05 * 132.2  # the last ~15% of the time only
    assert (132.2 - 131.2) / (x1 - x0) > 0.04  # 1 s is more than 4% of the panel's width
    assert y0 <= 3.2770 and 3.2792 <= y1 < 3.6  # the early losses (up to 8.3) are off the panel
    main = [ax for ax in fig.axes if ax.get_title() == "validation loss vs training time"][0]
    assert main.get_xlim()[0] < 10  # the main panel spans the whole run
    out = rc.make_plot([a, b], tmp_path / "z.png")
    _assert_png(out)


def test_diff_folder_with_several_logs_asks_for_a_file(tmp_path, capsys):
    d = tmp_path / "rec"
    write_set(d, [3.2770, 3.2780])
    code, out, err = cli(capsys, "diff", d, RUN1)
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "holds 2 logs (run00.txt, run01.txt)" in err and "give the one to diff as a file" in err
    code, _, err = cli(capsys, "diff", tmp_path, RUN1)  # no logs at all
    assert code == 2 and "holds no *.txt log" in err


def test_records_folder_holds_only_records():
    """Every folder in records/ is a record: its logs meet the record conditions and it has a row in the table."""
    readme = (REPO / "records" / "README.md").read_text()
    lines = readme.splitlines()
    h = lines.index(rc.TABLE_HEADER)
    assert lines[h + 1] == rc.TABLE_RULE
    assert "<!-- Rows are appended by" in readme
    for folder in sorted(p for p in (REPO / "records").iterdir() if p.is_dir() and p.name != "__pycache__"):
        runs, _ = rc.load_runs([str(folder)])
        assert runs and rc.run_problems(runs) == [], folder.name
        assert f"]({folder.name}/README.md)" in readme, folder.name


# ---------------------------------------------------------------------------------------------- non-records, plot files

def _repo_at(tmp_path, monkeypatch):
    """Point the tool at tmp_path/repo (its defaults: repo/records, repo/logs/not_records) holding a copy of the
    real records/README.md. Returns (repo, the README's bytes)."""
    repo = tmp_path / "repo"
    (repo / "records").mkdir(parents=True)
    before = (REPO / "records" / "README.md").read_bytes()
    (repo / "records" / "README.md").write_bytes(before)
    monkeypatch.setattr(rc, "REPO_ROOT", repo)
    return repo, before


def test_new_not_a_record_defaults_to_logs_not_records(tmp_path, capsys, monkeypatch):
    real_readme = (REPO / "records" / "README.md").read_bytes()
    assert rc.default_out(True) == REPO / "logs" / "not_records" and rc.default_out(False) == REPO / "records"
    assert "/logs/" in (REPO / ".gitignore").read_text().splitlines()  # so non-records are not committed by accident
    assert rc.build_parser().parse_args(["new", "x", str(CPU)]).out is None  # None: default_out decides
    repo, before = _repo_at(tmp_path, monkeypatch)
    code, out, err = cli(capsys, "new", "smoke", REAL_CPU, "--not-a-record", "--date", "2026-01-02")
    assert code == 0, err
    folder = repo / "logs" / "not_records" / "2026-01-02_smoke"
    assert sorted(os.listdir(folder)) == ["README.md", "plot.png", REAL_CPU.name]
    _assert_png(folder / "plot.png")
    assert "**Not a record**: smoke preset, CPU, 33 steps" in (folder / "README.md").read_text()
    assert (repo / "records" / "README.md").read_bytes() == before and os.listdir(repo / "records") == ["README.md"]
    last = out.splitlines()[-1]
    assert str(folder) in last and "not a record" in last and "no row added" in last
    assert (REPO / "records" / "README.md").read_bytes() == real_readme


def test_new_not_a_record_out_places_it_without_a_table(tmp_path, capsys, monkeypatch):
    repo, before = _repo_at(tmp_path, monkeypatch)
    mine = tmp_path / "mine"  # created when missing
    code, out, err = cli(capsys, "new", "up", RUN1, RUN2, "--not-a-record", "--out", mine, "--date", "2026-01-03")
    assert code == 0, err
    assert os.listdir(mine) == ["2026-01-03_up"]  # no README.md table made there either
    readme = (mine / "2026-01-03_up" / "README.md").read_text()
    assert "**Not a record**: marked --not-a-record." in readme  # runs that meet the conditions, labelled by hand
    assert str(mine / "2026-01-03_up") in out.splitlines()[-1]
    assert not (repo / "logs").exists() and (repo / "records" / "README.md").read_bytes() == before
    code, _, err = cli(capsys, "new", "up", RUN1, "--not-a-record", "--out", mine, "--date", "2026-01-03")
    assert code == 2 and "already exists" in err
    code, _, _ = cli(capsys, "new", "up", RUN1, "--not-a-record", "--out", mine, "--date", "2026-01-03", "--force")
    assert code == 0 and sorted(os.listdir(mine / "2026-01-03_up")) == sorted(["README.md", RUN1.name, "plot.png"])


def test_not_a_record_refused_in_the_records_folder(tmp_path, capsys, monkeypatch):
    repo, before = _repo_at(tmp_path, monkeypatch)
    records = repo / "records"
    (tmp_path / "link").symlink_to(records)
    monkeypatch.chdir(repo)
    for out in (records, "records", "logs/../records/", records / "sub", tmp_path / "link"):
        code, stdout, err = cli(capsys, "new", "smoke", REAL_CPU, "--not-a-record", "--out", out, "--date", "2026-01-04")
        assert code == 2 and stdout == "" and len(err.splitlines()) == 1, out
        assert "stay out of" in err and "--out" in err
    assert os.listdir(records) == ["README.md"] and (records / "README.md").read_bytes() == before
    assert not (repo / "logs").exists()
    work, opts = _fake_setup(tmp_path, REAL_CPU.read_text(), out=False)
    code = rc.main(["run", "smoke", "1", "--nproc", "2", "--smoke", "--not-a-record", "--out", str(records), *opts])
    err = capsys.readouterr().err
    assert code == 2 and "stay out of" in err and _calls(work) == []  # refused before launching anything
    assert os.listdir(records) == ["README.md"]


def test_record_goes_to_records_with_its_row_by_default(tmp_path, capsys, monkeypatch):
    repo, before = _repo_at(tmp_path, monkeypatch)
    code, out, err = cli(capsys, "new", "up", RUN1, RUN2, "--date", "2026-01-05")
    assert code == 0, err
    assert (repo / "records" / "2026-01-05_up" / "plot.png").is_file() and not (repo / "logs").exists()
    text = (repo / "records" / "README.md").read_text()
    assert "| 2026-01-05 | 131.156 s | 3.2767 | 2 |" in text and "[2026-01-05_up](2026-01-05_up/README.md)" in text
    assert "row added to" in out.splitlines()[-1]


def test_run_not_a_record_files_outside_records(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("SPEEDRUN_NPROC", raising=False)
    repo, before = _repo_at(tmp_path, monkeypatch)
    work, opts = _fake_setup(tmp_path, REAL_CPU.read_text(), out=False)
    code = rc.main(["run", "smoke", "2", "--smoke", "--device", "cpu", "--not-a-record", *opts])
    out, err = capsys.readouterr()
    assert code == 0, err
    folder = repo / "logs" / "not_records" / "2026-01-01_smoke"
    assert len(list(folder.glob("*.txt"))) == 2 and (folder / "plot.png").is_file()
    assert "**Not a record**: smoke preset, CPU, 33 steps" in (folder / "README.md").read_text()
    assert (repo / "records" / "README.md").read_bytes() == before and os.listdir(repo / "records") == ["README.md"]
    assert str(folder) in out.splitlines()[-1] and "no row added" in out.splitlines()[-1]


def test_plot_refuses_a_missing_folder(tmp_path, capsys):
    code, out, err = cli(capsys, "plot", CPU, "-o", tmp_path / "missing" / "dir" / "x.png")
    assert code == 2 and out == "" and len(err.splitlines()) == 1
    assert "does not exist" in err and "create it or pick another path" in err
    assert os.listdir(tmp_path) == []
    (tmp_path / "file").write_text("")
    code, _, err = cli(capsys, "plot", CPU, "-o", tmp_path / "file" / "x.png")
    assert code == 2 and "is not a folder" in err and os.listdir(tmp_path) == ["file"]


def test_plot_suffix_picks_the_format(tmp_path, capsys):
    code, _, err = cli(capsys, "plot", CPU, "-o", tmp_path / "x.pdf")
    assert code == 0, err
    assert (tmp_path / "x.pdf").read_bytes().startswith(b"%PDF")
    code, _, err = cli(capsys, "plot", CPU, "-o", tmp_path / "x.svg")
    data = (tmp_path / "x.svg").read_bytes()
    assert code == 0 and data.startswith(b"<?xml") and b"<svg" in data[:1000]
    for bad in ("x.txt", "x", "x.png.bak"):
        code, out, err = cli(capsys, "plot", CPU, "-o", tmp_path / bad)
        assert code == 2 and out == "" and len(err.splitlines()) == 1, bad
        assert ".png" in err and ".pdf" in err and ".svg" in err
    assert sorted(os.listdir(tmp_path)) == ["x.pdf", "x.svg"]


def test_plot_writer_failing_halfway_leaves_no_file(tmp_path, capsys, monkeypatch):
    class HalfWriter:
        def savefig(self, path):
            Path(path).write_bytes(b"partial")
            raise RuntimeError("'xelatex' not found;\ninstall it")
    monkeypatch.setattr(rc, "plot_figure", lambda sets, title=None: HalfWriter())
    code, _, err = cli(capsys, "plot", CPU, "-o", tmp_path / "x.pgf")
    assert code == 2 and len(err.splitlines()) == 1 and "xelatex" in err
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------------------------- each run counts once

def _skipped(out):
    return [ln for ln in out.splitlines() if ln.startswith("SKIPPED")]


def _n(out):
    """The n of the val_loss statistics row of a summary."""
    return int(re.search(r"^\| val_loss \|\s+(\d+) \|", out, flags=re.M).group(1))


def test_summary_counts_a_log_given_twice_once(tmp_path, capsys):
    a, b = write_set(tmp_path / "d", [3.2770, 3.2780])
    code, out, err = cli(capsys, "summary", a, b, a)
    assert code == 0, err
    assert "2 finished run(s), 1 skipped" in out and _n(out) == 2
    assert _skipped(out) == [f"SKIPPED {a}: the same file as {a} (given twice)"]
    assert rc.p_value_below([3.2770, 3.2780]) == pytest.approx(float(re.search(r"< 3.28\): (\S+)", out).group(1)),
                                                               rel=1e-3)


def test_a_byte_identical_copy_under_another_name_counts_once(tmp_path, capsys):
    a, b = write_set(tmp_path / "logs", [3.2770, 3.2780])
    copy = tmp_path / "logs" / "z_copy.txt"
    copy.write_bytes(a.read_bytes())
    code, out, err = cli(capsys, "summary", tmp_path / "logs")
    assert code == 0, err
    assert "2 finished run(s), 1 skipped" in out and _n(out) == 2
    assert _skipped(out) == [f"SKIPPED {copy}: the same run as {a} (identical content)"]
    # `new` files the run once, and its row says 2 runs
    code, out, err = cli(capsys, "new", "dup", tmp_path / "logs", "--out", tmp_path / "recs", "--date", "2026-03-01",
                         "--not-a-record")
    assert code == 0, err
    assert _skipped(out) == [f"SKIPPED {copy}: the same run as {a} (identical content)"]
    folder = tmp_path / "recs" / "2026-03-01_dup"
    assert sorted(p.name for p in folder.glob("*.txt")) == [a.name, b.name]
    assert "Runs: 2 ·" in (folder / "README.md").read_text()


def test_a_folder_and_a_file_in_it_count_the_file_once(tmp_path, capsys):
    logs = write_set(tmp_path / "d", [3.2770, 3.2780, 3.2790])
    link = tmp_path / "link.txt"
    link.symlink_to(logs[1])  # another name of the same file
    code, out, err = cli(capsys, "summary", tmp_path / "d", logs[0], link)
    assert code == 0, err
    assert "3 finished run(s), 2 skipped" in out and _n(out) == 3
    assert _skipped(out) == [f"SKIPPED {logs[0]}: the same file as {logs[0]} (given twice)",
                             f"SKIPPED {link}: the same file as {logs[1]} (given twice)"]
    # a comma list naming one file twice
    code, out, _ = cli(capsys, "summary", f"{logs[2]},{logs[2]}")
    assert code == 0 and "1 finished run(s), 1 skipped" in out and len(_skipped(out)) == 1


def test_compare_refuses_a_run_in_both_new_and_prior(tmp_path, capsys):
    new = write_set(tmp_path / "new", [3.2770, 3.2775], prefix="new")
    prior = write_set(tmp_path / "prior", [3.2790, 3.2795], prefix="prior")
    shared = tmp_path / "prior" / "shared.txt"
    shared.write_bytes(new[1].read_bytes())
    code, out, err = cli(capsys, "compare", tmp_path / "new", tmp_path / "prior")
    assert code == 2 and out == "" and err.splitlines() == [
        f"error: NEW {new[1]} and PRIOR {shared} are the same run (identical content); a run counts in one set "
        "only: take it out of NEW or PRIOR"]
    code, out, err = cli(capsys, "compare", new[0], f"{prior[0]},{new[0]}")  # one file in both
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and "are the same run (the same file)" in err
    shared.unlink()
    # within each set a run still counts once: NEW has 2 runs, PRIOR 2
    code, out, err = cli(capsys, "compare", f"{new[0]},{new[1]},{new[0]}", tmp_path / "prior")
    assert code == 0, err
    assert re.search(r"^\| runs +\| 2 +\| 2 +\|$", out, flags=re.M)
    assert re.search(r"^\| skipped +\| 1 +\| 0 +\|$", out, flags=re.M)
    assert f"NEW SKIPPED {new[0]}: the same file as {new[0]} (given twice)" in out.splitlines()


def test_a_run_id_reused_with_different_content_is_refused(tmp_path, capsys):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, second = tmp_path / "a" / "run-7.txt", tmp_path / "b" / "run-7.txt"
    first.write_text(make_log(3.2770))
    second.write_text(make_log(3.2790))
    msg = (f"error: {first} and {second} have the same run id 'run-7' but different content (a run id names one "
           "run: a log edited, or a --run-id used twice); keep only one of them, or rename the other log after its "
           "own run")
    code, out, err = cli(capsys, "summary", tmp_path / "a", tmp_path / "b")
    assert code == 2 and out == "" and err.splitlines() == [msg]
    code, out, err = cli(capsys, "new", "reused", first, second, "--out", tmp_path / "recs", "--not-a-record")
    assert code == 2 and out == "" and err.splitlines() == [msg] and not (tmp_path / "recs").exists()
    code, out, err = cli(capsys, "compare", first, second)
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and str(first) in err and str(second) in err
    # an unfinished log of that run id is not a second run: it is skipped for what it is, and nothing is refused
    second.write_text(make_log(3.2790, finish=False))
    code, out, err = cli(capsys, "summary", tmp_path / "a", tmp_path / "b")
    assert code == 0, err
    assert "1 finished run(s), 1 skipped" in out and _n(out) == 1
    assert _skipped(out) == [f"SKIPPED {second}: unfinished run: last validation at step 30/40, no final "
                             "validation line"]


def _sha256s(*paths):
    """{path: sha256 of its bytes} of every file under paths (a file, or a folder's files, recursively)."""
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*")))]
    return {f: hashlib.sha256(f.read_bytes()).hexdigest() for f in files if f.is_file()}


def test_a_log_with_crlf_line_endings_is_the_same_run(tmp_path, capsys):
    """One run id, the same step lines, CRLF line endings: the same run (counted once), not a run id reused."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    log, crlf = tmp_path / "a" / "run-7.txt", tmp_path / "b" / "run-7.txt"
    log.write_text(make_log(3.2770))
    crlf.write_bytes(log.read_bytes().replace(b"\n", b"\r\n"))
    before = _sha256s(tmp_path)
    code, alone, err = cli(capsys, "summary", log)
    assert code == 0 and err == ""
    code, out, err = cli(capsys, "summary", tmp_path / "a", tmp_path / "b")
    assert code == 0 and err == ""
    # every line: the summary of the log alone, then one SKIPPED line for the copy
    assert out.splitlines() == ["## 2 paths: 1 finished run(s), 1 skipped", *alone.splitlines()[1:], "",
                                f"SKIPPED {crlf}: the same run as {log} (the same step lines)"]
    assert _sha256s(tmp_path) == before


def test_copies_differing_only_in_whitespace_count_as_one_run(tmp_path, capsys):
    d = tmp_path / "logs"
    d.mkdir()
    log = d / "a.txt"
    log.write_text(make_log(3.2770))
    text = log.read_text()
    copies = {"b_newline_more.txt": text + "\n", "c_no_last_newline.txt": text.rstrip("\n"),
              "d_crlf.txt": text.replace("\n", "\r\n"),
              "e_blanks.txt": "\n".join(f"  {ln}\t " if ln.startswith("step:") else ln + " "
                                        for ln in text.splitlines()) + "\n\n"}
    for name, copy in copies.items():
        (d / name).write_bytes(copy.encode())
    before = _sha256s(d)
    code, alone, err = cli(capsys, "summary", log)
    assert code == 0 and err == ""
    code, out, err = cli(capsys, "summary", d)
    assert code == 0 and err == ""
    skipped = [f"SKIPPED {d / name}: the same run as {log} (the same step lines)" for name in copies]
    assert out.splitlines() == ["## logs: 1 finished run(s), 4 skipped", *alone.splitlines()[1:], "", *skipped]
    assert _sha256s(d) == before


def test_compare_refuses_a_whitespace_copy_of_a_new_run_in_prior(tmp_path, capsys):
    new = write_set(tmp_path / "new", [3.2770, 3.2775], prefix="new")
    write_set(tmp_path / "prior", [3.2790, 3.2795], prefix="prior")
    copy = tmp_path / "prior" / "copy.txt"
    copy.write_bytes(new[1].read_bytes().replace(b"\n", b"\r\n") + b"\r\n")
    before = _sha256s(tmp_path)
    code, out, err = cli(capsys, "compare", tmp_path / "new", tmp_path / "prior")
    assert code == 2 and out == "" and err.splitlines() == [
        f"error: NEW {new[1]} and PRIOR {copy} are the same run (the same step lines); a run counts in one set "
        "only: take it out of NEW or PRIOR"]
    assert _sha256s(tmp_path) == before


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_non_finite_target_is_refused_by_every_subcommand(tmp_path, capsys, value):
    write_set(tmp_path / "new", [3.2770, 3.2775], prefix="new")
    write_set(tmp_path / "prior", [3.2790, 3.2795], prefix="prior")
    work, opts = _fake_setup(tmp_path, make_log(3.2770, total=2160, val_every=250))
    before = _sha256s(tmp_path)
    for argv in (["summary", tmp_path / "new"], ["compare", tmp_path / "new", tmp_path / "prior"],
                 ["plot", tmp_path / "new", "-o", tmp_path / "p.png"],
                 ["new", "x", tmp_path / "new", "--out", tmp_path / "recs", "--not-a-record"],
                 ["run", "x", "1", "--nproc", "8", *opts]):
        code, out, err = cli(capsys, *argv, f"--target={value}")
        assert code == 2 and out == "" and err.splitlines() == [
            f"error: records/compare.py {argv[0]}: argument --target: '{value}' is not a finite number; give the val "
            f"loss to reach, e.g. --target 3.28 (see records/compare.py {argv[0]} -h)"], argv
    assert _sha256s(tmp_path) == before and _calls(work) == []  # nothing written, nothing launched


def test_a_missing_path_is_a_one_line_error_not_a_set(tmp_path, capsys):
    logs = write_set(tmp_path / "logs", [3.2770, 3.2775])
    missing = tmp_path / "nonexist.txt"
    before = _sha256s(tmp_path)
    for argv in (["summary", missing], ["summary", logs[0], missing], ["summary", f"{logs[0]},{missing}"],
                 ["compare", tmp_path / "logs", missing], ["compare", missing, tmp_path / "logs"],
                 ["plot", missing, "-o", tmp_path / "p.png"],
                 ["new", "x", logs[0], missing, "--out", tmp_path / "recs", "--not-a-record"]):
        code, out, err = cli(capsys, *argv)
        assert code == 2 and out == "" and err.splitlines() == [
            f"error: {missing}: no such file or directory; give a log, a folder of logs or a comma-separated list "
            "of logs"], argv
    assert _sha256s(tmp_path) == before
    # a folder that exists but holds no logs is still a SKIPPED line of the set
    (tmp_path / "empty").mkdir()
    code, out, err = cli(capsys, "summary", logs[0], tmp_path / "empty")
    assert code == 0 and err == ""
    assert out.splitlines()[0] == "## 2 paths: 1 finished run(s), 1 skipped"
    assert _skipped(out) == [f"SKIPPED {tmp_path / 'empty'}: directory holds no *.txt logs"]


def test_run_refuses_a_run_id_that_would_overwrite_a_log(tmp_path, capsys):
    work, opts = _fake_setup(tmp_path, make_log(3.2770, total=2160, val_every=250))
    code = rc.main(["run", "exp", "2", "--nproc", "8", *opts, "--run-id", "mine"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and "--run-id mine with N = 2" in err
    (work / "logs").mkdir()
    (work / "logs" / "mine.txt").write_text("an earlier run\n")
    code = rc.main(["run", "exp", "1", "--nproc", "8", *opts, "--run-id=mine"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.splitlines()) == 1 and f"{work / 'logs' / 'mine.txt'} already exists" in err
    assert _calls(work) == [] and (work / "logs" / "mine.txt").read_text() == "an earlier run\n"


# ---------------------------------------------------------------------------------------------- run: launcher, signals

def test_run_stops_with_exit_2_on_bad_input_and_adds_no_second_error(tmp_path, capsys):
    work, opts = _fake_setup(tmp_path, make_log(3.2770, total=2160, val_every=250))
    code = rc.main(["run", "exp", "2", "--nproc", "8", *opts, "--bad"])
    out, err = capsys.readouterr()
    assert code == 2 and err == ""  # the launcher's one line (echoed on stdout) is the whole report
    assert [ln for ln in out.splitlines() if "error" in ln] == [
        "error: --bad: not a setting of train_gpt.py; see python3 train_gpt.py --help"]
    assert "Traceback" not in out and len(_calls(work)) == 1 and not (tmp_path / "out").exists()


def test_run_launches_through_run_sh_launch_by_default(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPEEDRUN_LAUNCHER", raising=False)
    repo, _ = _repo_at(tmp_path, monkeypatch)
    _, opts = _fake_setup(tmp_path, make_log(3.2770, total=2160, val_every=250), out=False)
    fake_run_sh = repo / "run.sh"  # like run.sh: runs from its own folder, whatever the caller's
    fake_run_sh.write_text(f'#!/bin/sh\ncd "$(dirname "$0")"\nexec {shlex.quote(sys.executable)} '
                           f'{shlex.quote(str(tmp_path / "fake_launcher.py"))} "$@"\n')
    fake_run_sh.chmod(0o755)
    code = rc.main(["run", "exp", "2", "--nproc", "8", "--date", "2026-01-01", "--", "--seed", "7"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert _calls(repo) == [["launch", "8", "--seed", "7"]] * 2
    assert f"$ {fake_run_sh} launch 8 --seed 7" in out.splitlines()
    folder = repo / "records" / "2026-01-01_exp"
    assert len(list(folder.glob("*.txt"))) == 2
    repro = (folder / "README.md").read_text().split("## Reproduce")[1].split("```")[1].strip()
    assert repro == "./run.sh record exp 2 --nproc 8 -- --seed 7"


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_run_interrupted_ends_cleanly_and_leaves_nothing_running(tmp_path, sig):
    work, opts = _fake_setup(tmp_path, make_log(3.2770, total=2160, val_every=250))
    cmd = [sys.executable, str(REPO / "records" / "compare.py"), "run", "exp", "2", "--nproc", "8", *opts,
           "--hang-from", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    STARTED_GROUPS.add(proc.pid)
    pids = []
    try:
        deadline = time.monotonic() + 60
        while not (work / "pids").is_file() or not (work / "pids").read_text():  # the second run is under way
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        pids = [int(x) for x in (work / "pids").read_text().split()]  # the launcher and its worker
        os.killpg(proc.pid, sig)  # as Ctrl-C does: to the foreground process group, which is compare.py's own
        out, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc.pid)
    assert proc.returncode == 128 + sig, (out, err)
    assert "Traceback" not in out + err and "KeyboardInterrupt" not in out + err
    finished = re.search(r"^run 1/2: log (\S+)$", out, flags=re.M).group(1)
    unfinished = [p for p in (work / "logs").glob("*.txt") if str(p) != finished]
    assert len(unfinished) == 1 and unfinished[0].is_file()  # left where it is
    assert err.splitlines() == [
        f"run: interrupted by {sig.name} during run 2/2; finished runs: {finished}; unfinished run: {unfinished[0]} "
        f"(left where it is, not filed); nothing filed; to file the finished runs: records/compare.py new exp "
        f"{finished}"]
    assert not (tmp_path / "out").exists()
    assert [pid for pid in pids if _running(pid)] == [] and group_members(proc.pid) == []


def test_new_force_replaces_only_a_folder_the_tool_made(tmp_path, capsys):
    logs = write_set(tmp_path / "logs", [3.2770, 3.2775])
    out_dir = tmp_path / "recs"
    args = ("new", "y", *logs, "--not-a-record", "--out", out_dir, "--date", "2020-01-01")
    assert cli(capsys, *args)[0] == 0
    folder = out_dir / "2020-01-01_y"
    assert cli(capsys, *args, "--force")[0] == 0  # its own folder: replaced
    (folder / "keep.md").write_text("the user's notes\n")
    before = _sha256s(out_dir)
    code, out, err = cli(capsys, *args, "--force")
    assert code == 2 and out == "" and err.splitlines() == [
        f"error: {folder} holds files this tool did not write (keep.md): --force replaces only a folder it made; move "
        "them away, or pick another NAME"], err
    assert _sha256s(out_dir) == before


def test_compare_with_no_finished_run_on_one_side_names_the_skipped_files_and_prints_no_table(tmp_path, capsys):
    new = write_set(tmp_path / "new", [3.2770])
    diverged = tmp_path / "prior" / "diverged.txt"
    diverged.parent.mkdir()
    diverged.write_text(make_log(3.2770, finish=False))
    code, out, err = cli(capsys, "compare", new[0], diverged)
    assert code == 2 and err.splitlines() == ["error: PRIOR has no finished runs (see the SKIPPED lines)"], err
    assert len(out.splitlines()) == 1 and out.startswith(f"PRIOR SKIPPED {diverged}: unfinished run"), out


def test_a_broken_link_among_a_folders_logs_is_named_as_skipped(tmp_path, capsys):
    logs = write_set(tmp_path / "logs", [3.2770, 3.2775])
    (tmp_path / "logs" / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    code, out, err = cli(capsys, "summary", tmp_path / "logs")
    assert code == 0, err
    assert _skipped(out) == [f"SKIPPED {tmp_path / 'logs' / 'gone.txt'}: unreadable: No such file or directory"]


def test_new_force_refuses_a_file_where_the_record_folder_would_go(tmp_path, capsys):
    logs = write_set(tmp_path / "logs", [3.2770])
    (tmp_path / "recs").mkdir()
    target = tmp_path / "recs" / "2020-01-01_f4"
    target.write_text("mine\n")
    code, out, err = cli(capsys, "new", "f4", *logs, "--not-a-record", "--out", tmp_path / "recs", "--date",
                         "2020-01-01", "--force")
    assert code == 2 and out == "" and err.splitlines() == [
        f"error: {target} exists and is not a folder this tool made: pick another NAME"], err
    assert target.read_text() == "mine\n"
