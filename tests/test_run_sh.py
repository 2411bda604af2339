"""run.sh and .ci/run, driven with stand-ins: a fake `nvidia-smi` and a stub `python3` (also `python`, `pip`,
`torchrun`) first on PATH that records every call and exits 0, so nothing is installed, downloaded or trained.

The stub answers the few `python -c` questions run.sh asks (torch's CUDA version, which test packages are
missing, whether PyTorch's CPU index answers) from STUB_* environment variables (STUB_FIND_SPEC=real: the real Python,
without site-packages, looks the test packages up among the sandbox's stand-ins), prints a pytest-like summary for
`-m pytest`, and fails pip installs on request (STUB_PIP_RC, STUB_GPU_PIP_RC). `pip install --dry-run` writes the
report given in STUB_PIP_TORCH (pip's configured sources) or STUB_LOCAL_TORCH (with --no-index). Two questions of
setup-cpu go to the real Python, so that their code is tested: which torch to keep (it imports the sandbox's
stand-in torch, see Sandbox.torch) and the parsing of pip's report.

`./run.sh launch` is also run for real (slow): 2 gloo processes of the trainer on the CPU, which fail, or are
interrupted, to pin down its exit statuses and that torchrun's own failure report stays out.
"""
import json
import os
import shutil
import socket
import subprocess
import signal
import sys
import time
from pathlib import Path

import pytest

from processes import RUN_DIR_ENV, STARTED_GROUPS, group_members, kill_group, run_group
from proxy_shards import build_shards

REPO = Path(__file__).resolve().parents[1]
RUN_SH = REPO / "run.sh"
LAUNCH_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "WORLD_SIZE")

# A shell script, not Python, because it runs several times per test and bash starts in milliseconds. One record
# per call in STUB_LOG: fields separated by \x1f (program, the launch variables as NAME=VALUE or NAME unset, then
# the arguments), records ended by \x1e, since arguments (the `-c` code) may hold newlines.
STUB = r"""#!/usr/bin/env bash
{
    printf '%s\x1f' "${0##*/}"
    for v in NCCL_NVLS_ENABLE TORCH_SYMM_MEM_DISABLE_MULTICAST NVSHMEM_DISABLE_NVLS WORLD_SIZE; do
        if [ -n "${!v+set}" ]; then printf '%s=%s\x1f' "$v" "${!v}"; else printf '%s\x1f' "$v"; fi
    done
    printf '%s\x1f' "$@"
    printf '\x1e'
} >> "$STUB_LOG"
if [ "${1:-}" = -c ]; then
    case "$2" in
        *torch_to_keep* | *torch_pick*) PYTHONPATH="$STUB_SITE" exec "$STUB_REAL_PYTHON" "$@" ;;
        *cpu_index_probe*)
            [ "${STUB_PROBE-}" != real ] || PYTHONPATH="$STUB_SITE" exec "$STUB_REAL_PYTHON" "$@"
            [ -z "${STUB_PROBE-}" ] || { echo "$STUB_PROBE"; exit 1; } ;;
        *package_dirs_for_bytecode*) echo "${STUB_BYTECODE_DIRS-/stub/site/torch}" ;;
        *find_spec*)
            [ "${STUB_FIND_SPEC-}" != real ] || PYTHONPATH="$STUB_SITE" exec "$STUB_REAL_PYTHON" -S "$@"
            echo "${STUB_MISSING:-}" ;;
        *torch.version.cuda*) echo "${STUB_CUDA-13.0}" ;;
        *sys.prefix*) echo /stub/prefix ;;
    esac
elif [ "${1:-} ${2:-}" = "train_gpt.py --check" ] || [ "${1:-} ${2:-}" = "train_gpt.py --check-flags" ]; then
    [ "${STUB_CHECK_RC:-0}" = 0 ] || [ -n "${STUB_CHECK_SILENT-}" ] || \
        echo "error: --orthogonalizer: invalid choice (see --help)" >&2
    exit "${STUB_CHECK_RC:-0}"
elif [ "${1:-} ${2:-}" = "-m pytest" ]; then
    echo "${STUB_PYTEST_OUT-5 passed in 0.01s}"
    exit "${STUB_PYTEST_RC:-0}"
elif [ "${1:-} ${2:-} ${3:-}" = "-m pip install" ]; then
    case " $* " in
        *" --dry-run "*)
            report="" prev=""
            for a in "$@"; do [ "$prev" != --report ] || report=$a; prev=$a; done
            case " $* " in *" --no-index "*) answer=${STUB_LOCAL_TORCH-} ;; *) answer=${STUB_PIP_TORCH-} ;; esac
            [ -n "$answer" ] || { echo "ERROR: No matching distribution found for torch>=2.10" >&2; exit 1; }
            printf '%s' "$answer" > "$report" ;;
        *" requirements-gpu.txt "*) exit "${STUB_GPU_PIP_RC:-0}" ;;
        *) exit "${STUB_PIP_RC:-0}" ;;
    esac
fi
exit 0
"""


def fake_nvidia_smi(gpus):
    """gpus: a count (listed by `nvidia-smi -L`), or None for an nvidia-smi that fails as it does without a driver."""
    if gpus is None:
        return ("#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the NVIDIA driver.'\n"
                "exit 9\n")
    lines = "".join(f"echo 'GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d}-0000-0000-0000-000000000000)'\n"
                    for i in range(gpus))
    return f"#!/bin/sh\n{lines}exit 0\n"


