"""Run a command the way subprocess.run does, but as a process group of its own that is killed as a whole.

    r = run_group(cmd, timeout=60, cwd=..., env=...)   # a CompletedProcess; raises subprocess.TimeoutExpired

subprocess.run kills only its direct child on a timeout: torchrun's workers would
live on after the test, holding cores that the rest of the suite needs. Here the command starts a new session
(its own process group), and on a timeout, or once it has exited, every process left in that group is killed.
Every group started is remembered, so that the suite can check at its end that none is left (conftest.py).
"""
import os
import signal
import subprocess
import time
from pathlib import Path

STARTED_GROUPS = set()


def group_members(pgid: int) -> list[int]:
    """Live processes (not zombies) whose process group is pgid, from /proc (Linux); [] elsewhere."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def kill_group(pgid: int, wait_s: float = 10.0) -> None:
    """SIGKILL every process of the group, and wait (up to wait_s) until none is alive: a killed process lives on
    for a moment, and the caller's next look should not find it."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + wait_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.01)


def run_group(cmd, timeout: float, capture_output: bool = True, text: bool = True, **kwargs):
    """subprocess.run(cmd, timeout=timeout, ...) in a process group that is killed whole when the call returns."""
    if capture_output:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stdin = kwargs.pop("input", None)
    if stdin is not None:
        kwargs["stdin"] = subprocess.PIPE
    with subprocess.Popen(cmd, text=text, start_new_session=True, **kwargs) as proc:
        STARTED_GROUPS.add(proc.pid)  # the session leader's pid is the group's id
        try:
            out, err = proc.communicate(stdin, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            kill_group(proc.pid)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from e
        finally:
            left_running = group_members(proc.pid)
            kill_group(proc.pid)
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    result.left_running = left_running  # pids the command left behind when it exited (killed now)
    return result
