"""Nothing lost, nothing hangs: train_gpt.py's guards, on the CPU.

Bad settings, run ids, output paths and data are refused before anything is written (exit 2, one line naming what
is wrong); a run whose training loss goes non-finite stops with exit 3 and says so on its log's last line; SIGINT
and SIGTERM close the log with one line and exit 130/143, leaving no process behind; a config error from the model
or optimizer build leaves no log. Most refusals are checked through main() in this process (milliseconds each),
a few through a child process as a user meets them; the training runs are real child processes, run side by side.
"""
import dataclasses
import hashlib
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import train_gpt as tg
from processes import STARTED_GROUPS, group_members, kill_group
from proxy_shards import build_shards
# main: the fixture that runs train_gpt.main in this process
from test_cli_and_errors import (REPO, SCRIPT, TINY, assert_one_line_error, child_env, main,  # noqa: F401
                                 refused, run_script, smoke_args)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("guards") / "data"
    build_shards(folder, train_shards=1, tokens_per_train_shard=40_000, val_tokens=5_000)
    return folder


def tiny_args(data, log_dir, *extra):
    return [*TINY, "--data-path", str(data), "--log-dir", str(log_dir), *extra]


def tree(folder: Path) -> dict:
    """Every path under folder with its bytes (None for a folder): what a refused run must leave as it was."""
    return {str(p.relative_to(folder)): (None if p.is_dir() else p.read_bytes()) for p in sorted(folder.rglob("*"))}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------------------------------
# settings out of range, non-finite or of the wrong length: refused by --check-flags and --check
# ----------------------------------------------------------------------------------------------------

OUT_OF_RANGE = [  # (flags, what the one line says)
    (["--lr-plateaus", "nan,1.51,1.93"], "--lr-plateaus must be in [0, inf) (each value), got nan,1.51,1.93"),
    (["--lr-plateaus", "1,inf,1.93"], "--lr-plateaus must be in [0, inf) (each value), got 1.0,inf,1.93"),
    (["--val-tokens", "0"], "--val-tokens must be in [1, inf), got 0"),
    (["--block-size", "0"], "--block-size must be in [1, inf), got 0"),
    (["--train-max-seq-len", "0"], "--train-max-seq-len must be in [1, inf), got 0"),
    (["--ws-schedule=-3,0,2"], "--ws-schedule must be in [1, inf) (each value), got -3,0,2"),
    (["--ws-schedule", "-3,0,2"], "--ws-schedule must be in [1, inf) (each value), got -3,0,2"),  # not argparse's
    (["--train-bs-schedule", "512,0,1536"], "--train-bs-schedule must be in [1, inf) (each value), got 512,0,1536"),
    (["--adam-betas", "0.9"], "--adam-betas takes 2 comma-separated values, got 0.9"),
    (["--adam-betas", "0.9,1"], "--adam-betas must be in [0, 1) (each value), got 0.9,1.0"),
    (["--muon-momentum-cooldown", "0.95,0.85"], "--muon-momentum-cooldown takes 3 comma-separated values"),
    (["--muon-momentum-warmup", "0.85,0.95,inf"], "--muon-momentum-warmup must be in [0, inf) (each value)"),
    (["--seed", "-5"], "--seed must be in [-1, inf), got -5"),
    (["--adam-lr", "inf"], "--adam-lr must be in [0, inf), got inf"),
    (["--muon-lr", "nan"], "--muon-lr must be in [0, inf), got nan"),
    (["--muon-lr=-inf"], "--muon-lr must be in [0, inf), got -inf"),
    (["--lr-floor", "-0.1"], "--lr-floor must be in [0, inf), got -0.1"),
    (["--cooldown-frac", "0"], "--cooldown-frac must be in (0, 1], got 0.0"),
    (["--adam-eps", "0"], "--adam-eps must be in (0, inf), got 0.0"),
    (["--muon-beta2", "1"], "--muon-beta2 must be in [0, 1), got 1.0"),
    (["--warmup-steps-per-stage", "1"], "--warmup-steps-per-stage must be in [2, inf), got 1"),
    (["--vocab-size", "50256"], "--vocab-size must be in [50257, 65536], got 50256"),
    (["--vocab-size", "65537"], "--vocab-size must be in [50257, 65536], got 65537"),
    (["--val-loss-every", "-1"], "--val-loss-every must be in [0, inf), got -1"),
    (["--kernels", "attention,flash"], "--kernels must be fused, plain or a comma-separated list"),
]