class Sandbox:
    def __init__(self, tmp_path: Path):
        self.bin = tmp_path / "bin"
        self.bin.mkdir()
        self.log = tmp_path / "calls.jsonl"
        for name in ("python3", "python", "pip", "pip3", "torchrun"):
            self._write(name, STUB)
        self.site = tmp_path / "site"  # first on the real Python's path: its torch shadows an installed one
        self.torch(None)
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("PYTHON", "TORCH_CPU_SPEC", "TORCH_CPU_INDEX") + LAUNCH_ENV}
        self.env.update(STUB_LOG=str(self.log), PATH=f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}",
                        STUB_SITE=str(self.site), STUB_REAL_PYTHON=sys.executable)

    def _write(self, name, text):
        path = self.bin / name
        path.write_text(text)
        path.chmod(0o755)

    def gpus(self, n):
        self._write("nvidia-smi", fake_nvidia_smi(n))
        return self

    def torch(self, version):
        """The torch that setup-cpu finds installed: one with this __version__, or (None) one that fails to import."""
        (self.site / "torch").mkdir(parents=True, exist_ok=True)
        (self.site / "torch" / "__init__.py").write_text(
            f"__version__ = {version!r}\n" if version else "raise ImportError('no torch in this sandbox')\n")
        return self

    def run(self, *args, script=RUN_SH, **env):
        return run_group(["bash", str(script), *args], env={**self.env, **env}, capture_output=True, text=True,
                         timeout=60, stdin=subprocess.DEVNULL)

    def calls(self):
        if not self.log.exists():
            return []
        out = []
        for record in self.log.read_text().split("\x1e")[:-1]:
            fields = record.split("\x1f")[:-1]
            env = dict((f.split("=", 1) + [None])[:2] for f in fields[1:1 + len(LAUNCH_ENV)])
            out.append({"prog": fields[0], "env": env, "argv": fields[1 + len(LAUNCH_ENV):]})
        return out

    def commands(self):
        """The recorded argv lists, without run.sh's `python -c` questions; a --report file (a temporary one) reads
        REPORT, and the quiet torchrun launcher (a `python -c` call too) reads quiet_torchrun, then its arguments."""
        out = []
        for c in self.calls():
            argv = c["argv"]
            if argv[:1] == ["-c"]:
                if "quiet_torchrun" not in argv[1]:
                    continue
                argv = ["quiet_torchrun", *argv[2:]]
            out.append([a if prev != "--report" else "REPORT" for prev, a in zip([None] + argv, argv)])
        return out

    def questions(self, tag):
        """The arguments after the code of each `python -c` call whose code holds TAG."""
        return [c["argv"][2:] for c in self.calls() if c["argv"][:1] == ["-c"] and tag in c["argv"][1]]


@pytest.fixture
def box(tmp_path):
    return Sandbox(tmp_path)


def pip_install(*what):
    return ["-m", "pip", "install", *what]


REQS = pip_install("-q", "--disable-pip-version-check", "-r", "requirements.txt")
GPU_REQS = pip_install("-q", "--disable-pip-version-check", "-r", "requirements-gpu.txt")
BYTECODE = ["-m", "compileall", "-q", "-j", "0", "/stub/site/torch"]
DOWNLOAD = ["data/cached_fineweb10B.py", "9"]


def torchrun(n, *args):
    """torchrun's run(), called by run.sh's inline launcher: n processes of train_gpt.py args."""
    return ["quiet_torchrun", str(n), "train_gpt.py", *args]


def check(*args):
    """The one-process pre-flight of the trainer's flags and data before torchrun starts."""
    return ["train_gpt.py", "--check", *args]


def check_flags(*args):
    """The one-process check of the trainer's flags alone, before the FineWeb download."""
    return ["train_gpt.py", "--check-flags", *args]


# ---- no GPU: one message, exit 2, before anything is installed or downloaded -------------------------------------

@pytest.mark.parametrize("form", [[], ["train"], ["--data-path", "data/proxy"], ["train", "--smoke"], ["setup-gpu"]])
@pytest.mark.parametrize("gpus", [None, 0], ids=["nvidia-smi-fails", "no-gpu-listed"])
def test_no_gpu_stops_first_and_points_at_the_cpu_paths(box, form, gpus):
    r = box.gpus(gpus).run(*form)
    assert r.returncode == 2, r.stdout + r.stderr
    assert box.calls() == []  # no pip install, no download, no torchrun: not even python was started
    assert r.stdout == ""
    first = r.stderr.splitlines()[0]
    assert first.startswith("run.sh: no NVIDIA GPU found")
    for hint in ("./run.sh setup-cpu && ./run.sh test", "./run.sh proxy CORPUS_DIR",
                 "./run.sh launch 2 --smoke --data-path data/proxy"):
        assert hint in r.stderr, hint


def test_no_gpu_without_nvidia_smi_on_path(box):
    system_path = "/usr/bin:/bin"
    if shutil.which("nvidia-smi", path=system_path):
        pytest.skip("this machine has nvidia-smi in /usr/bin or /bin")
    r = box.run(PATH=f"{box.bin}:{system_path}")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "no NVIDIA GPU found" in r.stderr and "--smoke --data-path data/proxy" in r.stderr
    assert box.calls() == []


# ---- help and unknown commands -------------------------------------------------------------------------------

@pytest.mark.parametrize("word", ["--help", "-h", "help"])
def test_help_prints_usage_and_does_nothing(box, word):
    r = box.run(word)  # no nvidia-smi at all: help must not care
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Usage: ./run.sh") and r.stderr == ""
    for command in ("train", "launch NPROC", "setup-gpu", "setup-cpu", "test", "proxy", "record",
                    "--data-path data/proxy", "./run.sh launch 2 --smoke --data-path data/proxy"):
        assert command in r.stdout, command
    assert box.calls() == []


