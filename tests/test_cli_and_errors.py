"""Command line (every Hyperparameters field is a flag), import hygiene, and one-line user errors.

Bad input is mostly checked through train_gpt.main() in this process (the `main` fixture: milliseconds each, where a
child process costs seconds of importing torch); each kind of refusal also runs once as a user meets it, as
`python train_gpt.py ...` (a bad flag, a missing data folder, --help) and under torchrun (a bad shard), so that the
process's exit status and its one line on stderr stay pinned.
"""
import dataclasses
import os
import signal
import sys
from pathlib import Path

import torch

import numpy as np
import pytest

import train_gpt as tg
from dist_utils import runtime_for
from proxy_shards import build_shards, write_shard
from processes import run_group

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "train_gpt.py"


def child_env(**extra):
    env = dict(os.environ)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES=env.get("CUDA_VISIBLE_DEVICES", ""))
    env.update(extra)
    return env


def run_script(args, cwd, env=None, timeout=120):
    return run_group([sys.executable, str(SCRIPT), *args], cwd=cwd, env=env or child_env(),
                          capture_output=True, text=True, timeout=timeout)


LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class ProcessExit(BaseException):
    """os._exit(status) in this process, where main() ends a run that stopped early (the `main` fixture)."""


@pytest.fixture
def main(capsys, monkeypatch, tmp_path):
    """main(argv, **env) -> (exit status, stdout, stderr) of train_gpt.main(argv) in this process, as run_script(argv)
    runs the script: the launcher's variables unset unless given in env, the working folder tmp_path. main() installs
    its own signal handlers: pytest's are put back; its os._exit(status) (a run that stopped early) returns status
    here; monkeypatch restores the environment and the folder."""
    saved = {s: signal.getsignal(s) for s in (*tg.STOP_SIGNALS, tg.LAUNCHER_DIED)}
    monkeypatch.chdir(tmp_path)

    def exit_here(status):
        raise ProcessExit(status)

    monkeypatch.setattr(os, "_exit", exit_here)

    def call(argv, **env):
        for k in LAUNCHER_ENV:
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        capsys.readouterr()
        try:
            status = tg.main(argv)
        except ProcessExit as e:
            status = e.args[0]
        finally:
            for s, handler in saved.items():
                signal.signal(s, handler)
        assert tg.Logger.active is None and tg.RunLock.held is None  # main() closed its log and lock
        out = capsys.readouterr()
        return status, out.out, out.err
    return call


def refused(result, *words) -> str:
    """An in-process main() result: exit 2, nothing on stdout, one `error:` line on stderr holding every word."""
    status, out, err = result
    assert status == 2, result
    assert out == "", out
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


# ----------------------------------------------------------------------------------------------------
# --help and parse_args
# ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def help_run(tmp_path_factory):
    """`python train_gpt.py --help`, once for the module, in an empty folder (COLUMNS wide: no wrapping inside words)."""
    folder = tmp_path_factory.mktemp("help")
    return folder, run_script(["--help"], cwd=folder, env=child_env(COLUMNS="2000"))


def test_help_lists_every_field(help_run):
    folder, r = help_run
    assert r.returncode == 0, r.stderr
    for f in dataclasses.fields(tg.Hyperparameters):
        assert "--" + f.name.replace("_", "-") in r.stdout, f.name
    assert list(folder.iterdir()) == []


def test_help_gives_each_flag_its_description_default_and_allowed_values(help_run):
    text = " ".join(help_run[1].stdout.split())
    for f in dataclasses.fields(tg.Hyperparameters):
        assert tg.help_text(f), f"{f.name} has no --help text"
        assert " ".join(tg.help_text(f).split()) in text, f.name
    assert "--orthogonalizer {polar,turbo}" in text and "--kernels fused|plain|LIST" in text
    # help strings that quote tables defined further down in the file are made when --help is printed
    assert "Polar Express (5 steps) or Turbo-Muon (4)" in text
    assert "LIST of attention, mlp, attention_output, lm_head_loss (default: fused)" in text
    assert "unseeded, like the record (default: -1)" in text
    assert "(default: None)" not in text and "lambda" not in text


