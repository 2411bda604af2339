"""bench/ab.py on the CPU, with a stand-in for bench.py that logs each call and writes the JSON a run would."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from scipy import stats

from processes import STARTED_GROUPS, kill_group

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import ab  # noqa: E402

# argv: OUT SIDE. STUB_CFG (JSON): per side the two stages' ms of run k, "sleep" and "fail" by run name.
STUB = """import json, os, sys, time
out, side = sys.argv[1], sys.argv[2]
name = os.path.basename(out)[:-len(".json")]
cfg = json.loads(os.environ["STUB_CFG"])
with open(os.environ["STUB_LOG"], "a") as f:
    lane = os.environ.get("CUDA_VISIBLE_DEVICES")
    f.write(json.dumps(dict(name=name, side=side, cwd=os.getcwd(), lane=lane)) + "\\n")
time.sleep(cfg.get("sleep", {}).get(name, 0))
if name in cfg.get("fail", []):
    sys.exit(3)
ms = cfg[side][int(name[1:]) - 1]
with open(out, "w") as f:
    json.dump(dict(device="stand-in GPU", commit=side * 7, stages=[
        dict(name="stage 1", median_ms=ms[0], back_to_back_ms=ms[0] - 1.0, peak_allocated_gib=20.0,
             peak_in_use_gib=21.0 + (side == "b")),
        dict(name="stage 2", median_ms=ms[1])]), f)