@pytest.mark.parametrize("word", ["tset", "setup", "Train", "fineweb"])
def test_unknown_first_word_is_one_line_error(box, word):
    r = box.gpus(8).run(word, "--seed", "1")
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"run.sh: unknown command '{word}'") and "./run.sh --help" in lines[0]
    assert box.calls() == []


@pytest.mark.parametrize("command", ["setup-cpu", "setup-gpu"])
def test_setup_commands_take_no_arguments(box, command):
    r = box.gpus(8).run(command, "extra")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "takes no arguments" in r.stderr
    assert box.calls() == []


# ---- training on (fake) GPUs ---------------------------------------------------------------------------------

@pytest.mark.parametrize("visible, used", [(8, 8), (4, 4), (2, 2), (1, 1), (3, 2), (6, 4), (16, 8)])
def test_default_form_installs_downloads_then_launches(box, visible, used):
    r = box.gpus(visible).run("--seed", "7", "--orthogonalizer", "turbo")
    assert r.returncode == 0, r.stdout + r.stderr
    flags = ("--seed", "7", "--orthogonalizer", "turbo")
    assert box.commands() == [REQS, GPU_REQS, BYTECODE, check_flags(*flags), DOWNLOAD, check(*flags), torchrun(used, *flags)]
    assert box.calls()[-2]["env"].get("WORLD_SIZE") == str(used)
    assert [c["env"].get("WORLD_SIZE") for c in box.calls() if c["argv"][:2] == check_flags()] == [str(used)]
    launch = box.calls()[-1]
    assert launch["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                             "NVSHMEM_DISABLE_NVLS": "1", "WORLD_SIZE": None}
    assert ("using" in r.stderr) == (visible != used)


def test_bad_trainer_flags_stop_at_the_one_process_check_before_torchrun(box):
    r = box.gpus(2).run("--data-path", "data/proxy", "--orthogonalizer", "newton", STUB_CHECK_RC="2")
    assert r.returncode == 2
    assert box.commands()[-1] == check("--data-path", "data/proxy", "--orthogonalizer", "newton")
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == ["error: --orthogonalizer: invalid choice (see --help)"]


def test_bad_trainer_flags_stop_before_the_fineweb_download(box):
    r = box.gpus(8).run("--orthogonalizer", "newton", STUB_CHECK_RC="2")
    assert r.returncode == 2
    assert box.commands() == [REQS, GPU_REQS, BYTECODE, check_flags("--orthogonalizer", "newton")]
    assert [ln for ln in r.stderr.splitlines() if ln.strip()] == ["error: --orthogonalizer: invalid choice (see --help)"]


def test_train_word_is_the_default_form(box):
    box.gpus(2)
    assert box.run("train", "--seed", "3").returncode == 0
    first = box.commands()
    box.log.unlink()
    assert box.run("--seed", "3").returncode == 0
    assert box.commands() == first and first[-1] == torchrun(2, "--seed", "3")
    box.log.unlink()
    assert box.run().returncode == 0
    assert box.commands()[-1] == torchrun(2)


def test_nccl_settings_from_the_environment_are_kept(box):
    r = box.gpus(8).run(NCCL_NVLS_ENABLE="1")
    assert r.returncode == 0, r.stderr
    assert box.calls()[-1]["env"]["NCCL_NVLS_ENABLE"] == "1"


@pytest.mark.parametrize("args", [["--data-path", "data/proxy", "--smoke"], ["--data-path=/data/other/"]])
def test_custom_data_path_skips_the_fineweb_download(box, args):
    r = box.gpus(1).run(*args)
    assert r.returncode == 0, r.stderr
    assert box.commands() == [REQS, GPU_REQS, BYTECODE, check(*args), torchrun(1, *args)]
    assert "not downloading" in r.stdout


@pytest.mark.parametrize("args", [["--data-path", "data/fineweb10B"], ["--data-path=./data/fineweb10B/"]])
def test_default_data_path_still_downloads(box, args):
    assert box.gpus(1).run(*args).returncode == 0
    assert DOWNLOAD in box.commands()


def test_gpu_extras_that_fail_to_install_are_skipped_with_one_line(box):
    r = box.gpus(8).run(STUB_GPU_PIP_RC="1")
    assert r.returncode == 0, r.stderr
    assert box.commands() == [REQS, GPU_REQS, BYTECODE, check_flags(), DOWNLOAD, check(), torchrun(8)]
    lines = [line for line in r.stdout.splitlines() if "requirements-gpu.txt" in line]
    assert len(lines) == 1 and "carrying on" in lines[0]


def test_gpu_extras_need_cuda_13_torch(box):
    r = box.gpus(8).run(STUB_CUDA="12.8")
    assert r.returncode == 0, r.stderr
    assert box.commands() == [REQS, BYTECODE, check_flags(), DOWNLOAD, check(), torchrun(8)]
    assert "skipping requirements-gpu.txt" in r.stdout and "CUDA 12.8" in r.stdout


def test_setup_gpu_compiles_bytecode_only_of_packages_it_finds(box, tmp_path):
    """Bytecode for torch and the kernel libraries once at setup (an image may ship none); nothing found, no step."""
    assert box.gpus(1).run("setup-gpu", STUB_BYTECODE_DIRS="/site/torch\n/site/quack").returncode == 0
    assert box.commands()[-1] == ["-m", "compileall", "-q", "-j", "0", "/site/torch", "/site/quack"]
    (tmp_path / "again").mkdir()
    nothing = Sandbox(tmp_path / "again")
    assert nothing.gpus(1).run("setup-gpu", STUB_BYTECODE_DIRS="").returncode == 0
    assert nothing.commands() == [REQS, GPU_REQS]


def test_cpu_only_torch_on_a_gpu_machine_is_an_error_before_downloading(box):
    r = box.gpus(8).run(STUB_CUDA="")
    assert r.returncode == 2
    assert box.commands() == [REQS]
    assert len(r.stderr.splitlines()) == 1 and "CUDA build" in r.stderr


def test_setup_gpu_installs_without_downloading_or_training(box):
    r = box.gpus(2).run("setup-gpu")
    assert r.returncode == 0, r.stderr
    assert box.commands() == [REQS, GPU_REQS, BYTECODE]


# ---- launch: the check, then torchrun without its failure report ------------------------------------------------

def test_launch_checks_then_starts_nproc_processes_without_a_gpu(box):
    r = box.run("launch", "2", "--smoke", "--data-path", "data/proxy")  # no nvidia-smi: launch does not need one
    assert r.returncode == 0, r.stderr
    assert box.commands() == [check("--smoke", "--data-path", "data/proxy"), torchrun(2, "--smoke", "--data-path",
                                                                                      "data/proxy")]
    assert box.calls()[0]["env"]["WORLD_SIZE"] == "2"
    assert box.calls()[-1]["env"] == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                                      "NVSHMEM_DISABLE_NVLS": "1", "WORLD_SIZE": None}