def test_help_at_80_columns_gives_each_flag_at_most_two_lines(tmp_path):
    r = run_script(["--help"], cwd=tmp_path, env=child_env(COLUMNS="80"))
    assert r.returncode == 0, r.stderr
    options = r.stdout.split("\noptions:\n", 1)[1].splitlines()
    flags = {}  # the flag a line starts, with its continuation lines
    for line in options:
        if line.startswith("  -"):
            flags[line.split()[0].rstrip(",")] = 1
        elif line.strip():
            flags[list(flags)[-1]] += 1
    assert len(flags) == len(dataclasses.fields(tg.Hyperparameters)) + 1  # and -h
    assert max(len(line) for line in options) <= 80
    assert {flag: n for flag, n in flags.items() if n > 2} == {}


@pytest.mark.parametrize("argv,flag", [(["--ws-schedule", "3,x"], "--ws-schedule"),
                                       (["--seed", "one"], "--seed"),
                                       (["--save-checkpoint", "maybe"], "--save-checkpoint"),
                                       (["--no-such-flag"], "--no-such-flag")])
def test_bad_flag_value_is_one_line_naming_the_flag_with_exit_2(main, argv, flag):
    line = refused(main(argv), flag)
    assert "lambda" not in line and "usage:" not in line


def test_the_script_refuses_a_bad_flag_value_in_one_line_with_exit_2(tmp_path):
    """The same, as a user meets it: argparse's usage and exit go through the script's one-line error path."""
    r = run_script(["--seed", "one"], cwd=tmp_path)
    line = assert_one_line_error(r, "--seed")
    assert "lambda" not in line and "usage:" not in r.stderr and r.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_parse_args_defaults_are_the_record():
    a = tg.parse_args([])
    assert a == tg.Hyperparameters()
    assert a.num_iterations == 2160 and a.smoke is False


def test_parse_args_tuples_and_scalars():
    a = tg.parse_args(["--ws-schedule", "1,2,3", "--lr-plateaus", "1,2.5,3", "--adam-betas", "0.9,0.99",
                       "--train-bs-schedule", "8,16,32", "--val-tokens", "4096", "--val-batch-size", "1024",
                       "--cooldown-frac", "0.25", "--device", "cpu"])
    assert a.ws_schedule == (1, 2, 3) and all(type(x) is int for x in a.ws_schedule)
    assert a.lr_plateaus == (1.0, 2.5, 3.0)
    assert a.adam_betas == (0.9, 0.99)
    assert a.train_bs_schedule == (8, 16, 32)
    assert a.val_tokens == 4096 and a.val_batch_size == 1024 and a.cooldown_frac == 0.25 and a.device == "cpu"


@pytest.mark.parametrize("argv,value", [(["--save-checkpoint"], True), (["--save-checkpoint", "true"], True),
                                        (["--save-checkpoint", "0"], False), (["--save-checkpoint=off"], False),
                                        ([], False)])
def test_parse_args_bools(argv, value):
    assert tg.parse_args(argv).save_checkpoint is value


def test_smoke_preset_then_explicit_override_wins():
    a = tg.parse_args(["--smoke"])
    assert a.smoke is True
    for k, v in tg.SMOKE_PRESET.items():
        assert getattr(a, k) == v, k
    assert a.num_iterations == 33
    b = tg.parse_args(["--model-dim", "192", "--smoke", "--num-heads", "3", "--num-scheduled-iterations", "12"])
    assert (b.model_dim, b.num_heads, b.head_dim) == (192, 3, 64)
    assert b.num_scheduled_iterations == 12 and b.num_extension_iterations == 3
    assert b.train_bs_schedule == tg.SMOKE_PRESET["train_bs_schedule"]
    c = tg.parse_args(["--smoke", "false"])
    assert c == tg.Hyperparameters()


