"""`./run.sh test` fails fast and leaves nothing behind when a test crashes or hangs, and compiles into caches of its
own. Each check runs a copy of run.sh, pytest.ini and the suite's conftest.py on planted tests."""
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from processes import RUN_DIR_ENV, run_group

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads processes from Linux's /proc")]

CRASH = r'''
import os, signal, subprocess, time
from pathlib import Path
from processes import STARTED_GROUPS
from torch._inductor.runtime.cache_dir_utils import cache_dir

def test_segfaults_leaving_processes_behind():
    out = Path(os.environ["PLANT_OUT"])
    (out / "cache_dir").write_text(cache_dir())
    # as run_group starts a command: a group of its own (with, like torchrun's workers, a process in another session)
    group = subprocess.Popen(["bash", "-c", f"setsid sleep 600 & echo $! > {out}/setsid_pid; wait"],
                             start_new_session=True)
    STARTED_GROUPS.add(group.pid)
    child = os.fork()  # as tests/dist_utils.py starts its gloo ranks
    if child == 0:
        time.sleep(600)
        os._exit(0)
    while not (out / "setsid_pid").exists():
        time.sleep(0.01)
    (out / "pids").write_text(f"{group.pid} {child}")
    os.kill(os.getpid(), signal.SIGSEGV)
'''

HANG = r'''
import time

def test_hangs():
    time.sleep(600)
'''


def suite_copy(tmp_path: Path, tests: dict, limit_s: int = 5, suite_limit_min: str = "") -> Path:
    """run.sh, pytest.ini (its per-test limit set to limit_s) and tests/ with the suite's conftest.py and processes.py
    and the planted tests, in tmp_path/repo."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    run_sh = (REPO / "run.sh").read_text()
    if suite_limit_min:
        run_sh, n = re.subn(r"(?m)^TEST_SUITE_LIMIT_MIN=\d+", f"TEST_SUITE_LIMIT_MIN={suite_limit_min}", run_sh)
        assert n == 1
    (repo / "run.sh").write_text(run_sh)
    ini, n = re.subn(r"(?m)^timeout = \d+$", f"timeout = {limit_s}", (REPO / "pytest.ini").read_text())
    assert n == 1
    (repo / "pytest.ini").write_text(ini)
    for name in ("conftest.py", "processes.py"):
        shutil.copy(REPO / "tests" / name, repo / "tests" / name)
    for name, text in tests.items():
        (repo / "tests" / name).write_text(text)
    return repo


def run_suite(tmp_path: Path, repo: Path, *args, **env):
    """`bash run.sh test ARGS`, its temporary files (the run's folder) under tmp_path/tmp; (result, seconds)."""
    (tmp_path / "tmp").mkdir()
    # not this run's folder, nor xdist's and pytest's variables (a worker's PYTEST_XDIST_WORKER would make the copy's
    # main process take itself for a worker)
    environ = {k: v for k, v in os.environ.items() if k != RUN_DIR_ENV and not k.startswith("PYTEST_")}
    environ.update(TMPDIR=str(tmp_path / "tmp"), PLANT_OUT=str(tmp_path), **env)
    t0 = time.monotonic()
    r = run_group(["bash", str(repo / "run.sh"), "test", "-p", "no:cacheprovider", *args], env=environ, timeout=180)
    return r, time.monotonic() - t0


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def crashed_run(tmp_path_factory):
    """Two workers: one segfaults, leaving a process group, a process in a session of its own and a forked child;
    the other hangs. The user has a cache folder of their own exported."""
    tmp = tmp_path_factory.mktemp("crash")
    repo = suite_copy(tmp, {"test_crash.py": CRASH, "test_hang.py": HANG})
    r, seconds = run_suite(tmp, repo, "-n", "2", TORCHINDUCTOR_CACHE_DIR=str(tmp / "users_cache"))
    return tmp, r, seconds


def test_a_segfault_and_a_hang_fail_the_suite_within_the_per_test_limit_naming_both(crashed_run):
    tmp, r, seconds = crashed_run
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert seconds < 120  # starting two workers (importing torch on busy cores), then the 5 s limit
    assert "crashed while running 'tests/test_crash.py::test_segfaults_leaving_processes_behind'" in r.stdout
    assert ("crashed while running 'tests/test_hang.py::test_hangs': it ran past the per-test limit of 5 s"
            in r.stdout)


def test_nothing_a_crashed_test_started_outlives_the_suite(crashed_run):
    tmp, r, _ = crashed_run
    pids = [int(p) for p in (tmp / "pids").read_text().split()] + [int((tmp / "setsid_pid").read_text())]
    assert not [pid for pid in pids if alive(pid)]
    assert r.left_running == []  # nothing of the suite's own process group either
    assert "processes started by tests were still running at the end (killed now)" in r.stderr


def test_the_run_compiles_into_a_folder_of_its_own_removed_at_its_end(crashed_run):
    tmp, r, _ = crashed_run
    cache = Path((tmp / "cache_dir").read_text())
    assert cache.parent.parent.parent == tmp / "tmp" and cache.parent.parent.name.startswith("speedrun-tests-")
    assert f"not used: TORCHINDUCTOR_CACHE_DIR={tmp / 'users_cache'}" in r.stdout
    assert not (tmp / "users_cache").exists()
    assert list((tmp / "tmp").glob("speedrun-tests-*")) == []  # the run's folder is gone


def test_a_suite_past_its_overall_limit_is_stopped_naming_the_running_test(tmp_path):
    # 6 s: time enough for one pytest process (no worker to start, nothing that imports torch) to reach the test
    repo = suite_copy(tmp_path, {"test_hang.py": HANG}, limit_s=300, suite_limit_min="0.1")
    r, seconds = run_suite(tmp_path, repo, "-n", "0")
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    assert seconds < 36
    assert ("run.sh: the test suite ran past its 0.1-minute limit and was stopped; tests running then: "
            "tests/test_hang.py::test_hangs") in r.stderr
    assert r.left_running == [] and list((tmp_path / "tmp").glob("speedrun-tests-*")) == []


def test_a_killed_group_takes_its_descendants_in_sessions_of_their_own_along(tmp_path):
    """torchrun starts its workers in sessions of their own: killing torchrun's group must not orphan them."""
    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_group(["bash", "-c", f"setsid sleep 600 & echo $! > {pid_file}; wait"], timeout=2)
    pid = int(pid_file.read_text())
    assert not alive(pid)