@pytest.mark.parametrize("mode", ["--check-flags", "--check"])
@pytest.mark.parametrize("argv,says", OUT_OF_RANGE, ids=[" ".join(a) for a, _ in OUT_OF_RANGE])
def test_a_setting_out_of_range_is_refused_naming_its_flag_and_writes_nothing(main, data, tmp_path, argv, says, mode):
    refused(main(smoke_args(data, tmp_path, *argv, mode)), says)
    assert list(tmp_path.iterdir()) == []  # no --log-dir, nothing else


def test_a_negative_value_after_its_flag_is_refused_by_the_script_in_one_line(tmp_path, data):
    r = run_script(smoke_args(data, tmp_path, "--ws-schedule", "-3,0,2", "--check-flags"), cwd=tmp_path)
    line = assert_one_line_error(r, "--ws-schedule", "[1, inf)", "-3,0,2")
    assert "expected one argument" not in line and r.stdout == ""
    assert list(tmp_path.iterdir()) == []
    # the rest of OUT_OF_RANGE, under --check-flags and --check: through main() in this process, above


def test_minus_inf_after_its_flag_reaches_the_range_check(main, tmp_path):
    line = refused(main(["--muon-lr", "-inf", "--smoke", "--device", "cpu", "--check-flags",
                         "--log-dir", str(tmp_path / "logs")]), "--muon-lr")
    assert "expected one argument" not in line


def test_negative_values_that_are_in_range_are_taken(main, tmp_path):
    assert tg.parse_args(["--seed", "-1"]).seed == -1
    assert tg.parse_args(["--seed=-1"]).seed == -1
    status, out, err = main(["--seed", "-1", "--smoke", "--device", "cpu", "--check-flags",
                             "--log-dir", str(tmp_path / "logs")])
    assert status == 0 and out.startswith("check: ok:") and err == "", (out, err)


NUMERIC_FIELDS = [f for f in dataclasses.fields(tg.Hyperparameters)
                  if type(f.default[0] if isinstance(f.default, tuple) else f.default) in (int, float)]


def test_every_numeric_setting_declares_its_valid_range():
    assert len(NUMERIC_FIELDS) > 20
    for f in NUMERIC_FIELDS:
        assert f.metadata["within"] is not None, f.name


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_every_numeric_setting_refuses_a_non_finite_value_naming_its_flag(bad):
    for f in NUMERIC_FIELDS:
        values = list(f.default) if isinstance(f.default, tuple) else [f.default]
        values[-1] = bad
        with pytest.raises(tg.ConfigError, match=re.escape(tg.flag_name(f.name))):
            tg.parse_args([tg.flag_name(f.name), ",".join(map(str, values))])


# ----------------------------------------------------------------------------------------------------
# --run-id names a file in --log-dir and nothing else; an existing log is never written over unasked
# ----------------------------------------------------------------------------------------------------

BAD_RUN_IDS = ["../requirements", "../x", "a/b", "/tmp/x", "..", ".hidden", "a b", "x" * 201]


@pytest.fixture
def beside_logs(tmp_path):
    """A folder holding a copy of the repository's requirements.txt and the --log-dir, logs/, not made yet: run id
    ../requirements would name that copy."""
    (tmp_path / "requirements.txt").write_bytes((REPO / "requirements.txt").read_bytes())
    return tmp_path


@pytest.mark.parametrize("extra", [(), ("--replace-log",), ("--check",), ("--check", "--replace-log")],
                         ids=["run", "run --replace-log", "check", "check --replace-log"])
@pytest.mark.parametrize("run_id", BAD_RUN_IDS)
def test_a_run_id_that_is_not_a_plain_name_is_refused_and_nothing_is_written(main, data, beside_logs, run_id, extra):
    repo_requirements = sha256(REPO / "requirements.txt")
    before = tree(beside_logs)
    refused(main(tiny_args(data, beside_logs / "logs", "--run-id", run_id, *extra)), "--run-id", repr(run_id))
    assert tree(beside_logs) == before  # the copy of requirements.txt byte-identical, no logs/, no x.txt
    assert sha256(REPO / "requirements.txt") == repo_requirements


def test_the_script_refuses_a_run_id_leaving_its_folder_even_with_replace_log(data, beside_logs):
    before = tree(beside_logs)
    repo_requirements = sha256(REPO / "requirements.txt")
    r = run_script(tiny_args(data, beside_logs / "logs", "--run-id", "../requirements", "--replace-log"),
                   cwd=beside_logs)
    assert_one_line_error(r, "--run-id", "'../requirements'", "plain file name")
    assert r.stdout == "" and tree(beside_logs) == before
    assert sha256(REPO / "requirements.txt") == repo_requirements