def test_launch_stops_at_a_failed_check(box):
    r = box.run("launch", "4", "--orthogonalizer", "newton", STUB_CHECK_RC="2")
    assert r.returncode == 2
    assert box.commands() == [check("--orthogonalizer", "newton")]
    assert r.stderr.splitlines() == ["error: --orthogonalizer: invalid choice (see --help)"]


@pytest.mark.parametrize("args", [[], ["0"], ["-1"], ["two"], ["2.0"], ["--smoke"], ["3"], ["16"]])
def test_launch_needs_a_process_count_of_1_2_4_or_8_first(box, args):
    r = box.run("launch", *args)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "1, 2, 4 or 8 on this machine" in lines[0] and "./run.sh launch NPROC" in lines[0], \
        r.stderr
    assert box.calls() == []


def test_launch_says_so_when_the_check_ends_without_a_word(box):
    """A PYTHON that is no Python with torch (/bin/false, say) ends the check with status 1 and nothing printed."""
    r = box.run("launch", "2", "--smoke", STUB_CHECK_RC="1", STUB_CHECK_SILENT="1")
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == ["run.sh: the check (python3 train_gpt.py --check) ended with status 1; is "
                                     "python3 a Python with torch (PYTHON picks it)?"], r.stderr


# The same, for real: 2 gloo processes of the trainer on the CPU, each run a few seconds of torch imports.

# Put first on PYTHONPATH, this makes worker FAIL_RANK (and no other process: the check and torchrun have no RANK)
# fail as FAIL_HOW says at its start: a crash with that exit status, or killed by SIGKILL as by the OOM killer.
# Its sibling is then stopped by torchrun while still importing torch, before the trainer could say anything.
FAILING_WORKER = """import os, signal
if os.environ.get("RANK") == os.environ["FAIL_RANK"]:
    print(f"stand-in failure on rank {os.environ['RANK']}, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
          flush=True)
    if os.environ["FAIL_HOW"] == "SIGKILL":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(int(os.environ["FAIL_HOW"]))
"""
# What torchrun's own report and logs are made of; none of it is in a worker's output (frames of the trainer, or of
# torch/distributed/distributed_c10d.py, are).
TORCHRUN_REPORT = ("ChildFailedError", "Root Cause", "exitcode", "SignalException", "death signal", "*****",
                   "torch/distributed/elastic", "torch/distributed/launcher", "torch/distributed/run.py",
                   'File "<string>"')


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("launch_data")
    build_shards(folder, train_shards=2, tokens_per_train_shard=100_000, val_tokens=10_000)
    return folder


def real_launch_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHON", "OMP_NUM_THREADS", "PYTHONPATH") + LAUNCH_ENV
           and k not in ("RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHON": sys.executable, "PYTHONWARNINGS": "ignore", **extra}


def tiny_run(shards, tmp_path, *extra):
    return ["--smoke", "--device", "cpu", "--data-path", str(shards), "--log-dir", str(tmp_path / "logs"),
            "--num-scheduled-iterations", "6", "--num-extension-iterations", "0", *extra]


