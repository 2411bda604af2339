"""Run a command the way subprocess.run does, but as a process group of its own that is killed as a whole.

    r = run_group(cmd, timeout=60, cwd=..., env=...)   # a CompletedProcess; raises subprocess.TimeoutExpired

subprocess.run kills only its direct child on a timeout: torchrun's workers would
live on after the test, holding cores that the rest of the suite needs. Here the command starts a new session
(its own process group), and on a timeout, or once it has exited, every process left in that group is killed.
Every group started is remembered, so that the suite can check at its end that none is left (conftest.py); with
SPEEDRUN_TEST_RUN_DIR set (the suite's own folder, conftest.py) also on disk, in its groups/ folder, so that the
suite's main process finds and kills the groups of a test process that crashed or was killed before it could.
"""
import os
import signal
import subprocess
import time
from pathlib import Path

RUN_DIR_ENV = "SPEEDRUN_TEST_RUN_DIR"


def _registry() -> Path | None:
    run_dir = os.environ.get(RUN_DIR_ENV)
    return Path(run_dir) / "groups" if run_dir else None


class _Groups(set):
    """The groups this process started; add() also records the group in the run's folder (when there is one)."""

    def add(self, pgid: int) -> None:
        super().add(pgid)
        registry = _registry()
        if registry is not None:
            registry.mkdir(parents=True, exist_ok=True)
            (registry / str(pgid)).touch()


STARTED_GROUPS = _Groups()


def _processes() -> dict[int, tuple[int, int]]:
    """pid: (parent pid, process group) of every live process (zombies left out), from /proc (Linux); {} elsewhere."""
    table = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        if fields[0] != "Z":
            table[int(entry.name)] = (int(fields[1]), int(fields[2]))
    return table


def group_members(pgid: int) -> list[int]:
    """Live processes of the group pgid and their descendants: torchrun starts its workers in sessions of their own,
    and they must go with it."""
    table = _processes()
    members = {pid for pid, (_, group) in table.items() if group == pgid}
    grown = True
    while grown:
        children = {pid for pid, (parent, _) in table.items() if parent in members} - members
        members |= children
        grown = bool(children)
    return sorted(members)


def kill_group(pgid: int, wait_s: float = 10.0) -> None:
    """SIGKILL every process of the group (descendants in other groups included), and wait (up to wait_s) until none
    is alive: a killed process lives on for a moment, and the caller's next look should not find it."""
    # Stopped first, so that none can start another process while the tree is read; read before the kill, since a
    # descendant whose parent is gone can no longer be traced to the group.
    members = []
    while True:
        found = group_members(pgid)
        _signal(pgid, found, signal.SIGSTOP)
        if set(found) <= set(members):
            break
        members = sorted(set(members) | set(found))
    _signal(pgid, members, signal.SIGKILL)
    deadline = time.monotonic() + wait_s
    while any(_alive(pid) for pid in members) and time.monotonic() < deadline:
        time.sleep(0.01)
    registry = _registry()
    if registry is not None and not group_members(pgid):
        (registry / str(pgid)).unlink(missing_ok=True)


def _signal(pgid: int, pids: list[int], sig: int) -> None:
    for send, target in [(os.killpg, pgid)] + [(os.kill, pid) for pid in pids]:
        try:
            send(target, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def recorded_groups_left() -> dict[int, list[int]]:
    """The groups recorded in the run's folder that still have live processes: pgid -> pids."""
    registry = _registry()
    if registry is None or not registry.is_dir():
        return {}
    left = {}
    for entry in registry.iterdir():
        members = group_members(int(entry.name))
        if members:
            left[int(entry.name)] = members
        else:
            entry.unlink(missing_ok=True)
    return left


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