def test_an_empty_run_id_is_taken_and_the_log_gets_a_uuid_name(main, data, tmp_path):
    assert tg.parse_args(["--run-id="]).run_id == ""
    status, out, err = main(tiny_args(data, tmp_path / "logs", "--run-id=", "--check"))
    assert status == 0 and out.startswith("check: ok:"), (out, err)
    assert list(tmp_path.iterdir()) == []
    # a training run without a run id, named by a UUID4: test_a_non_finite_training_loss_stops_the_run_with_exit_3


@pytest.mark.parametrize("flag", ["--run-id", "--compile-cache"])
def test_an_empty_value_after_its_flag_is_taken(flag):
    assert getattr(tg.parse_args([flag, ""]), flag[2:].replace("-", "_")) == ""


@pytest.mark.parametrize("mode", [(), ("--check",)], ids=["run", "check"])
def test_an_existing_log_of_the_run_id_is_refused_and_left_byte_identical(main, data, tmp_path, mode):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "taken.txt").write_bytes(b"an earlier run's log\n")
    before = tree(tmp_path)
    line = refused(main(tiny_args(data, logs, "--run-id", "taken", *mode)), str(logs / "taken.txt"), "--replace-log")
    assert "--run-id taken" in line
    assert tree(tmp_path) == before


@pytest.mark.parametrize("mode", [(), ("--check",)], ids=["run", "check"])
def test_an_existing_checkpoint_folder_of_the_run_id_is_refused_and_left_as_it_was(main, data, tmp_path, mode):
    logs = tmp_path / "logs"
    (logs / "taken").mkdir(parents=True)
    (logs / "taken" / "state_step000004.pt").write_bytes(b"a checkpoint")
    before = tree(tmp_path)
    refused(main(tiny_args(data, logs, "--run-id", "taken", *mode)), str(logs / "taken"), "--replace-log")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("extra", [(), ("--replace-log",)], ids=["run", "run --replace-log"])
def test_a_folder_where_the_log_would_go_is_refused_as_such_and_replace_log_is_not_offered(main, data, tmp_path,
                                                                                         extra):
    logs = tmp_path / "logs"
    (logs / "taken.txt").mkdir(parents=True)
    before = tree(tmp_path)
    line = refused(main(tiny_args(data, logs, "--run-id", "taken", *extra)), str(logs / "taken.txt"),
                   "is not a file")
    assert "--replace-log" not in line
    assert tree(tmp_path) == before


EARLIER_LOG = tg.LOG_SIGNATURE.encode() + b" an earlier run's log (the script's source first)\n"


def test_check_with_replace_log_accepts_an_existing_log_and_writes_nothing(main, data, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "taken.txt").write_bytes(EARLIER_LOG)
    before = tree(tmp_path)
    status, out, err = main(tiny_args(data, logs, "--run-id", "taken", "--replace-log", "--check"))
    assert status == 0 and out.startswith("check: ok:"), (out, err)
    assert tree(tmp_path) == before
    # a real run with --replace-log replaces it: test_sigterm_during_training_... (a run over an existing log)


# ----------------------------------------------------------------------------------------------------
# --replace-log and --compile-cache replace only what this trainer wrote; a run id is held for the run's life
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [(), ("--check",)], ids=["run", "check"])
def test_replace_log_refuses_a_file_that_is_not_one_of_our_logs_and_leaves_it_byte_identical(main, data, beside_logs,
                                                                                             mode):
    """--log-dir . --run-id requirements --replace-log, beside a copy of requirements.txt."""
    before = tree(beside_logs)
    refused(main(tiny_args(data, beside_logs, "--run-id", "requirements", "--replace-log", *mode)),
            str(beside_logs / "requirements.txt"), "is not a log of this trainer", "--replace-log replaces only those")
    assert tree(beside_logs) == before


@pytest.mark.parametrize("mode", [(), ("--check",)], ids=["run", "check"])
def test_replace_log_refuses_a_checkpoint_folder_holding_other_files(main, data, tmp_path, mode):
    logs = tmp_path / "logs"
    (logs / "mine").mkdir(parents=True)
    (logs / "mine.txt").write_bytes(EARLIER_LOG)
    (logs / "mine" / "state_step000003.pt").write_bytes(b"a checkpoint")
    (logs / "mine" / "notes.md").write_text("the user's notes")
    before = tree(tmp_path)
    refused(main(tiny_args(data, logs, "--run-id", "mine", "--replace-log", *mode)), str(logs / "mine"),
            "holds files other than this trainer's checkpoints")
    assert tree(tmp_path) == before


