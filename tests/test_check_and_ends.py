"""--check proves what it can, in time that does not grow with the schedule; every other end is one line.

Absurd counts, sizes, seeds and learning rates, a model too large for the machine, bad shards (a FIFO, ids past the
vocabulary, 32-bit tokens, no document starts, a glob that takes the validation shard), symbolic-link loops and
launcher variables that describe no process: each is refused by --check in one line, exit 2, writing nothing. Running
out of memory or of disk at run time ends in one line too, and a signal from the first import on exits 128+N with one
line. Everything runs through train_gpt.main() in this process (the `main` fixture) but the signals, which need a
process of their own.
"""
import builtins
import dataclasses
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt as tg
from processes import STARTED_GROUPS, kill_group
from proxy_shards import shard_bytes, write_shard
# main: the fixture that runs train_gpt.main in this process; data: tiny shards
from test_cli_and_errors import SCRIPT, child_env, main, refused  # noqa: F401
from test_run_guards import data, tiny_args  # noqa: F401


def copy_data(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def train_tokens(data: Path) -> np.ndarray:
    return np.fromfile(data / "fineweb_train_000001.bin", dtype="<u2", offset=tg.HEADER_INTS * 4)


# ----------------------------------------------------------------------------------------------------
# absurd settings: refused by --check in one line, within seconds whatever the schedule's length
# ----------------------------------------------------------------------------------------------------

ABSURD = [  # (flags, what the one line says)
    (["--num-scheduled-iterations", "1000000000"], "too little training data"),  # hung, summing step by step
    (["--num-extension-iterations", "1000000000000"], "--num-extension-iterations must be at most 2147483647"),
    (["--seed", "18446744073709551616"], "--seed must be at most 18446744073709551615"),
    (["--train-epochs", "100000000000"], "--train-epochs must be at most 2147483647"),
    (["--block-size", "100000000000000000000"], "--block-size must be at most 2147483647"),
    (["--block-size", "200000000"], "the longest attention window, 20 blocks of --block-size 200000000"),
    (["--lr-plateaus", "1e300"], "past float32's largest"),
    (["--adam-lr", "1e300"], "--adam-lr 1e+300"),
    (["--muon-lr", "1e39"], "--muon-lr 1e+39"),
    (["--adam-eps", "1e-50"], "--adam-eps 1e-50 is below the smallest normal float32"),
    (["--model-dim", "1000000", "--head-dim", "1000000"], "the model's parameters, gradients and optimizer states"),
    (["--val-loss", "5"], "unrecognized arguments: --val-loss 5"),  # not taken for --val-loss-every
]


@pytest.mark.parametrize("argv,says", ABSURD, ids=[" ".join(a) for a, _ in ABSURD])
def test_an_absurd_setting_is_refused_by_check_in_one_line_within_seconds(main, data, tmp_path, argv, says):
    t0 = time.monotonic()
    refused(main(tiny_args(data, tmp_path / "logs", *argv, "--check")), says)
    assert time.monotonic() - t0 < 20
    assert list(tmp_path.iterdir()) == []


def test_a_schedule_of_two_billion_steps_is_checked_as_fast_as_a_short_one(main, data, tmp_path):
    t0 = time.monotonic()
    status, out, err = main(tiny_args(data, tmp_path / "logs", "--check", "--num-scheduled-iterations", "2000000000",
                                      "--train-epochs", "2147483647", "--seed", "18446744073709551615"))
    assert (status, err) == (0, "") and out.startswith("check: ok:"), (out, err)
    assert time.monotonic() - t0 < 20


def test_the_tokens_a_schedule_needs_are_the_sum_over_its_steps():
    for n, e, sizes in ((12, 3, (8, 16, 24)), (7, 0, (4, 9)), (2120, 40, (131072, 262144, 393216)), (5, 9, (3,))):
        k = len(sizes)
        args = tg.Hyperparameters(num_scheduled_iterations=n, num_extension_iterations=e, train_bs_schedule=sizes,
                                  train_bs_extension=5, ws_schedule=(3,) * k, lr_plateaus=(1.0,) * k,
                                  lr_plateau_starts=tuple(i / (k + 1) for i in range(k)))
        assert tg.tokens_needed(args) == sum(tg.stage_at(step, args).batch_size for step in range(args.num_iterations))


# ----------------------------------------------------------------------------------------------------
# bad shards: refused by --check (one pass over every token), never trained on silently
# ----------------------------------------------------------------------------------------------------

def fifo_val(data):
    (data / "fineweb_val_000000.bin").unlink()
    os.mkfifo(data / "fineweb_val_000000.bin")


def id_past_the_vocabulary(data):
    tokens = train_tokens(data).copy()
    tokens[5000] = 50300
    write_shard(data / "fineweb_train_000001.bin", tokens)


def thirty_two_bit_tokens(data):  # the header counts the uint16 halves: the size matches it
    tokens = train_tokens(data)
    (data / "fineweb_train_000001.bin").write_bytes(shard_bytes([], num_tokens=2 * len(tokens)) +
                                                    tokens.astype("<u4").tobytes())


def no_document_starts(data):
    tokens = train_tokens(data).copy()
    tokens[tokens == tg.BOS_ID] = 7
    write_shard(data / "fineweb_train_000001.bin", tokens)


BAD_SHARDS = [
    (fifo_val, (), "is not a regular file"),
    (id_past_the_vocabulary, (), "holds token id 50300 at position 5000, not below --vocab-size 50257"),
    (thirty_two_bit_tokens, (), "every other token id is 0"),
    (no_document_starts, (), "holds no <|endoftext|>"),
    (None, ("--train-files", "fineweb_*.bin"), "matches both --train-files"),
]


@pytest.mark.parametrize("mode", [("--check",), ()], ids=["check", "run"])
@pytest.mark.parametrize("spoil,extra,says", BAD_SHARDS, ids=["fifo", "vocabulary", "32-bit", "no-bos", "overlap"])
def test_a_bad_shard_is_refused_in_one_line_by_check_and_by_a_run_started_without_it(main, data, tmp_path, spoil,
                                                                                      extra, says, mode):
    bad = copy_data(data, tmp_path / "data")
    if spoil:
        spoil(bad)
    before = {p.name: (p.read_bytes() if p.is_file() else None) for p in bad.iterdir()}
    refused(main(tiny_args(bad, tmp_path / "logs", *extra, *mode)), says)
    assert {p.name: (p.read_bytes() if p.is_file() else None) for p in bad.iterdir()} == before
    assert not (tmp_path / "logs").exists()


def test_the_workers_of_run_sh_launch_leave_the_scan_to_its_check(main, data, tmp_path, monkeypatch):
    bad = copy_data(data, tmp_path / "data")
    id_past_the_vocabulary(bad)
    scanned = []
    monkeypatch.setattr(tg, "scan_shard", lambda *a, **k: scanned.append(a))
    monkeypatch.setenv(tg.LAUNCHER_PID_ENV, str(os.getppid()))  # as ./run.sh launch names itself, after --check
    monkeypatch.setattr(tg.Trainer, "warm_up_kernels", lambda self: (_ for _ in ()).throw(tg.Interrupted(2)))
    status, out, err = main(tiny_args(bad, tmp_path / "logs", "--run-id", "x"))
    assert status == 130 and scanned == [], (out, err)


def test_a_schedule_longer_than_the_documents_can_feed_is_refused_before_it_starts(main, data, tmp_path):
    """40,000 tokens of ~300-token documents hold the tokens of 300 steps of 128, but each micro-batch of 16 takes
    whole documents: the loader runs out long before, and the check says at which step."""
    line = refused(main(tiny_args(data, tmp_path / "logs", "--num-scheduled-iterations", "300")),
                   "too little training data: taking whole documents for each micro-batch (cut at "
                   "--train-max-seq-len 64), the loader runs out at step")
    assert int(line.split(" runs out at step ")[1].split()[0]) < 300
    assert not (tmp_path / "logs").exists()


def test_the_data_check_follows_the_loader_step_for_step(tmp_path):
    """Where data_runs_out_at says the training data runs out is where the loader itself raises DataExhausted, for
    random documents, shards, stages, world sizes and epochs (one rank's generator stands for all: they share the
    cursor)."""
    rng = np.random.default_rng(0)
    for trial in range(25):
        files = []
        for k in range(int(rng.integers(1, 3))):
            docs = [np.concatenate([[tg.BOS_ID], rng.integers(0, 50000, size=int(rng.integers(1, 300)))])
                    for _ in range(int(rng.integers(5, 60)))]
            lead = rng.integers(0, 500, size=7) if rng.random() < 0.3 else np.zeros(0, dtype=np.int64)
            files.append(str(write_shard(tmp_path / f"t{trial}_{k}.bin", np.concatenate([lead, *docs]))))
        world = int(rng.choice([1, 2, 4, 8]))
        stages = int(rng.integers(1, 4))
        args = tg.Hyperparameters(
            num_scheduled_iterations=int(rng.integers(stages, 60)), num_extension_iterations=int(rng.integers(0, 5)),
            train_bs_schedule=tuple(int(b) * 8 for b in rng.integers(2, 40, size=stages)),
            train_bs_extension=int(rng.integers(2, 40)) * 8, ws_schedule=(3,) * stages, lr_plateaus=(1.0,) * stages,
            lr_plateau_starts=tuple(i / (stages + 1) for i in range(stages)),
            train_max_seq_len=int(rng.integers(8, 200)), train_epochs=int(rng.integers(1, 4)))
        runtime = dataclasses.make_dataclass("R", ["world_size", "grad_accum_steps"])(world, 8 // world)
        predicted = tg.data_runs_out_at(args, runtime, [tg.scan_shard(f, args.vocab_size) for f in files])
        assert predicted == loader_runs_out_at(args, files, runtime), (trial, world)


def loader_runs_out_at(args, files, runtime):
    accum, previous = runtime.grad_accum_steps, None
    batches = tg.distributed_data_generator(files, args.train_bs_schedule[0], args.train_max_seq_len, accum, 0,
                                            runtime.world_size, args.train_epochs)
    for step in range(args.num_iterations):
        bs = tg.stage_at(step, args).batch_size
        for micro in range(accum):
            try:
                if previous is None:
                    next(batches)
                else:
                    batches.send((bs, args.train_max_seq_len, accum) if micro == 0 and bs != previous else None)
            except tg.DataExhausted:
                return step
            previous = bs
    return None


def test_a_data_path_is_taken_literally_and_its_patterns_are_globs_inside_it(main, data, tmp_path):
    odd = copy_data(data, tmp_path / "shards[1]*?")
    status, out, err = main(tiny_args(odd, tmp_path / "logs", "--check"))
    assert (status, err) == (0, "") and out.startswith("check: ok:"), (out, err)
    refused(main(tiny_args(odd, tmp_path / "logs", "--train-files", "*train_00000[2-9].bin", "--check")),
            "no training shards")


# ----------------------------------------------------------------------------------------------------
# log folders behind symbolic links; launcher variables that describe no process
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", [(), ("--check",)], ids=["run", "check"])
@pytest.mark.parametrize("link,says", [("loop", "is a loop of symbolic links"), ("dangling", "a symbolic link to nothing"),
                                       ("dangling/logs", "a symbolic link to nothing")])
def test_a_log_dir_behind_a_broken_symbolic_link_is_refused(main, data, tmp_path, link, says, mode):
    (tmp_path / "loop").symlink_to("loop2")
    (tmp_path / "loop2").symlink_to("loop")
    (tmp_path / "dangling").symlink_to("nowhere")
    before = sorted(os.listdir(tmp_path))
    refused(main(tiny_args(data, tmp_path / link, *mode)), f"--log-dir {tmp_path / link}", says)
    assert sorted(os.listdir(tmp_path)) == before and not (tmp_path / "nowhere").exists()


def test_a_log_dir_that_is_a_symbolic_link_to_a_folder_is_followed(main, data, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "logs").symlink_to("real")
    status, out, err = main(tiny_args(data, tmp_path / "logs", "--check"))
    assert (status, err) == (0, "") and out.startswith("check: ok:"), (out, err)


@pytest.mark.parametrize("env,says", [
    (dict(WORLD_SIZE="abc"), "WORLD_SIZE='abc' is not a process count or rank"),
    (dict(RANK="1"), "WORLD_SIZE=1, RANK=1, LOCAL_RANK=0 do not describe a process"),
    (dict(RANK="x", WORLD_SIZE="2"), "RANK='x'"),
    (dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="5"), "LOCAL_RANK=5"),
    (dict(WORLD_SIZE="0"), "WORLD_SIZE=0"),
], ids=["world-abc", "rank-1-alone", "rank-x", "local-rank-5", "world-0"])
@pytest.mark.parametrize("mode", [(), ("--check",)], ids=["run", "check"])
def test_launcher_variables_that_describe_no_process_are_one_line(main, data, tmp_path, env, says, mode):
    refused(main(tiny_args(data, tmp_path / "logs", *mode), **env), says)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("env", [dict(RANK="1", WORLD_SIZE="2"), dict(WORLD_SIZE="2")], ids=["rank-1-of-2", "world-2"])
def test_a_world_of_several_without_torchrun_is_one_line(main, data, tmp_path, env):
    refused(main(tiny_args(data, tmp_path / "logs"), **env), "WORLD_SIZE=2 but", "MASTER_ADDR, MASTER_PORT not set",
            "start the processes with torchrun")
    assert list(tmp_path.iterdir()) == []


def test_a_single_process_world_exported_without_torchrun_runs_alone(main, data, tmp_path):
    """RANK=0 WORLD_SIZE=1 LOCAL_RANK=0, as a job script might export: no rendezvous to wait for."""
    status, out, err = main(tiny_args(data, tmp_path / "logs", "--run-id", "alone"), RANK="0", WORLD_SIZE="1",
                            LOCAL_RANK="0")
    assert status == 0 and err == "", err
    assert (tmp_path / "logs" / "alone.txt").read_text().splitlines()[-1].startswith("summary:")


# ----------------------------------------------------------------------------------------------------
# out of memory, out of disk: one line, and the log keeps what it has
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("error,device", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 2414592000000 bytes. Error code 12 (Cannot allocate memory)"), "machine"),
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "GPU")], ids=["cpu", "cuda"])
def test_running_out_of_memory_is_one_line_naming_the_settings_to_shrink(main, data, tmp_path, monkeypatch, error,
                                                                         device):
    def warm_up(self):
        raise error

    monkeypatch.setattr(tg.Trainer, "warm_up_kernels", warm_up)
    status, out, err = main(tiny_args(data, tmp_path / "logs", "--run-id", "oom"))
    # what the run said before the warm-up: its log's path and, for --kernels fused on the CPU, the plain functions
    started = f"{tmp_path / 'logs' / 'oom.txt'}\nkernels: no fused kernel runs on the cpu: the plain functions, as " \
              "--kernels plain\n"
    assert out.startswith(started), out
    line = refused((status, out[len(started):], err),
                   f"out of memory during the warm-up: these settings need more than this {device} has",
                   "--train-bs-schedule", "--model-dim")
    said = line.split(" during the warm-up: ", 1)[1]
    assert (tmp_path / "logs" / "oom.txt").read_text().splitlines()[-1] == \
        f"stopped during the warm-up: out of memory: {said}"
    assert sorted(os.listdir(tmp_path / "logs")) == ["oom.txt"]  # the run id's lock went with the run


