"""Tests start commands as process groups that never outlive them (tests/processes.py)."""
import subprocess
import sys
import time

import pytest

from processes import STARTED_GROUPS, group_members, run_group

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads process groups from /proc")


def test_a_timed_out_command_has_its_whole_group_killed_grandchildren_included():
    before = set(STARTED_GROUPS)
    t0 = time.time()
    with pytest.raises(subprocess.TimeoutExpired):
        run_group(["bash", "-c", "sleep 600 & sleep 600 & wait"], timeout=1)
    assert time.time() - t0 < 30
    (pgid,) = STARTED_GROUPS - before
    assert group_members(pgid) == []


def test_a_command_that_exits_and_leaves_a_child_behind_has_it_killed_and_reported():
    before = set(STARTED_GROUPS)
    r = run_group(["bash", "-c", "sleep 600 >/dev/null 2>&1 & echo $!"], timeout=30)
    (pgid,) = STARTED_GROUPS - before
    assert r.returncode == 0 and r.left_running == [int(r.stdout)]
    assert group_members(pgid) == []


def test_a_command_that_cleans_up_after_itself_leaves_nothing_running():
    r = run_group([sys.executable, "-c", "print('hi')"], timeout=30)
    assert r.stdout == "hi\n" and r.left_running == []