def test_replace_log_replaces_the_checkpoint_folder_whole(main, data, tmp_path):
    logs = tmp_path / "logs"
    (logs / "mine").mkdir(parents=True)
    (logs / "mine.txt").write_bytes(EARLIER_LOG)
    (logs / "mine" / "state_step000003.pt").write_bytes(b"the earlier run's checkpoint")
    status, out, err = main(tiny_args(data, logs, "--run-id", "mine", "--replace-log", "--save-checkpoint"))
    assert status == 0, err
    assert sorted(os.listdir(logs)) == ["mine", "mine.txt"] and os.listdir(logs / "mine") == ["state_step000004.pt"]
    assert torch.load(logs / "mine" / "state_step000004.pt", weights_only=False)["step"] == 4
    assert log_text(logs / "mine.txt").startswith(SCRIPT.read_text())


@pytest.mark.parametrize("mode", [(), ("--check",)], ids=["run", "check"])
def test_a_compile_cache_that_is_not_one_of_our_bundles_is_refused_and_left_byte_identical(main, data, tmp_path, mode):
    (tmp_path / "README.md").write_text("# a readme, not a bundle\n")
    before = tree(tmp_path)
    refused(main(tiny_args(data, tmp_path / "logs", "--compile-cache", str(tmp_path / "README.md"), *mode)),
            "--compile-cache", "is not a compile-cache bundle of this trainer")
    assert tree(tmp_path) == before


def test_the_bundle_is_written_only_where_there_is_none_or_one_of_ours(tmp_path, monkeypatch):
    """The save path forced on the CPU: PyTorch's artifacts stood in, as after a warm-up that compiled."""
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"compiled graphs", None))
    for var in tg.COMPILE_CACHE_DIRS:
        monkeypatch.delenv(var, raising=False)
    bundle, foreign = tmp_path / "cache.zip", tmp_path / "README.md"
    foreign.write_text("# appeared after the check\n")
    before = sha256(foreign)
    assert tg.save_compile_cache(foreign) == f"compile cache: {foreign} is not a bundle of this trainer; not written over"
    assert sha256(foreign) == before
    assert tg.save_compile_cache(bundle).startswith(f"compile cache: wrote {bundle}") and tg.is_our_bundle(bundle)
    first = sha256(bundle)
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"more compiled graphs", None))
    assert tg.save_compile_cache(bundle).startswith(f"compile cache: wrote {bundle}") and sha256(bundle) != first
    assert sorted(os.listdir(tmp_path)) == ["README.md", "cache.zip"]  # no temporary file left


@pytest.mark.parametrize("extra", [(), ("--replace-log",), ("--check",), ("--check", "--replace-log")],
                         ids=["run", "run --replace-log", "check", "check --replace-log"])
def test_a_run_id_held_by_a_run_still_going_is_refused(main, data, tmp_path, extra):
    logs = tmp_path / "logs"
    lock = tg.RunLock.acquire(logs / "busy.txt")  # as the other run's rank 0 holds it, in a process of its own:
    tg.RunLock.held = None  # not this process's run
    try:
        before = tree(tmp_path)
        refused(main(tiny_args(data, logs, "--run-id", "busy", *extra)), "--run-id busy is in use by a run still going",
                f"pid {os.getpid()}")
        assert tree(tmp_path) == before
    finally:
        lock.release()
    assert list(tmp_path.iterdir()) == []  # the lock made the folder, and took it away with itself


def test_a_stale_lock_of_a_killed_run_is_taken_over_and_a_foreign_lock_file_is_refused(main, data, tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "stale.lock").write_bytes(tg.RunLock.SIGNATURE + b"pid 1 on a machine long gone\n")
    status, out, err = main(tiny_args(data, logs, "--run-id", "stale"))
    assert status == 0, err
    assert sorted(os.listdir(logs)) == ["stale.txt"]
    (logs / "foreign.lock").write_text("a file of the user's\n")
    before = tree(tmp_path)
    for mode in ((), ("--check",)):
        refused(main(tiny_args(data, logs, "--run-id", "foreign", *mode)), str(logs / "foreign.lock"),
                "is not a run lock of this trainer")
        assert tree(tmp_path) == before