@pytest.mark.parametrize("argv,words", [
    (["--orthogonalizer", "newton"], "--orthogonalizer"),
    (["--val-tokens", "1000", "--val-batch-size", "300"], "--val-tokens"),
    (["--model-dim", "100"], "--model-dim"),
    (["--kernels", "flash"], "--kernels"),
    (["--kernels=,"], "--kernels must be fused, plain or a comma-separated list"),
    (["--device", "tpu"], "--device"),
    (["--train-epochs", "0"], "--train-epochs"),
    (["--ws-schedule", "3,7"], "--ws-schedule"),
    # schedules that cannot work
    (["--num-scheduled-iterations", "2"], "--num-scheduled-iterations"),
    (["--num-scheduled-iterations", "-5"], "--num-scheduled-iterations"),
    (["--num-extension-iterations", "-1"], "--num-extension-iterations"),
    (["--lr-plateau-starts", "0,0.66,0.33"], "--lr-plateau-starts"),
    (["--lr-plateau-starts", "0.1,0.33,0.66"], "--lr-plateau-starts"),
    (["--muon-momentum-warmup", "0.85,0.95,-3"], "--muon-momentum-warmup"),
])
def test_validate_args_errors(argv, words):
    with pytest.raises(tg.ConfigError, match=words):
        tg.parse_args(argv)


def test_grad_accum_steps_for():
    assert [tg.grad_accum_steps_for(w) for w in (1, 2, 4, 8, 16)] == [8, 4, 2, 1, 1]
    for w in (3, 5, 6, 12):
        with pytest.raises(tg.ConfigError, match="world size"):
            tg.grad_accum_steps_for(w)


# ----------------------------------------------------------------------------------------------------
# import hygiene
# ----------------------------------------------------------------------------------------------------

IMPORT_PROBE = r"""
import os, sys
opened = []
def hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        opened.append(os.path.abspath(os.fsdecode(args[0])))
sys.addaudithook(hook)
import train_gpt
import torch, torch.distributed as dist
cwd = os.getcwd()
bad = [p for p in opened if p.startswith(cwd) or p.endswith(".bin") or "fineweb" in p]
print("BAD_OPENS", bad)
print("PG", dist.is_initialized())
print("CUDA_INIT", torch.cuda.is_initialized())
print("ENV_RANK", "RANK" in os.environ)
"""


