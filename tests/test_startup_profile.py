"""bench/startup/startup_profile.py: where a cold start's seconds go, sampled by Python function."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "startup"))
import startup_profile as sp  # noqa: E402
from processes import run_group

REPO = Path(__file__).resolve().parents[1]


def test_a_busy_function_gets_its_wall_time_and_the_script_its_arguments(tmp_path):
    script = tmp_path / "busy.py"
    script.write_text("import sys, time\n"
                      "def spin():\n"
                      "    t = time.time()\n"
                      "    while time.time() - t < 0.6:\n"
                      "        pass\n"
                      "spin()\n"
                      "print('ARGS', sys.argv[1:])\n")
    r = run_group([sys.executable, str(REPO / "bench" / "startup" / "startup_profile.py"), "--out", str(tmp_path / "p"),
                        str(script), "--x", "1", "--", "--y"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ARGS ['--x', '1', '--', '--y']" in r.stdout  # the script's own `--` survives
    report = (tmp_path / "p" / "startup_profile.txt").read_text()
    spin = next(line for line in report.splitlines() if line.strip().endswith("busy.py:spin"))
    assert 0.4 < float(spin.split()[0]) < 2.0
    stacks = (tmp_path / "p" / "startup_stacks.txt").read_text().splitlines()
    assert any(line.rsplit(" ", 1)[0].endswith("/busy.py:spin") for line in stacks)  # frames: folder/file:function
    assert all(line.rsplit(" ", 1)[1].isdigit() for line in stacks)


def test_samples_fall_into_the_startup_phase_that_ends_after_them():
    marks = [("imports", 10.0), ("kernel libraries", 15.0)]
    assert sp.phase_of(9.0, marks) == "imports"
    assert sp.phase_of(12.0, marks) == "kernel libraries"
    assert sp.phase_of(16.0, marks) == "warm-up"


def test_a_recursive_function_counts_its_time_once():
    samples = [(0.0, 0.5, ("a:main", "a:f", "a:f")), (0.0, 0.25, ("a:main", "a:g"))]
    inclusive, own = sp.top_functions(samples)
    assert dict(inclusive) == {"a:main": 0.75, "a:f": 0.5, "a:g": 0.25}
    assert dict(own) == {"a:f": 0.5, "a:g": 0.25}