# ----------------------------------------------------------------------------------------------------
# output and data paths that cannot work: refused up front
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [(), ("--check",)], ids=["run", "check"])
def test_a_compile_cache_that_names_a_folder_is_refused_up_front(main, data, tmp_path, mode):
    folder = tmp_path / "caches"
    folder.mkdir()
    refused(main(tiny_args(data, tmp_path / "logs", "--compile-cache", str(folder), *mode)),
            "--compile-cache", str(folder), "is a folder")
    assert list(folder.iterdir()) == [] and not (tmp_path / "logs").exists()
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("mode", [(), ("--check",)], ids=["run", "check"])
def test_a_compile_cache_inside_a_file_is_refused_up_front(main, data, tmp_path, mode):
    (tmp_path / "notes").write_text("a file")
    bundle = tmp_path / "notes" / "cache.zip"
    refused(main(tiny_args(data, tmp_path / "logs", "--compile-cache", str(bundle), *mode)),
            "--compile-cache", str(tmp_path / "notes"), "is a file")
    assert (tmp_path / "notes").read_text() == "a file" and not (tmp_path / "logs").exists()
    assert not list(tmp_path.rglob("*.tmp"))


def test_the_script_refuses_a_compile_cache_folder_before_training(tmp_path, data):
    (tmp_path / "caches").mkdir()
    r = run_script(tiny_args(data, tmp_path / "logs", "--compile-cache", str(tmp_path / "caches")), cwd=tmp_path)
    assert_one_line_error(r, "--compile-cache", "is a folder")
    assert r.stdout == "" and tree(tmp_path) == {"caches": None}


@pytest.mark.parametrize("mode", [(), ("--check",)], ids=["run", "check"])
def test_a_data_path_that_is_a_file_says_so(main, tmp_path, mode):
    (tmp_path / "shards.bin").write_bytes(b"\0" * 16)
    refused(main(tiny_args(tmp_path / "shards.bin", tmp_path / "logs", *mode)),
            f"--data-path {tmp_path / 'shards.bin'} is a file")
    assert not (tmp_path / "logs").exists()


def test_a_config_error_from_the_model_or_optimizer_build_leaves_no_log(main, data, tmp_path, monkeypatch):
    built = tg.GPT.__init__

    def with_a_stray_parameter(self, *args, **kwargs):  # a speedrunner's new parameter, never labelled
        built(self, *args, **kwargs)
        self.stray = nn.Parameter(torch.zeros(4))

    monkeypatch.setattr(tg.GPT, "__init__", with_a_stray_parameter)
    refused(main(tiny_args(data, tmp_path / "logs", "--run-id", "stray")), "parameter stray", "no optimizer label",
            "set_optimizer_label(p, LABEL, TREATMENT)", *(f"{t} (" for t in tg.TREATMENTS))
    assert not (tmp_path / "logs").exists()


def test_a_signal_while_the_log_header_is_written_closes_the_log_while_starting(main, data, tmp_path, monkeypatch):
    def nvidia_smi():  # the signal arrives while nvidia-smi runs
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
        return "nvidia-smi: not available\n"

    monkeypatch.setattr(tg, "nvidia_smi", nvidia_smi)
    status, out, err = main(tiny_args(data, tmp_path / "logs", "--run-id", "starting"))
    assert status == 143 and err == "", err
    assert out.splitlines()[-1] == "interrupted by SIGTERM while starting", out
    assert last_line(log_text(tmp_path / "logs" / "starting.txt")) == "interrupted by SIGTERM while starting"
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["starting.txt"]  # the lock went with the run


# ----------------------------------------------------------------------------------------------------
# NonFiniteLossWatch and the run's stop statuses
# ----------------------------------------------------------------------------------------------------

def test_the_watch_stops_a_step_after_a_non_finite_loss_and_never_for_finite_ones():
    for bad in (math.nan, math.inf, -math.inf):
        watch = tg.NonFiniteLossWatch("cpu", master=True)
        for step in range(5):
            watch.after_step(step, torch.tensor(10.0 - step))
        watch.after_step(5, torch.tensor(bad))  # the step's loss is counted; its copy is read at the next step
        with pytest.raises(tg.TrainingDiverged, match=r"^stopped at step 6: its training loss is not finite$"):
            watch.after_step(6, torch.tensor(1.0))
    finite = tg.NonFiniteLossWatch("cpu", master=True)
    for step in range(200):
        finite.after_step(step, torch.tensor(1e30 * (-1) ** step))  # large, but finite
    other_rank = tg.NonFiniteLossWatch("cpu", master=False)  # rank 0 speaks; the launcher ends the others
    for step in range(5):
        other_rank.after_step(step, torch.tensor(math.nan))


