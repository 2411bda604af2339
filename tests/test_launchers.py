"""Workers die with their launcher, and every end of a launched run is one line, under ./run.sh launch and raw torchrun.

Four 2-process runs on the CPU, side by side: the launcher (./run.sh launch) killed with SIGKILL while its workers
train, raw torchrun killed so while its workers still import torch, one rank killed with SIGKILL while training (the
log's last line names it), and Ctrl-C just after `check: ok`. A bad flag under raw torchrun is one line of ours, the
rest being torchrun's own report, each rank's output read from torchrun's per-rank files.
"""
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from processes import STARTED_GROUPS, kill_group
from proxy_shards import build_shards
from test_cli_and_errors import SCRIPT, TINY
from test_run_sh import RUN_SH, TORCHRUN_REPORT, real_launch_env, workers_of

pytestmark = pytest.mark.slow
ENDLESS = ["--num-scheduled-iterations", "10000", "--train-epochs", "1000"]  # runs until stopped
DIES_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("launchers") / "data"
    build_shards(folder, train_shards=1, tokens_per_train_shard=40_000, val_tokens=5_000)
    return folder


def rank_of(pid: int) -> int | None:
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(v[5:]) for v in env if v.startswith(b"RANK=")), None)


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclasses.dataclass
class Launched:
    cmd: list
    log: Path                      # the run's log (its run id is given)
    when: object                   # when(self) -> bool: the moment to act
    act: object                    # act(self): what is done then
    proc: subprocess.Popen = None
    out: list = dataclasses.field(default_factory=list)
    err: list = dataclasses.field(default_factory=list)
    workers: list = None           # the launcher's children when it acted
    acted: bool = False
    alive_after_s: dict = None     # worker pid -> seconds it lived on after the act (None: still alive at the limit)

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    def log_text(self) -> str:
        try:
            return self.log.read_text()
        except (OSError, UnicodeDecodeError):
            return ""


def training(launched) -> bool:
    return re.search(r"^step:1/\d+ train_time", launched.log_text(), re.M) is not None


def importing_torch(launched) -> bool:
    """Both workers started half a second ago: past Python's own start-up (its site module, before the script's first
    line, where a signal still gets the interpreter's own report), into the seconds of importing torch."""
    if len(workers_of(launched.proc.pid)) < 2:
        return False
    launched.seen = getattr(launched, "seen", None) or time.monotonic()
    return time.monotonic() - launched.seen >= 0.5


def kill_the_launcher(launched):
    launched.proc.send_signal(signal.SIGKILL)  # bash exec'd the launcher: proc is torchrun's agent


def kill_rank_1(launched):
    os.kill(next(w for w in launched.workers if rank_of(w) == 1), signal.SIGKILL)


def ctrl_c(launched):
    os.killpg(launched.proc.pid, signal.SIGINT)  # what the terminal sends its foreground group