def test_import_has_no_side_effects(tmp_path):
    (tmp_path / "data").mkdir()
    write_shard(tmp_path / "data" / "fineweb_train_000001.bin", np.arange(10))
    before = sorted(str(p.relative_to(tmp_path)) + str(p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    r = run_group([sys.executable, "-c", IMPORT_PROBE], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env=child_env(PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1"))
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert "BAD_OPENS []" in out
    assert "PG False" in out
    assert "CUDA_INIT False" in out
    assert r.stderr.strip() == ""
    after = sorted(str(p.relative_to(tmp_path)) + str(p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    assert after == before  # nothing created (no logs/), nothing touched


# ----------------------------------------------------------------------------------------------------
# bad input through main(): exit non-zero, ONE line on stderr starting with "error:", no traceback
# ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good")
    build_shards(folder, train_shards=2, tokens_per_train_shard=100_000, val_tokens=10_000)
    return folder


def copy_data(src, dst):
    dst.mkdir()
    for p in Path(src).iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def assert_one_line_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error:"), lines[0]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


# A run small enough to start training in seconds: one stage (plus the extension), 16-token micro-batches
TINY = ["--smoke", "--device", "cpu", "--model-dim", "64", "--num-heads", "1", "--train-bs-schedule", "128",
        "--ws-schedule", "3", "--lr-plateaus", "1", "--lr-plateau-starts", "0", "--train-bs-extension", "128",
        "--train-max-seq-len", "64", "--val-tokens", "128", "--val-batch-size", "128", "--val-loss-every", "0",
        "--num-scheduled-iterations", "4", "--num-extension-iterations", "0"]


def smoke_args(data, tmp_path, *extra):
    return ["--smoke", "--device", "cpu", "--data-path", str(data), "--log-dir", str(tmp_path / "logs"), *extra]


def test_error_missing_data_folder(tmp_path):
    """As a user meets it: `python train_gpt.py` exits 2 with one line and writes nothing."""
    r = run_script(smoke_args(tmp_path / "missing", tmp_path), cwd=tmp_path)
    assert_one_line_error(r, str(tmp_path / "missing"), "does not exist")
    assert r.stdout == "" and list(tmp_path.iterdir()) == []


def test_bad_data_and_a_bad_runtime_are_refused_before_inductor_is_imported(tmp_path):
    """Refusals come before the compile cache's import of Inductor (and with it Dynamo): seconds per refused start."""
    probe = ("import sys, train_gpt\n"
             "for argv in (sys.argv[1:], sys.argv[1:] + ['--compile', 'on']):\n"
             "    print(train_gpt.main(argv), 'torch._inductor' in sys.modules)")
    r = run_group([sys.executable, "-c", probe, *smoke_args(tmp_path / "missing", tmp_path)], cwd=tmp_path,
                  env=child_env(PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120)
    assert r.stdout.splitlines() == ["2 False", "2 False"], r.stderr
    assert "does not exist" in r.stderr and "--compile on needs a CUDA GPU" in r.stderr


def test_error_empty_data_folder(main, tmp_path):
    (tmp_path / "empty").mkdir()
    refused(main(smoke_args(tmp_path / "empty", tmp_path)), "no training shards")
    assert not (tmp_path / "logs").exists()


def test_error_no_validation_shard(main, tmp_path, good_data):
    data = copy_data(good_data, tmp_path / "d")
    (data / "fineweb_val_000000.bin").unlink()
    refused(main(smoke_args(data, tmp_path)), "no validation shards")


def test_error_corrupt_shard_bad_magic(main, tmp_path, good_data):
    data = copy_data(good_data, tmp_path / "d")
    bad = data / "fineweb_train_000002.bin"
    raw = bytearray(bad.read_bytes())
    raw[0:4] = np.array([12345], dtype="<i4").tobytes()
    bad.write_bytes(bytes(raw))
    refused(main(smoke_args(data, tmp_path)), str(bad), "magic")


def test_error_truncated_shard(main, tmp_path, good_data):
    data = copy_data(good_data, tmp_path / "d")
    bad = data / "fineweb_train_000001.bin"
    bad.write_bytes(bad.read_bytes()[:-1000])
    refused(main(smoke_args(data, tmp_path)), str(bad), "truncated")
    assert not (tmp_path / "logs").exists()


def test_error_shard_shorter_than_header_odd_size(main, tmp_path, good_data):
    data = copy_data(good_data, tmp_path / "d")
    bad = data / "fineweb_train_000001.bin"
    bad.write_bytes(bad.read_bytes()[:1001])
    refused(main(smoke_args(data, tmp_path)), str(bad), "header")


def test_error_too_little_training_data(main, tmp_path):
    build_shards(tmp_path / "d", train_shards=1, tokens_per_train_shard=20_000, val_tokens=10_000)
    refused(main(smoke_args(tmp_path / "d", tmp_path)), "too little training data", "--train-epochs")


def test_error_validation_shard_too_small(main, tmp_path):
    build_shards(tmp_path / "d", train_shards=2, tokens_per_train_shard=100_000, val_tokens=3_000)  # < --val-tokens
    refused(main(smoke_args(tmp_path / "d", tmp_path)), "--val-tokens")


def test_error_val_tokens_not_multiple(main, tmp_path, good_data):
    refused(main(smoke_args(good_data, tmp_path, "--val-tokens", "5000")), "--val-tokens", "--val-batch-size")


def test_error_device_cuda_without_cuda(main, tmp_path, good_data):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    args = smoke_args(good_data, tmp_path)
    args[args.index("cpu")] = "cuda"
    refused(main(args), "CUDA")


def test_error_unsupported_world_size(main, tmp_path, good_data):
    # RANK/WORLD_SIZE set without a real launcher: the world size is rejected before any process group
    refused(main(smoke_args(good_data, tmp_path), RANK="0", WORLD_SIZE="3", LOCAL_RANK="0"), "world size 3")


def test_unsupported_world_size_on_cpu_speaks_of_processes_not_gpus(main, tmp_path, good_data):
    line = refused(main(smoke_args(good_data, tmp_path), RANK="0", WORLD_SIZE="3", LOCAL_RANK="0"),
                   "world size 3", "processes")
    assert "GPU" not in line


def test_check_validates_settings_and_data_without_training(main, tmp_path, good_data):
    status, out, err = main(smoke_args(good_data, tmp_path, "--check"), WORLD_SIZE="2")
    assert status == 0, err
    assert out.startswith("check: ok: 2 process(es) on cpu")
    assert not (tmp_path / "logs").exists()
    refused(main(smoke_args(tmp_path / "missing", tmp_path, "--check")), "does not exist")


def test_a_log_dir_that_is_a_file_is_one_line_before_anything_is_written_and_check_catches_it(main, tmp_path,
                                                                                               good_data):
    taken = tmp_path / "taken"
    taken.write_text("not a folder")
    for extra, env in (((), {}), (("--check",), dict(WORLD_SIZE="2"))):
        args = smoke_args(good_data, tmp_path, *extra)
        args[args.index("--log-dir") + 1] = str(taken / "logs")
        refused(main(args, **env), str(taken), "is a file")
    assert taken.read_text() == "not a folder"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc, where no one may write (root neither)")
def test_an_unwritable_log_dir_is_one_line_and_check_catches_it(main, tmp_path, good_data):
    for extra in ((), ("--check",)):
        args = smoke_args(good_data, tmp_path, *extra)
        args[args.index("--log-dir") + 1] = "/proc/speedrun-logs"
        refused(main(args), "/proc/speedrun-logs", "cannot write")


def test_the_cpu_fallback_of_a_smoke_run_is_noted_once_and_help_says_when_it_happens(main, tmp_path, good_data):
    assert "else the CPU for --smoke" in tg.help_text(tg.Hyperparameters.__dataclass_fields__["device"])
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    args = smoke_args(good_data, tmp_path, "--check")
    args.remove("--device"), args.remove("cpu")
    status, out, err = main(args)
    assert status == 0, err
    assert err.count("no CUDA device found") == 1, err
    status, out, err = main(smoke_args(good_data, tmp_path, "--check"))
    assert status == 0 and "no CUDA device" not in err


def test_check_flags_validates_settings_before_any_data_exists(main, tmp_path):
    """What ./run.sh runs before downloading FineWeb: flags and world size only, so a typo costs no download."""
    status, out, err = main(smoke_args(tmp_path / "not_downloaded_yet", tmp_path, "--check-flags"), WORLD_SIZE="2")
    assert status == 0, err
    assert out.startswith("check: ok: 2 process(es) on cpu") and "data not checked" in out
    assert not (tmp_path / "logs").exists()
    refused(main(smoke_args(tmp_path / "not_downloaded_yet", tmp_path, "--check-flags", "--orthogonalizer", "newton")),
            "--orthogonalizer")
    refused(main(smoke_args(tmp_path / "not_downloaded_yet", tmp_path, "--check-flags"), WORLD_SIZE="3"),
            "world size 3")


def test_under_torchrun_a_bad_shard_is_reported_once_by_rank_0_and_workers_exit_2(tmp_path, good_data):
    data = copy_data(good_data, tmp_path / "d")
    bad = data / "fineweb_train_000001.bin"
    bad.write_bytes(bad.read_bytes()[:-1000])
    r = run_group([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   "--log-dir", str(tmp_path / "torchrun"), "--redirects", "3", str(SCRIPT), *smoke_args(data, tmp_path)],
                  cwd=tmp_path, env=child_env(), capture_output=True, text=True, timeout=180)
    assert r.returncode != 0 and "exitcode  : 2" in r.stderr  # torchrun's own report names our exit status
    # every line each rank printed (torchrun's per-rank files): the one error on rank 0, nothing on rank 1
    said = {rank: tuple((folder / f).read_text() for f in ("stdout.log", "stderr.log"))
            for rank in (0, 1) for folder in (tmp_path / "torchrun").rglob(f"attempt_0/{rank}")}
    assert said[0][0] == "" and said[1] == ("", ""), said
    assert said[0][1].splitlines() == [f"error: shard {bad} is {bad.stat().st_size} bytes but its header promises "
                                       f"{100_000} tokens ({1024 + 200_000} bytes): truncated or corrupt, re-download "
                                       "or rebuild it"], said
    assert not (tmp_path / "logs").exists()


def test_error_bad_orthogonalizer(main, tmp_path, good_data):
    refused(main(smoke_args(good_data, tmp_path, "--orthogonalizer", "newton-schulz")), "--orthogonalizer",
            "newton-schulz")


def test_a_fused_kernel_named_in_kernels_that_cannot_run_here_is_one_line(main, tmp_path, good_data):
    refused(main(smoke_args(good_data, tmp_path, "--kernels", "mlp,attention")), "--kernels",
            "fused attention kernel cannot run here", "--kernels plain")
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("flag,value", [("--attn-backend", "fa4"), ("--mlp-kernel", "quack"),
                                        ("--fused-fp8-head", "on")])
def test_the_removed_kernel_flags_are_unknown(flag, value):
    with pytest.raises(tg.ConfigError, match=f"unrecognized arguments: {flag} {value}"):
        tg.parse_args([flag, value])


def test_kernels_fused_takes_the_plain_functions_on_the_cpu_saying_so_once_and_a_list_must_run_here():
    assert tg.parse_kernels("fused") == set(tg.FUSED_KERNELS) and tg.parse_kernels("plain") == set()
    assert tg.parse_kernels(" mlp, attention ") == {"mlp", "attention"} and tg.parse_kernels("mlp,flash") is None
    for flag, notes in (("fused", ("kernels: no fused kernel runs on the cpu: the plain functions, as --kernels "
                                   "plain",)), ("plain", ())):
        runtime = runtime_for(tg.parse_args(["--smoke", "--device", "cpu", "--kernels", flag]))
        assert runtime.kernels == {n: k.plain for n, k in tg.FUSED_KERNELS.items()} and runtime.fused == "none"
        assert runtime.kernel_notes == notes  # fused: one note for all (no fused kernel runs on the CPU)
    with pytest.raises(tg.ConfigError, match="the fused lm_head_loss kernel cannot run here"):
        runtime_for(tg.parse_args(["--smoke", "--device", "cpu", "--kernels", "lm_head_loss"]))


def test_error_compile_on_the_cpu(main, tmp_path, good_data):
    refused(main(smoke_args(good_data, tmp_path, "--compile", "on")), "--compile on", "CUDA GPU", "reference attention")


def test_save_checkpoint_writes_final_state(tmp_path, good_data):
    r = run_script([*TINY, "--data-path", str(good_data), "--log-dir", str(tmp_path / "logs"),
                    "--num-scheduled-iterations", "3", "--save-checkpoint", "--run-id", "ck"], cwd=tmp_path,
                   timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "logs" / "ck").iterdir()) == ["state_step000003.pt"]
    state = torch.load(tmp_path / "logs" / "ck" / "state_step000003.pt", weights_only=False)
    assert state["step"] == 3 and state["code"] == (REPO / "train_gpt.py").read_text()
    assert "scalars" in state["model"] and len(state["optimizers"]) == 2