def test_run_stops_carry_their_exit_statuses():
    assert tg.TrainingDiverged("stopped").status == 3
    assert (tg.Interrupted(signal.SIGINT).status, str(tg.Interrupted(signal.SIGINT))) == (130, "interrupted by SIGINT")
    assert (tg.Interrupted(signal.SIGTERM).status, str(tg.Interrupted(signal.SIGTERM))) == (143,
                                                                                            "interrupted by SIGTERM")
    assert all(issubclass(c, tg.RunStopped) for c in (tg.TrainingDiverged, tg.Interrupted))


# ----------------------------------------------------------------------------------------------------
# real runs, side by side: a loss that goes non-finite, and SIGINT / SIGTERM while training or warming up
# ----------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Launch:
    argv: list
    log: Path = None                 # the log to watch, where the run id is known
    signum: int = None               # sent once `when` holds
    when: object = None              # when(log text, stdout so far) -> bool
    proc: subprocess.Popen = None
    out: list = dataclasses.field(default_factory=list)
    err: list = dataclasses.field(default_factory=list)
    signalled_at: str = None         # the log's last line when the signal went
    left_running: list = None        # processes of its group alive after it exited
    start_after: tuple = None        # (another launch's name, when(its log text, its stdout)): started once it holds


def log_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return ""


def last_line(text: str) -> str:
    lines = text.rstrip("\n").split("\n")
    return lines[-1] if lines else ""


def run_side_by_side(launches: dict, deadline_s: float = 240.0) -> dict:
    """Start every launch as a process group of its own, send each its signal once its condition holds, and wait
    for all (a group still running at the deadline is killed, and the caller's asserts say so)."""
    def drain(stream, into):
        for line in stream:
            into.append(line)

    def start(launch):
        launch.proc = subprocess.Popen([sys.executable, str(SCRIPT), *launch.argv], env=child_env(), text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        STARTED_GROUPS.add(launch.proc.pid)
        for stream, into in ((launch.proc.stdout, launch.out), (launch.proc.stderr, launch.err)):
            threading.Thread(target=drain, args=(stream, into), daemon=True).start()

    waiting = {name: launch for name, launch in launches.items() if launch.start_after}
    for launch in launches.values():
        if not launch.start_after:
            start(launch)
    end = time.monotonic() + deadline_s
    try:
        while time.monotonic() < end and (waiting or any(l.proc.poll() is None for l in launches.values()
                                                         if l.proc is not None)):
            for name, launch in list(waiting.items()):
                other, when = launch.start_after
                if when(log_text(launches[other].log), "".join(launches[other].out)):
                    start(waiting.pop(name))
            for launch in launches.values():
                if launch.proc is None or launch.signum is None or launch.signalled_at is not None or \
                        launch.proc.poll() is not None:
                    continue
                text = log_text(launch.log)
                if launch.when(text, "".join(launch.out)):
                    launch.signalled_at = last_line(text)
                    launch.proc.send_signal(launch.signum)
            time.sleep(0.1)
    finally:
        for launch in launches.values():
            if launch.proc is None:  # its condition never held: the asserts say so
                continue
            if launch.proc.poll() is None:
                kill_group(launch.proc.pid)
            launch.proc.wait()
            time.sleep(0.2)  # the readers reach the end of the pipes
            launch.left_running = group_members(launch.proc.pid)
            kill_group(launch.proc.pid)
    return launches


def training_started(text: str, out: str) -> bool:
    return re.search(r"^step:1/\d+ train_time", text, re.M) is not None


def warming_up(text: str, out: str) -> bool:
    return "warm-up: eager train steps" in out


@pytest.fixture(scope="module")
def runs(data, tmp_path_factory):
    logs = tmp_path_factory.mktemp("runs") / "logs"
    logs.mkdir()
    (logs / "replaced.txt").write_bytes(EARLIER_LOG)
    endless = ["--num-scheduled-iterations", "10000", "--train-epochs", "1000"]  # runs until signalled
    launches = dict(
        diverged=Launch(tiny_args(data, logs / "diverged", "--adam-lr", "1e30", "--muon-lr", "1e30")),
        sigint=Launch(tiny_args(data, logs, "--run-id", "sigint", *endless), logs / "sigint.txt",
                      signal.SIGINT, training_started),
        sigterm=Launch(tiny_args(data, logs, "--run-id", "replaced", "--replace-log", *endless),
                       logs / "replaced.txt", signal.SIGTERM, training_started),
        # three stages: after the first stage's warm-up line come two more stages and five evaluations
        warm_up=Launch(tiny_args(data, logs, "--run-id", "warm_up", *endless, "--train-bs-schedule", "128,128,128",
                                 "--ws-schedule", "3,3,3", "--lr-plateaus", "1,1,1", "--lr-plateau-starts",
                                 "0,0.3,0.6"), logs / "warm_up.txt", signal.SIGINT, warming_up),
        sighup=Launch(tiny_args(data, logs, "--run-id", "sighup", *endless), logs / "sighup.txt", signal.SIGHUP,
                      training_started),
        # a run of run id "held" that trains to its end, and a second one, with --replace-log, while the first trains
        held=Launch(tiny_args(data, logs, "--run-id", "held", "--num-scheduled-iterations", "40", "--train-epochs",
                              "100"), logs / "held.txt"),
        second=Launch(tiny_args(data, logs, "--run-id", "held", "--replace-log"), logs / "held.txt",
                      start_after=("held", training_started)),
    )
    return run_side_by_side(launches)


def console_of(launch) -> tuple[str, str]:
    return "".join(launch.out), "".join(launch.err)


def test_a_non_finite_training_loss_stops_the_run_with_exit_3(runs):
    launch = runs["diverged"]
    out, err = console_of(launch)
    assert launch.proc.returncode == 3, (out[-2000:], err[-2000:])
    assert "Traceback" not in out + err and launch.left_running == []
    [log] = (Path(launch.argv[launch.argv.index("--log-dir") + 1])).iterdir()
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}\.txt", log.name)  # UUID4
    text = log.read_text()
    assert re.fullmatch(r"stopped at step \d+: its training loss is not finite", last_line(text)), last_line(text)
    assert not any(ln.startswith("summary:") for ln in text.splitlines())
    assert [ln for ln in (out + err).splitlines() if "stopped at step" in ln] == [last_line(text)]