@pytest.fixture(scope="module")
def launched(data, tmp_path_factory):
    logs = tmp_path_factory.mktemp("launched") / "logs"
    flags = [*TINY, "--data-path", str(data), "--log-dir", str(logs), *ENDLESS]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT)]
    runs = dict(
        launcher_killed=Launched(["bash", str(RUN_SH), "launch", "2", *flags, "--run-id", "launcher_killed"],
                                 logs / "launcher_killed.txt", training, kill_the_launcher),
        torchrun_killed=Launched([*torchrun, *flags, "--run-id", "torchrun_killed"], logs / "torchrun_killed.txt",
                                 importing_torch, kill_the_launcher),
        rank_killed=Launched(["bash", str(RUN_SH), "launch", "2", *flags, "--run-id", "rank_killed"],
                             logs / "rank_killed.txt", training, kill_rank_1),
        ctrl_c=Launched(["bash", str(RUN_SH), "launch", "2", *flags, "--run-id", "ctrl_c"], logs / "ctrl_c.txt",
                        importing_torch, ctrl_c),
    )

    def drain(stream, into):
        for line in stream:
            into.append(line)

    for run in runs.values():
        run.proc = subprocess.Popen(run.cmd, env=real_launch_env(), text=True, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        STARTED_GROUPS.add(run.proc.pid)
        for stream, into in ((run.proc.stdout, run.out), (run.proc.stderr, run.err)):
            threading.Thread(target=drain, args=(stream, into), daemon=True).start()
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline and any(not r.acted or r.alive_after_s is None for r in runs.values()):
            for run in runs.values():
                if not run.acted and run.proc.poll() is None and run.when(run):
                    run.workers, run.acted, run.acted_at = workers_of(run.proc.pid), True, time.monotonic()
                    run.act(run)
                if run.acted and run.alive_after_s is None:
                    since = time.monotonic() - run.acted_at
                    if since >= DIES_WITHIN_S or not any(alive(w) for w in run.workers):
                        run.alive_after_s = {w: (None if alive(w) else since) for w in run.workers}
            time.sleep(0.05)
        for run in runs.values():
            run.proc.wait(timeout=60)
    finally:
        for run in runs.values():
            kill_group(run.proc.pid)
            for w in run.workers or ():
                kill_group(w)  # a worker that outlived its launcher: the asserts say so
        time.sleep(0.2)  # the readers reach the end of the pipes
    return runs


@pytest.mark.parametrize("name", ["launcher_killed", "torchrun_killed"])
def test_workers_end_within_seconds_when_their_launcher_is_killed(launched, name):
    run = launched[name]
    assert run.acted, f"the moment never came: {run.stdout[-2000:]} {''.join(run.err)[-2000:]}"
    assert len(run.workers) == 2 and None not in run.alive_after_s.values(), run.alive_after_s
    assert not any(alive(w) for w in run.workers)


def test_a_launcher_killed_while_its_workers_train_is_the_last_line_of_their_log(launched):
    text = launched["launcher_killed"].log_text()
    assert re.fullmatch(r"stopped at step \d+: the launcher died", text.rstrip("\n").split("\n")[-1]), text[-500:]
    assert not launched["launcher_killed"].log.with_suffix(".lock").exists()


def test_a_launcher_killed_while_its_workers_import_torch_leaves_no_log(launched):
    assert not launched["torchrun_killed"].log.exists()


def test_a_rank_killed_by_sigkill_is_named_in_one_line_and_on_the_logs_last_line(launched):
    run = launched["rank_killed"]
    assert run.acted and run.proc.returncode == 128 + signal.SIGKILL, (run.stdout[-2000:], run.err)
    assert "".join(run.err).splitlines() == ["run.sh: rank 1 was killed by SIGKILL (its output is above)"], run.err
    lines = run.log_text().rstrip("\n").split("\n")
    assert lines[-1] == "stopped: rank 1 was killed by SIGKILL", lines[-3:]
    # rank 0 said where it was, as its one line: its collective failed, or torchrun's SIGTERM came first
    assert re.fullmatch(r"stopped at step \d+: another rank has ended \(a collective failed\)|"
                        r"interrupted by SIGTERM at step \d+", lines[-2]), lines[-3:]
    assert not any(noise in run.stdout for noise in TORCHRUN_REPORT + ("Traceback",)), run.stdout[-2000:]
    assert not run.log.with_suffix(".lock").exists()


def test_ctrl_c_just_after_the_check_is_one_line_and_exit_130(launched):
    run = launched["ctrl_c"]
    assert run.acted and run.proc.returncode == 130, (run.stdout[-2000:], run.err)
    assert run.err == [], run.err
    out = run.stdout.splitlines()
    assert out[0].startswith("check: ok:") and out[-1] in ("interrupted by SIGINT while starting",
                                                           f"{run.log}"), out
    assert [ln for ln in out if "interrupted" in ln] == ["interrupted by SIGINT while starting"], out
    assert not any(alive(w) for w in run.workers)


def test_a_bad_flag_under_raw_torchrun_is_one_line_of_ours(tmp_path, data):
    """torchrun's own report (its traceback, its table) is its own: each rank's output, read from torchrun's
    per-rank files, is the one error line on rank 0 and nothing on rank 1."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "--log-dir", str(tmp_path / "torchrun"), "--redirects", "3", str(SCRIPT), *TINY,
                        "--data-path", str(data), "--log-dir", str(tmp_path / "logs"), "--seed", "abc"],
                       env=real_launch_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr  # torchrun's own status for a failed worker
    said = {}
    for rank in (0, 1):
        [folder] = (tmp_path / "torchrun").rglob(f"attempt_0/{rank}")
        said[rank] = ((folder / "stdout.log").read_text(), (folder / "stderr.log").read_text())
    assert said[0] == ("", "error: argument --seed: expected an integer, got 'abc' (see --help)\n"), said[0]
    assert said[1] == ("", ""), said[1]
    assert not (tmp_path / "logs").exists()