class DiskFillsUp:
    """A log file on a disk that is full from the first training step's line on."""

    def __init__(self, f):
        self.f, self.full = f, False

    def write(self, text):
        self.full = self.full or text.startswith("step:1/")
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.f.write(text)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_a_full_disk_is_one_line_and_the_log_keeps_what_was_written(main, data, tmp_path, monkeypatch):
    def open_on_a_small_disk(path, mode="r", *args, **kwargs):
        f = builtins.open(path, mode, *args, **kwargs)
        return DiskFillsUp(f) if mode == "x" else f

    monkeypatch.setattr(tg, "open", open_on_a_small_disk, raising=False)
    status, out, err = main(tiny_args(data, tmp_path / "logs", "--run-id", "full"))
    log = tmp_path / "logs" / "full.txt"
    assert status == tg.OUTPUT_FAILED == 4, err
    assert err.splitlines() == [f"error: {log}: No space left on device"], err
    text = log.read_text()
    assert text.startswith(SCRIPT.read_text()) and "Kernel warm-up done" in text  # what was written is kept
    assert "step:1/" not in text and out.splitlines()[-1].startswith("step:1/4 train_time:"), out
    assert sorted(os.listdir(tmp_path / "logs")) == ["full.txt"]


# ----------------------------------------------------------------------------------------------------
# a signal from the first import on: exit 128+N and one line; a launcher that died before the worker could see it
# ----------------------------------------------------------------------------------------------------