@pytest.mark.parametrize("name,signame", [("sigint", "SIGINT"), ("sigterm", "SIGTERM"), ("sighup", "SIGHUP")])
def test_a_signal_during_training_closes_the_log_with_one_line_and_exits_128_plus_its_number(runs, name, signame):
    launch = runs[name]
    out, err = console_of(launch)
    assert launch.signalled_at is not None, f"training never started: {out[-2000:]} {err[-2000:]}"
    assert launch.proc.returncode == 128 + getattr(signal, signame), (out[-2000:], err[-2000:])
    assert "Traceback" not in out + err and launch.left_running == []
    text = log_text(launch.log)
    m = re.fullmatch(rf"interrupted by {signame} at step (\d+)", last_line(text))
    assert m, last_line(text)
    # the step it was in: the one after the last step logged (or that one, caught before the loop moved on)
    logged = [int(s) for s in re.findall(r"^step:(\d+)/\d+ train_time", text, re.M)]
    assert logged and int(m[1]) in (logged[-1], logged[-1] - 1), (m[0], logged[-3:])
    assert [ln for ln in (out + err).splitlines() if "interrupted" in ln] == [last_line(text)]


def test_replace_log_replaces_an_earlier_log_of_the_run_id(runs):
    text = log_text(runs["sigterm"].log)
    assert text.startswith(SCRIPT.read_text()) and "an earlier run's log" not in text


def test_a_signal_during_the_warm_up_closes_the_log_with_one_line(runs):
    launch = runs["warm_up"]
    out, err = console_of(launch)
    assert launch.signalled_at is not None, f"the warm-up never started: {out[-2000:]} {err[-2000:]}"
    assert launch.proc.returncode == 130, (out[-2000:], err[-2000:])
    assert "Traceback" not in out + err and launch.left_running == []
    text = log_text(launch.log)
    assert last_line(text) == "interrupted by SIGINT during the warm-up"
    assert [ln for ln in (out + err).splitlines() if "interrupted" in ln] == [last_line(text)]