"""
A_MS = [[100.0, 200.0], [101.5, 199.0], [100.5, 201.0], [100.0, 200.0], [100.0, 200.0]]
B_MS = [[103.0, 200.5], [104.5, 199.5], [102.0, 200.0], [103.0, 200.0], [103.0, 200.0]]


@pytest.fixture
def stub(tmp_path, monkeypatch):
    (tmp_path / "stub.py").write_text(STUB)
    monkeypatch.setenv("STUB_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def argv(*extra, sleep=None, fail=()):
        os.environ["STUB_CFG"] = json.dumps(dict(a=A_MS, b=B_MS, sleep=sleep or {}, fail=list(fail)))
        cmd = f"{sys.executable} {tmp_path / 'stub.py'} {{out}}"
        return ["--out", str(tmp_path / "ab"), "--a", cmd + " a", "--b", cmd + " b", *extra]

    def calls():
        log = tmp_path / "calls.jsonl"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    stub.argv, stub.calls, stub.tmp = argv, calls, tmp_path
    return stub


def summary(stub):
    return json.loads((stub.tmp / "ab" / "ab.json").read_text())


def test_a_and_b_alternate_and_each_stage_gets_means_difference_and_welchs_p(stub, capsys):
    base = stub.tmp / "base"
    base.mkdir()
    assert ab.main(stub.argv("--pairs", "3", "--b-dir", str(base))) == 0
    assert [(c["name"], c["side"]) for c in stub.calls()] == [("a1", "a"), ("b1", "b"), ("a2", "a"), ("b2", "b"),
                                                              ("a3", "a"), ("b3", "b")]
    assert {c["cwd"] for c in stub.calls() if c["side"] == "b"} == {str(base)}
    assert {c["cwd"] for c in stub.calls() if c["side"] == "a"} == {os.getcwd()}
    s = summary(stub)
    assert s["order"] == ["a1", "b1", "a2", "b2", "a3", "b3"] and s["pairs_counted"] == [1, 2, 3]
    assert s["device"] == "stand-in GPU" and s["runs"][0]["commit"] == "aaaaaaa" and s["b"]["dir"] == str(base)
    assert all(r["command"].endswith(f"{r['name']}.json {r['side']}") for r in s["runs"])
    for i, name in enumerate(("stage 1", "stage 2")):
        a, b = [ms[i] for ms in A_MS[:3]], [ms[i] for ms in B_MS[:3]]
        row = s["stages"][name]
        assert row["a_ms"] == a and row["b_ms"] == b
        assert row["b_minus_a_ms"] == pytest.approx(sum(b) / 3 - sum(a) / 3)
        assert row["b_minus_a_pct"] == pytest.approx(100 * (sum(b) - sum(a)) / sum(a))
        assert row["welch_p"] == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue, rel=1e-9)
    assert s["stages"]["stage 1"]["peak_in_use_gib"] == dict(a_mean=21.0, b_mean=22.0, b_minus_a=1.0)
    assert "peak_in_use_gib" not in s["stages"]["stage 2"]
    out = capsys.readouterr().out.splitlines()
    last = out[out.index("3 pair(s) counted: A and B 3 run(s) each"):]  # the table comes last
    assert last[2].startswith("stage 1 ") and "+2.50  +2.48%" in last[2]
    assert last[4] == "synchronised, B - A of the medians (95 % bootstrap interval):"
    assert last[7] == "back to back, B - A of the medians (95 % bootstrap interval):" and len(last) == 9
    assert last[8].startswith("stage 1 ") and "+2.50 ms" in last[8] and "+2.51%" in last[8]  # of A's 99.5 ms


def test_each_stage_gets_the_difference_of_medians_with_a_bootstrap_interval_for_each_timing(stub):
    """B - A of the runs' medians, per timing that every run reports (bench.py's synchronised median and its
    back-to-back mean step), with a 95 % percentile-bootstrap interval in ms and in % of A: the same on every
    summary (seeded), inside the range the runs allow, and around 0 when B is A."""
    assert ab.main(stub.argv("--pairs", "3")) == 0
    s = summary(stub)
    one, two = s["stages"]["stage 1"]["medians"], s["stages"]["stage 2"]["medians"]
    assert set(one) == {"median_ms", "back_to_back_ms"} and set(two) == {"median_ms"}  # stage 2 has no back-to-back
    a, b = [ms[0] for ms in A_MS[:3]], [ms[0] for ms in B_MS[:3]]
    m = one["median_ms"]
    assert m["a"] == a and m["b"] == b and m["b_minus_a_ms"] == pytest.approx(103.0 - 100.5)
    assert m["b_minus_a_pct"] == pytest.approx(100 * 2.5 / 100.5)
    low, high = m["ci95_ms"]
    assert min(b) - max(a) <= low <= m["b_minus_a_ms"] <= high <= max(b) - min(a)
    assert m["ci95_pct"] == pytest.approx([100 * low / 100.5, 100 * high / 100.5])
    assert one["back_to_back_ms"]["b_minus_a_ms"] == pytest.approx(2.5)  # each 1 ms below its median
    assert ab.median_difference(a, b) == {k: v for k, v in m.items() if k not in ("a", "b")}  # seeded: the same
    same = ab.median_difference(a, a)
    assert same["b_minus_a_ms"] == 0 and same["ci95_ms"][0] < 0 < same["ci95_ms"][1]


def test_welchs_p_matches_scipy_where_the_sides_differ_in_size_and_spread():
    for a, b in (([1.0, 2.0, 4.0], [2.0, 2.5]), ([10.0, 10.1, 9.9, 10.05], [12.0, 8.0, 11.0]),
                 ([1.0, 1.0, 1.5], [5.0, 9.0])):
        assert ab.welch_p(a, b) == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue, rel=1e-9)
    assert ab.welch_p([1.0], [2.0, 3.0]) is None and ab.welch_p([2.0, 2.0], [3.0, 3.0]) is None


def test_a_run_cut_at_the_deadline_drops_its_pair_so_a_and_b_stay_balanced(stub):
    assert ab.main(stub.argv("--pairs", "5", "--budget", "3", sleep={"b2": 60})) == 0
    s = summary(stub)
    assert s["order"] == ["a1", "b1", "a2", "b2"]  # no pair 3: the deadline had passed
    b2 = s["runs"][3]
    assert b2["cut_at_deadline"] and not b2["ok"] and s["runs"][2]["ok"]
    assert s["pairs_counted"] == [1] and s["stages"]["stage 1"]["a_ms"] == [100.0]


def test_a_slow_first_pair_does_not_hold_back_the_fast_pairs_after_it(stub):
    """A device call's first runs compile cold: the next pair is sized by each side's latest run, not the slowest.
    Sized by the slowest (a1's 4 s, twice), pair 2 would not start with about 5.5 s left."""
    assert ab.main(stub.argv("--pairs", "3", "--budget", "10", sleep={"a1": 4.0})) == 0
    s = summary(stub)
    assert s["order"] == ["a1", "b1", "a2", "b2", "a3", "b3"] and s["pairs_counted"] == [1, 2, 3]


def test_no_pair_starts_without_time_for_both_runs(stub):
    assert ab.main(stub.argv("--pairs", "2", "--budget", "3", "--min-left", "2")) == 1
    assert stub.calls() == [] and summary(stub)["pairs_counted"] == []


def test_lanes_take_pairs_alternating_and_odd_lanes_start_with_b(stub):
    assert ab.main(stub.argv("--pairs", "4", "--lanes", "0", "1,2", sleep={f"{s}{k}": 0.3 for s in "ab"
                                                                            for k in range(1, 5)})) == 0
    by_lane = {}
    for c in stub.calls():
        by_lane.setdefault(c["lane"], []).append(c["name"])
    assert set(by_lane) == {"0", "1,2"}
    for lane, first in (("0", "a"), ("1,2", "b")):
        names = by_lane[lane]
        assert len(names) % 2 == 0 and [n[0] for n in names] == [first, "ab".replace(first, "")] * (len(names) // 2)
        assert all(names[i][1:] == names[i + 1][1:] for i in range(0, len(names), 2))  # a pair stays on its lane
    assert summary(stub)["pairs_counted"] == [1, 2, 3, 4]


def test_a_failed_run_stops_new_pairs_and_fails_the_call(stub):
    assert ab.main(stub.argv("--pairs", "3", fail=["b1"])) == 1
    s = summary(stub)
    assert s["order"] == ["a1", "b1"] and s["runs"][1]["exit"] == 3 and s["pairs_counted"] == []
    assert (stub.tmp / "ab" / "b1.log").exists()


def test_sigterm_kills_the_running_command_and_writes_what_finished(stub):
    proc = subprocess.Popen([sys.executable, str(BENCH / "ab.py"), *stub.argv("--pairs", "2", sleep={"b1": 300})],
                            start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    STARTED_GROUPS.add(proc.pid)
    try:
        deadline = time.monotonic() + 90  # generous: the suite's other worker may keep both cores busy
        while len(stub.calls()) < 2 and time.monotonic() < deadline:  # b1 has started its minute of sleep
            time.sleep(0.05)
        assert len(stub.calls()) == 2, "b1 never started"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
    finally:
        kill_group(proc.pid)
    assert proc.returncode == 143, err
    s = summary(stub)
    assert s["interrupted_by"] == "SIGTERM" and s["order"] == ["a1", "b1"] and s["pairs_counted"] == []
    stub_cmd = str(stub.tmp / "stub.py").encode()
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and stub_cmd in read_cmdline(pid)]
    assert left == []


def read_cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.parametrize("change, message", [
    (dict(a="python3 bench/bench.py --stages-only"), "--a has no {out}"),
    (dict(extra=["--a-dir", "/nonexistent/base"]), "--a-dir /nonexistent/base is not a folder"),
    (dict(extra=["--pairs", "0"]), "--pairs 0: give 1 or more"),
    (dict(extra=["--budget", "-5"]), "the deadline has passed"),
    (dict(extra=["--lanes", "0", "gpu1"]), "--lanes 0 gpu1: give GPU numbers"),
    (dict(extra=["--pairs", "two"]), "argument --pairs: invalid int value"),
    (dict(used=True), "exists and is not an empty folder"),
])
def test_bad_arguments_fail_in_one_line_before_any_run(stub, capsys, change, message):
    argv = stub.argv(*change.get("extra", []))
    if "a" in change:
        argv[argv.index("--a") + 1] = change["a"]
    if change.get("used"):
        (stub.tmp / "ab").mkdir()
        (stub.tmp / "ab" / "old.json").write_text("{}")
    code = ab.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
    assert stub.calls() == [] and not (stub.tmp / "ab" / "ab.json").exists()