def start_script(argv, cwd, **env):
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *argv], cwd=cwd, env=child_env(**env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    STARTED_GROUPS.add(proc.pid)
    return proc


@pytest.mark.parametrize("signame", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_while_torch_is_imported_is_one_line_and_exit_128_plus_its_number(data, tmp_path, signame):
    proc = start_script(tiny_args(data, tmp_path / "logs"), tmp_path)
    try:
        time.sleep(0.5)  # importing torch takes seconds
        proc.send_signal(getattr(signal, signame))
        out, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc.pid)
    assert proc.returncode == 128 + getattr(signal, signame), (out, err)
    assert (out.splitlines(), err) == ([f"interrupted by {signame} while starting"], ""), (out, err)
    assert list(tmp_path.iterdir()) == []


def test_a_worker_whose_launcher_died_before_it_looked_stops_at_once_in_one_line(data, tmp_path):
    """A worker torchrun started, whose launcher (named by ./run.sh launch) is no longer its parent."""
    proc = start_script(tiny_args(data, tmp_path / "logs"), tmp_path, TORCHELASTIC_RUN_ID="test",
                        **{tg.LAUNCHER_PID_ENV: "1"})
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        kill_group(proc.pid)
    assert proc.returncode == 128 + tg.LAUNCHER_DIED, (out, err)
    assert (out.splitlines(), err) == (["stopped while starting: the launcher died"], ""), (out, err)
    assert list(tmp_path.iterdir()) == []