def test_a_second_run_of_a_run_id_still_training_is_refused_and_the_first_log_is_whole(runs):
    first, second = runs["held"], runs["second"]
    assert second.proc is not None, "the first run never trained"
    out, err = console_of(second)
    assert second.proc.returncode == 2 and out == "", (out, err)
    assert re.fullmatch(r"error: --run-id held is in use by a run still going \(pid \d+ on .+\): wait for it to end, "
                        r"or pick another --run-id\n", err), err
    assert first.proc.returncode == 0, console_of(first)
    text = log_text(first.log)
    assert text.startswith(SCRIPT.read_text()) and last_line(text).startswith("summary: val_loss ")
    assert len(re.findall(r"^step:\d+/40 train_time", text, re.M)) == 40  # every step, once
    assert not (first.log.parent / "held.lock").exists()


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_leaves_no_empty_folder(main, data, tmp_path,
                                                                                  monkeypatch):
    def full_disk(obj, f, *args, **kwargs):  # torch.save's own report of a failed write
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 64 vs 0\n"
                           "PytorchStreamWriter failed writing file data/0: file write failed")

    monkeypatch.setattr(torch, "save", full_disk)
    logs = tmp_path / "logs"
    status, out, err = main(tiny_args(data, logs, "--run-id", "ck", "--save-checkpoint"))
    said = f"{logs / 'ck' / 'state_step000004.pt'}: cannot write the checkpoint, "
    assert status == tg.OUTPUT_FAILED and len(err.splitlines()) == 1, err
    assert re.fullmatch(rf"error: {re.escape(said)}\d+ MiB free there \(torch.save: PytorchStreamWriter failed "
                        r"writing file data/0: file write failed\)", err.strip()), err
    assert sorted(os.listdir(logs)) == ["ck.txt"]  # no folder, no temporary file
    assert last_line(log_text(logs / "ck.txt")).startswith(f"stopped while saving the checkpoint: {said}")


def test_a_checkpoint_is_as_readable_as_the_log(main, data, tmp_path):
    logs = tmp_path / "logs"
    status, out, err = main(tiny_args(data, logs, "--run-id", "ck", "--save-checkpoint"))
    assert status == 0, err
    mode = lambda p: p.stat().st_mode & 0o777
    assert mode(logs / "ck" / "state_step000004.pt") == mode(logs / "ck.txt") == 0o666 & ~current_umask()


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def test_a_run_stop_passes_through_code_that_catches_exceptions():
    """A signal's Interrupted, raised inside a library that catches Exception (Dynamo's lazy imports do), reaches
    main() all the same."""
    for stop in (tg.Interrupted(signal.SIGINT), tg.LauncherDied(), tg.PeerGone(), tg.TrainingDiverged("x")):
        with pytest.raises(tg.RunStopped):
            try:
                raise stop
            except Exception:  # what a library does
                pass


def test_the_launchers_sigterm_while_a_stop_is_written_keeps_that_stops_status_and_last_line(main, data, tmp_path,
                                                                                             monkeypatch):
    """torchrun stops the other ranks with SIGTERM once one has ended: a SIGTERM that reaches a rank while it writes
    its own stop (here a non-finite loss) changes neither its exit status nor its log's last line."""
    close = tg.Logger.close

    def close_under_sigterm(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler runs here
        return close(self, *args, **kwargs)

    monkeypatch.setattr(tg.Logger, "close", close_under_sigterm)
    status, out, err = main(tiny_args(data, tmp_path / "logs", "--run-id", "diverged", "--adam-lr", "1e30",
                                      "--muon-lr", "1e30"))
    text = log_text(tmp_path / "logs" / "diverged.txt")
    assert status == tg.TrainingDiverged.status and "Traceback" not in out + err, (status, out[-2000:], err)
    assert re.fullmatch(r"stopped at step \d+: its training loss is not finite", last_line(text)), last_line(text)


def test_a_second_signal_while_the_first_one_stops_the_run_adds_nothing(main, data, tmp_path, monkeypatch):
    def nvidia_smi():  # Ctrl-C, and the launcher's SIGTERM right behind it, both before the first is handled
        # (sent from another process while this one waits in C: no Python runs between the two)
        subprocess.run(["bash", "-c", f"kill -INT {os.getpid()}; kill -TERM {os.getpid()}"], check=True)
        time.sleep(5)
        return "nvidia-smi: not available\n"

    monkeypatch.setattr(tg, "nvidia_smi", nvidia_smi)
    status, out, err = main(tiny_args(data, tmp_path / "logs", "--run-id", "twice"))
    assert status in (130, 143) and err == "", err
    text = log_text(tmp_path / "logs" / "twice.txt")
    assert last_line(text) in ("interrupted by SIGINT while starting", "interrupted by SIGTERM while starting")
    assert out.splitlines()[-1] == last_line(text) and "Traceback" not in out + err