@pytest.mark.slow
def test_launch_bad_flag_is_the_trainers_one_line_and_exit_2(shards, tmp_path):
    r = run_group(["bash", str(RUN_SH), "launch", "2", *tiny_run(shards, tmp_path, "--val-tokens", "abc")],
                  env=real_launch_env(), timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "--val-tokens" in lines[0], r.stderr
    assert r.stdout == "" and not (tmp_path / "logs").exists()


@pytest.mark.slow
@pytest.mark.parametrize("rank, how, status, line", [
    ("1", "7", 7, "run.sh: rank 1 exited with status 7 (its output is above)"),
    ("0", "SIGKILL", 137, "run.sh: rank 0 was killed by SIGKILL (its output is above)"),
    ("1", "3", 3, None)], ids=["crash", "killed", "status-the-trainer-reports"])
def test_launch_exits_with_a_failed_workers_status_and_at_most_one_line(shards, tmp_path, rank, how, status, line):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(FAILING_WORKER)
    env = real_launch_env(PYTHONPATH=str(tmp_path / "site"), FAIL_RANK=rank, FAIL_HOW=how)
    r = run_group(["bash", str(RUN_SH), "launch", "2", *tiny_run(shards, tmp_path)], env=env, timeout=90,
                  stdin=subprocess.DEVNULL)
    assert r.returncode == status, r.stdout + r.stderr
    assert r.stderr.splitlines() == ([line] if line else []), r.stderr
    # torchrun's default of one thread per worker holds, without its warning
    assert f"stand-in failure on rank {rank}, OMP_NUM_THREADS=1" in r.stdout.splitlines(), r.stdout
    assert not any(noise in r.stdout for noise in TORCHRUN_REPORT + ("Traceback",)), r.stdout


def workers_of(pid):
    """Live pids whose parent is pid (torchrun starts each worker in a session of its own)."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(stat.parent.name))
    return sorted(kids)


@pytest.mark.slow
def test_launch_interrupted_by_sigint_exits_130_and_stops_every_worker(shards, tmp_path):
    """Ctrl-C reaches the launcher's process group; torchrun stops the workers, which are in sessions of their own."""
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    cmd = ["bash", str(RUN_SH), "launch", "2", *tiny_run(shards, tmp_path)]
    workers = []
    with open(out, "w") as stdout, open(err, "w") as stderr, \
            subprocess.Popen(cmd, env=real_launch_env(), stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL,
                             start_new_session=True) as proc:
        STARTED_GROUPS.add(proc.pid)
        try:
            deadline = time.monotonic() + 60
            # rank 0 opens its log once the trainer is built: both ranks are past init and into training
            while not list((tmp_path / "logs").glob("*.txt")) and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert proc.poll() is None and list((tmp_path / "logs").glob("*.txt")), out.read_text() + err.read_text()
            workers = workers_of(proc.pid)  # bash exec'd the launcher, so proc.pid is torchrun's agent
            assert len(workers) == 2
            time.sleep(1.0)
            os.killpg(proc.pid, signal.SIGINT)
            status = proc.wait(timeout=45)
            survivors = {w: group_members(w) for w in workers if group_members(w)}
        finally:
            kill_group(proc.pid)
            for w in workers:
                kill_group(w)
    text = err.read_text()
    assert status == 130, out.read_text() + text
    assert survivors == {}  # no worker, nor anything one started, outlives the launcher
    # Only the workers may speak, of their interruption: the trainer's own lines are not pinned here.
    assert not any(noise in text for noise in TORCHRUN_REPORT + ("run.sh:",)), text


# ---- CPU setup, tests, proxy data, records ---------------------------------------------------------------------

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
DEV_REQS = pip_install("--disable-pip-version-check", "-r", "requirements-dev.txt")
INDEX_DOWN = "[Errno -2] Name or service not known"


def dry_run(*args):
    """setup-cpu asking pip which torch it would install (nothing installed; the answer goes to REPORT)."""
    return pip_install("--disable-pip-version-check", "--dry-run", "--quiet", "--report", "REPORT", "--no-deps",
                       "--ignore-installed", *args, "torch>=2.10")


def pip_report(version, url, requires=("filelock", "sympy>=1.13.3")):
    """What `pip install --dry-run --report` writes when it would install torch VERSION from URL."""
    return json.dumps({"version": "1", "install": [{"download_info": {"url": url}, "metadata": {
        "name": "torch", "version": version, "requires_dist": list(requires)}}]})


PYPI = "https://files.pythonhosted.org/packages"
PYPI_CUDA = pip_report("2.14.1", f"{PYPI}/torch-2.14.1-cp311-cp311-manylinux_2_28_x86_64.whl",
                       ["filelock", 'nvidia-cudnn-cu13==9.24.0.43; platform_system == "Linux"'])
LOCAL_WHEEL = "/opt/wheels/torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
LOCAL_CPU = pip_report("2.13.0+cpu", "file:///opt/wheels/torch-2.13.0%2Bcpu-cp311-cp311-manylinux_2_28_x86_64.whl")


def unreachable_line(r):
    lines = [ln for ln in r.stdout.splitlines() + r.stderr.splitlines() if "download.pytorch.org" in ln]
    assert len(lines) == 1, r.stdout + r.stderr
    return lines[0]


def test_setup_cpu_installs_cpu_torch_then_the_dev_requirements(box):
    r = box.run("setup-cpu")  # no nvidia-smi: the CPU setup does not need one; the stub's CPU index answers
    assert r.returncode == 0, r.stderr
    assert box.commands() == [pip_install("--disable-pip-version-check", "torch", "--index-url", CPU_INDEX), DEV_REQS]
    assert box.questions("cpu_index_probe") == [[f"{CPU_INDEX}/torch/"]]  # asked once, before installing
    assert f"run.sh: installing torch from {CPU_INDEX} (the CPU build)" in r.stdout.splitlines()
    assert "import torch, triton, pytest" in box.calls()[-1]["argv"][1]  # it checks the result


@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.10.0", "2.14.1", "2.11.0.dev20250301+cpu"])
def test_setup_cpu_keeps_an_installed_torch_of_at_least_2_10(box, version):
    r = box.torch(version).run("setup-cpu", STUB_PROBE=INDEX_DOWN)
    assert r.returncode == 0, r.stderr
    assert box.commands() == [DEV_REQS]  # no torch install, no dry run
    assert box.questions("cpu_index_probe") == []
    assert f"run.sh: keeping the installed torch {version} (requirements.txt asks for >= 2.10)" in r.stdout.splitlines()


@pytest.mark.parametrize("version", ["2.9.1+cpu", "2.10.0.dev20250101+cpu", "2.10.0rc1"])
def test_setup_cpu_replaces_a_torch_older_than_2_10(box, version):
    """What pip would not take for torch>=2.10 (a 2.10 pre-release included) is not kept."""
    r = box.torch(version).run("setup-cpu")
    assert r.returncode == 0, r.stderr
    assert box.commands() == [pip_install("--disable-pip-version-check", "torch", "--index-url", CPU_INDEX), DEV_REQS]
    assert "keeping" not in r.stdout


def test_setup_cpu_unreachable_index_installs_the_cpu_torch_pip_offers(box):
    """Where pip's own sources offer a CPU build (macOS, or a CPU wheel in find-links), that version is pinned."""
    macos = pip_report("2.12.0", f"{PYPI}/torch-2.12.0-cp311-none-macosx_11_0_arm64.whl")
    r = box.run("setup-cpu", STUB_PROBE=INDEX_DOWN, STUB_PIP_TORCH=macos, STUB_LOCAL_TORCH=PYPI_CUDA)
    assert r.returncode == 0, r.stderr
    assert box.commands() == [dry_run(), pip_install("--disable-pip-version-check", "torch==2.12.0"), DEV_REQS]
    assert unreachable_line(r) == (f"run.sh: download.pytorch.org unreachable ({INDEX_DOWN}); installing torch 2.12.0 "
                                   "found by pip (a CPU build)")


@pytest.mark.parametrize("pip_offers, says", [
    (PYPI_CUDA, "pip offers only a CUDA build here (torch 2.14.1)"),
    (pip_report("2.14.1+cu130", "file:///opt/wheels/x.whl"), "pip offers only a CUDA build here (torch 2.14.1+cu130)"),
    (pip_report("2.14.1+xpu", "file:///opt/wheels/y.whl"), "pip offers only a non-CPU build here (torch 2.14.1+xpu)"),
    ("", "pip finds no torch>=2.10 here")], ids=["nvidia-requirements", "cu-label", "xpu-label", "nothing"])
def test_setup_cpu_unreachable_index_installs_the_local_cpu_wheel(box, pip_offers, says):
    """PyPI's torch on Linux x86_64 is the CUDA build: then a CPU wheel among pip's local wheels is installed, as
    that very file (`pip install --no-index torch==2.13.0+cpu` would find none of its dependencies)."""
    r = box.run("setup-cpu", STUB_PROBE=INDEX_DOWN, STUB_PIP_TORCH=pip_offers, STUB_LOCAL_TORCH=LOCAL_CPU)
    assert r.returncode == 0, r.stderr
    assert box.commands() == [dry_run(), dry_run("--no-index"), pip_install("--disable-pip-version-check", LOCAL_WHEEL),
                              DEV_REQS]
    assert unreachable_line(r) == (f"run.sh: download.pytorch.org unreachable ({INDEX_DOWN}) and {says}; installing "
                                   f"the CPU build torch 2.13.0+cpu from pip's local wheels ({LOCAL_WHEEL})")


@pytest.mark.parametrize("local", ["", pip_report("2.13.0+cu128", "file:///opt/wheels/torch-2.13.0+cu128.whl"),
                                   pip_report("2.13.0", "file:///opt/wheels/t.whl", ["nvidia-nccl-cu12"]),
                                   pip_report("2.13.0+rocm6.4", "file:///opt/wheels/torch-2.13.0+rocm6.4.whl")],
                         ids=["no-local-wheel", "local-cu-label", "local-nvidia-requirements", "local-rocm"])
def test_setup_cpu_unreachable_index_and_only_cuda_torch_exits_2_installing_nothing(box, local):
    r = box.run("setup-cpu", STUB_PROBE=INDEX_DOWN, STUB_PIP_TORCH=PYPI_CUDA, STUB_LOCAL_TORCH=local)
    assert r.returncode == 2, r.stdout + r.stderr
    assert box.commands() == [dry_run(), dry_run("--no-index")]  # no install of any kind
    line = unreachable_line(r)
    assert line in r.stderr
    for part in ("run.sh: download.pytorch.org is unreachable", "pip offers only a CUDA build here (torch 2.14.1)",
                 "never installs a CUDA build", f"pip install torch --index-url {CPU_INDEX}",
                 "pip install /path/to/torch-*+cpu*.whl", "rerun ./run.sh setup-cpu (it keeps that torch)"):
        assert part in line, part


def test_setup_cpu_unreachable_index_and_no_torch_anywhere_exits_2(box):
    r = box.run("setup-cpu", STUB_PROBE=INDEX_DOWN)
    assert r.returncode == 2
    assert box.commands() == [dry_run(), dry_run("--no-index")]
    line = unreachable_line(r)
    assert "pip finds no torch>=2.10 here" in line and "./run.sh setup-cpu" in line


def test_setup_cpu_probe_gives_up_at_once_on_a_refused_connection(box):
    """The real probe code, sent through https_proxy to a closed local port (no real network)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    box.env = {k: v for k, v in box.env.items() if k.lower() not in ("no_proxy", "https_proxy", "all_proxy")}
    r = box.run("setup-cpu", STUB_PROBE="real", STUB_PIP_TORCH=PYPI_CUDA, STUB_LOCAL_TORCH=LOCAL_CPU,
                https_proxy=f"http://127.0.0.1:{port}")
    assert r.returncode == 0, r.stderr
    assert unreachable_line(r).startswith("run.sh: download.pytorch.org unreachable ([Errno 111] Connection refused)")
    assert box.commands()[2] == pip_install("--disable-pip-version-check", LOCAL_WHEEL)


@pytest.mark.parametrize("env, spec", [
    ({"TORCH_CPU_SPEC": "torch==2.13.0", "TORCH_CPU_INDEX": ""}, ["torch==2.13.0"]),
    ({"TORCH_CPU_SPEC": "torch==2.13.0"}, ["torch==2.13.0", "--index-url", CPU_INDEX]),
    ({"TORCH_CPU_INDEX": "https://mirror/cpu"}, ["torch", "--index-url", "https://mirror/cpu"])],
    ids=["spec-and-pip-default", "spec", "index"])
def test_setup_cpu_overrides_from_the_environment_skip_the_detection(box, env, spec):
    r = box.torch("2.13.0+cpu").run("setup-cpu", STUB_PROBE=INDEX_DOWN, STUB_PIP_TORCH=PYPI_CUDA, **env)
    assert r.returncode == 0, r.stderr
    assert box.commands() == [pip_install("--disable-pip-version-check", *spec), DEV_REQS]
    assert box.questions("cpu_index_probe") == [] and box.questions("torch_to_keep") == []


def test_setup_cpu_stops_when_pip_fails(box):
    r = box.run("setup-cpu", STUB_PIP_RC="1")
    assert r.returncode != 0
    assert len(box.commands()) == 1  # the torch install failed: requirements-dev.txt was not tried


def test_test_command_passes_its_arguments_to_pytest_as_given(box):
    r = box.run("test", "-k", "schedules", "-x")
    assert r.returncode == 0, r.stderr
    assert box.commands() == [["-m", "pytest", "-q", "-n", "auto", "--dist", "loadfile", "-k", "schedules", "-x"]]
    box.log.unlink()
    r = box.run("test", "tests/test_schedules.py")
    assert r.returncode == 0, r.stderr
    assert box.commands() == [["-m", "pytest", "-q", "-n", "auto", "--dist", "loadfile", "tests/test_schedules.py"]]


@pytest.mark.parametrize("path", ["tests/nonexistent_test.py", "tests/nonexistent_test.py::test_x", "nowhere/"])
def test_a_test_path_that_is_not_there_is_one_line_before_pytest_runs(box, path):
    r = box.run("test", "-x", path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [f"run.sh: {path.split('::')[0]}: no such test file or folder (paths are relative "
                                     "to the repository root, e.g. tests/test_model.py)"], r.stderr
    assert [c for c in box.commands() if c[:2] == ["-m", "pytest"]] == []


@pytest.mark.parametrize("args, passed", [([], "2 passed"), (["-k", "two"], "1 passed, 1 deselected"),
                                          (["tests/test_one.py"], "1 passed")], ids=["no-args", "-k", "one-file"])
def test_test_command_runs_the_suite_or_only_the_file_it_is_given(tmp_path, args, passed):
    """For real, on a planted suite: with no path pytest.ini's testpaths picks tests/ (-k too); a file given runs
    alone, not with the whole suite."""
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    for name in ("run.sh", "pytest.ini"):
        shutil.copy(REPO / name, repo / name)
    for name in ("one", "two"):
        (repo / "tests" / f"test_{name}.py").write_text(f"def test_{name}():\n    pass\n")
    (repo / "test_outside.py").write_text("def test_outside():\n    raise AssertionError\n")  # not under tests/
    env = {k: v for k, v in os.environ.items() if k != RUN_DIR_ENV and not k.startswith("PYTEST_")}
    r = run_group(["bash", str(repo / "run.sh"), "test", "-n", "0", "-p", "no:cacheprovider", *args],
                  env={**env, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and lines[1].startswith(f"{passed} in ") and r.stderr == "", r.stdout + r.stderr


def test_test_command_without_pytest_timeout_says_how_to_set_up(box):
    """Without pytest-timeout, pytest.ini's per-test limit would silently be off. The real lookup, on stand-ins of
    every other test package."""
    for name in ("pytest", "xdist", "triton", "numpy", "tiktoken"):  # torch: the sandbox's own (Sandbox.torch)
        (box.site / name).mkdir()
        (box.site / name / "__init__.py").write_text("")
    r = box.run("test", STUB_FIND_SPEC="real")
    assert r.returncode == 2
    assert box.commands() == [] and r.stdout == ""  # pytest was not started
    assert r.stderr.splitlines() == [
        "run.sh: the test environment is not set up (pytest-timeout not installed for python3); run ./run.sh "
        "setup-cpu first (CPU torch + requirements-dev.txt), or python3 -m pip install -r requirements-dev.txt where "
        "torch is already installed"]
    (box.site / "pytest_timeout.py").write_text("")
    assert box.run("test", STUB_FIND_SPEC="real").returncode == 0


def test_test_command_without_pytest_says_how_to_set_up(box):
    r = box.run("test", STUB_MISSING="pytest")
    assert r.returncode == 2
    assert box.commands() == []  # pytest was not started
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and "pytest" in lines[0] and "./run.sh setup-cpu" in lines[0]
    assert "requirements-dev.txt" in lines[0]


def test_proxy_builds_from_the_corpus_folder(box, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name in ("train.jsonl.xz", "val.jsonl.xz"):
        (corpus / name).write_bytes(b"")
    r = box.run("proxy", str(corpus))  # works without a GPU
    assert r.returncode == 0, r.stderr
    assert box.commands() == [["data/fineweb.py", "--input", f"{corpus}/train.jsonl.xz",
                               "--val-input", f"{corpus}/val.jsonl.xz", "--out-dir", "data/proxy"]]


def test_proxy_with_a_wrong_folder_is_one_line_error(box, tmp_path):
    r = box.run("proxy", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
    assert "nowhere" in r.stderr and "./run.sh proxy CORPUS_DIR" in r.stderr
    assert '"text" field' in r.stderr and "data/fineweb.py --input" in r.stderr  # what a corpus is, and plain text
    assert box.calls() == []


def test_record_passes_its_arguments_to_compare(box):
    r = box.run("record", "myexp", "3", "--data-path", "data/proxy", "--smoke")
    assert r.returncode == 0, r.stderr
    assert box.commands() == [["records/compare.py", "run", "myexp", "3", "--data-path", "data/proxy", "--smoke"]]


PYTHON_FORMS = [["launch", "2", "--smoke"], ["test", "-x"], ["setup-cpu"], ["setup-gpu"], ["record", "x", "1"],
                ["proxy"], ["train"], ["--seed", "1"], []]


def bare_path(tmp_path, *tools):
    """A PATH of only these tools (no python3, no stubs)."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for tool in tools:
        (bare / tool).symlink_to(shutil.which(tool))
    return str(bare)


@pytest.mark.parametrize("form", PYTHON_FORMS, ids=lambda f: " ".join(f) or "none")
def test_a_python_that_cannot_be_run_is_one_line_error_before_anything_runs(box, tmp_path, form):
    box.gpus(8)
    for python in ("/nonexistent", str(tmp_path)):  # missing; a folder (not executable as a program)
        r = box.run(*form, PYTHON=python)
        assert r.returncode == 2 and r.stdout == "", r.stderr
        assert r.stderr.splitlines() == [
            f"run.sh: PYTHON={python} names no runnable interpreter (not found, or not executable); set "
            "PYTHON=/path/to/python3, or unset it to use python3 from PATH"]
    r = box.run(*form, PATH=bare_path(tmp_path, "bash", "dirname"))  # PYTHON unset, no python3 on PATH
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert r.stderr.splitlines() == ["run.sh: python3 is not on PATH (and PYTHON is not set); install Python 3, or "
                                     "set PYTHON=/path/to/python3"]
    assert box.calls() == []


@pytest.mark.parametrize("word", ["--help", "help"])
def test_help_and_unknown_words_need_no_python(box, tmp_path, word):
    path = bare_path(tmp_path, "bash", "dirname", "cat")
    r = box.run(word, PYTHON="/nonexistent", PATH=path)
    assert r.returncode == 0 and r.stdout.startswith("Usage: ./run.sh") and r.stderr == ""
    r = box.run("tset", PYTHON="/nonexistent", PATH=path)  # reported as what it is
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1
    assert r.stderr.startswith("run.sh: unknown command 'tset'")


def test_python_env_var_picks_the_interpreter(box, tmp_path):
    other = tmp_path / "otherpy"
    other.write_text(STUB)
    other.chmod(0o755)
    (box.bin / "python3").unlink()  # only $PYTHON can answer now
    r = box.run("record", "x", "1", PYTHON=str(other))
    assert r.returncode == 0, r.stderr
    assert box.calls()[0]["prog"] == "otherpy"


# ---- requirements files and CI -------------------------------------------------------------------------------

def requirement_names(path):
    names = []
    for line in (REPO / path).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line and not line.startswith("-"):
            names.append(line.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower())
    return names


def test_requirements_files_split():
    runtime = requirement_names("requirements.txt")
    assert {"torch", "triton", "numpy", "tiktoken", "huggingface_hub", "tqdm", "pyarrow", "scipy",
            "matplotlib"} <= set(runtime)
    assert "pytest" not in runtime and "flash-attn-4" not in runtime and "quack-kernels" not in runtime
    dev = (REPO / "requirements-dev.txt").read_text().splitlines()
    assert "-r requirements.txt" in dev and requirement_names("requirements-dev.txt") == ["pytest", "pytest-xdist", "pytest-timeout"]
    assert {"flash-attn-4", "quack-kernels"} <= set(requirement_names("requirements-gpu.txt"))


def test_ci_uses_the_documented_commands_only():
    text = (REPO / ".ci" / "run").read_text()
    assert "pip install" not in text  # no package list of its own
    assert "./run.sh setup-cpu" in text and "./run.sh test" in text


def test_ci_script_with_stubs(box):
    """As on the CI machines: no download.pytorch.org, PyPI's CUDA torch, a CPU wheel among pip's local wheels."""
    ci = REPO / ".ci" / "run"
    r = box.run(script=ci, STUB_PROBE=INDEX_DOWN, STUB_PIP_TORCH=PYPI_CUDA, STUB_LOCAL_TORCH=LOCAL_CPU)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.rstrip().endswith("CI: ok")
    assert box.commands() == [dry_run(), dry_run("--no-index"), pip_install("--disable-pip-version-check", LOCAL_WHEEL),
                              DEV_REQS, ["-m", "pytest", "-q", "-n", "auto", "--dist", "loadfile"]]


@pytest.mark.parametrize("out, rc, expect", [("2 passed, 1 failed in 3s", "1", "test suite failed (exit 1)"),
                                             ("no tests ran in 0.01s", "5", "test suite failed (exit 5)"),
                                             ("0 passed in 0.01s", "0", "no passing tests"),
                                             ("", "0", "no passing tests")])
def test_ci_script_fails_when_tests_do_not_pass(box, out, rc, expect):
    r = box.run(script=REPO / ".ci" / "run", STUB_PYTEST_OUT=out, STUB_PYTEST_RC=rc)
    assert r.returncode != 0
    assert expect in r.stdout
