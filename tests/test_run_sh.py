"""run.sh and .ci/run, driven with stand-ins: a fake `nvidia-smi` and a stub `python3` (also `python`, `pip`,
`torchrun`) first on PATH that records every call and exits 0, so nothing is installed, downloaded or trained.

The stub answers the few `python -c` questions run.sh asks (torch's CUDA version, which test packages are
missing) from STUB_* environment variables, prints a pytest-like summary for `-m pytest`, and fails pip installs
on request (STUB_PIP_RC, STUB_GPU_PIP_RC).
"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

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
        *package_dirs_for_bytecode*) echo "${STUB_BYTECODE_DIRS-/stub/site/torch}" ;;
        *find_spec*) echo "${STUB_MISSING:-}" ;;
        *torch.version.cuda*) echo "${STUB_CUDA-13.0}" ;;
        *sys.prefix*) echo /stub/prefix ;;
    esac
elif [ "${1:-} ${2:-}" = "train_gpt.py --check" ] || [ "${1:-} ${2:-}" = "train_gpt.py --check-flags" ]; then
    [ "${STUB_CHECK_RC:-0}" = 0 ] || echo "error: --orthogonalizer: invalid choice (see --help)" >&2
    exit "${STUB_CHECK_RC:-0}"
elif [ "${1:-} ${2:-}" = "-m pytest" ]; then
    echo "${STUB_PYTEST_OUT-5 passed in 0.01s}"
    exit "${STUB_PYTEST_RC:-0}"
elif [ "${1:-} ${2:-} ${3:-}" = "-m pip install" ]; then
    case " $* " in
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
        self.env = {k: v for k, v in os.environ.items()
                    if k not in ("PYTHON", "TORCH_CPU_SPEC", "TORCH_CPU_INDEX") + LAUNCH_ENV}
        self.env.update(STUB_LOG=str(self.log), PATH=f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}")

    def _write(self, name, text):
        path = self.bin / name
        path.write_text(text)
        path.chmod(0o755)

    def gpus(self, n):
        self._write("nvidia-smi", fake_nvidia_smi(n))
        return self

    def run(self, *args, script=RUN_SH, **env):
        return subprocess.run(["bash", str(script), *args], env={**self.env, **env}, capture_output=True, text=True,
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
        """The recorded argv lists, without run.sh's `python -c` questions."""
        return [c["argv"] for c in self.calls() if c["argv"][:1] != ["-c"]]


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
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "train_gpt.py", *args]


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
                 "torchrun --standalone --nproc_per_node=2 train_gpt.py --smoke --data-path data/proxy"):
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
    for command in ("train", "setup-gpu", "setup-cpu", "test", "proxy", "record", "--data-path data/proxy"):
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


# ---- CPU setup, tests, proxy data, records ---------------------------------------------------------------------

def test_setup_cpu_installs_cpu_torch_then_the_dev_requirements(box):
    r = box.run("setup-cpu")  # no nvidia-smi: the CPU setup does not need one
    assert r.returncode == 0, r.stderr
    assert box.commands() == [
        pip_install("--disable-pip-version-check", "torch", "--index-url", "https://download.pytorch.org/whl/cpu"),
        pip_install("--disable-pip-version-check", "-r", "requirements-dev.txt")]
    assert "import torch, triton, pytest" in box.calls()[-1]["argv"][1]  # it checks the result


def test_setup_cpu_pin_and_default_index_from_the_environment(box):
    r = box.run("setup-cpu", TORCH_CPU_SPEC="torch==2.13.0", TORCH_CPU_INDEX="")
    assert r.returncode == 0, r.stderr
    assert box.commands() == [pip_install("--disable-pip-version-check", "torch==2.13.0"),
                              pip_install("--disable-pip-version-check", "-r", "requirements-dev.txt")]


def test_setup_cpu_stops_when_pip_fails(box):
    r = box.run("setup-cpu", STUB_PIP_RC="1")
    assert r.returncode != 0
    assert len(box.commands()) == 1  # the torch install failed: requirements-dev.txt was not tried


def test_test_command_runs_pytest_on_tests(box):
    r = box.run("test", "-k", "schedules", "-x")
    assert r.returncode == 0, r.stderr
    assert box.commands() == [["-m", "pytest", "-q", "tests", "-k", "schedules", "-x"]]


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
    assert box.calls() == []


def test_record_passes_its_arguments_to_compare(box):
    r = box.run("record", "myexp", "3", "--data-path", "data/proxy", "--smoke")
    assert r.returncode == 0, r.stderr
    assert box.commands() == [["records/compare.py", "run", "myexp", "3", "--data-path", "data/proxy", "--smoke"]]


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
    assert "-r requirements.txt" in dev and requirement_names("requirements-dev.txt") == ["pytest"]
    assert {"flash-attn-4", "quack-kernels"} <= set(requirement_names("requirements-gpu.txt"))


def test_ci_uses_the_documented_commands_only():
    text = (REPO / ".ci" / "run").read_text()
    assert "pip install" not in text  # no package list of its own
    assert "./run.sh setup-cpu" in text and "./run.sh test" in text


def test_ci_script_with_stubs(box):
    ci = REPO / ".ci" / "run"
    r = box.run(script=ci)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.rstrip().endswith("CI: ok")
    assert box.commands() == [pip_install("--disable-pip-version-check", "torch==2.13.0"),
                              pip_install("--disable-pip-version-check", "-r", "requirements-dev.txt"),
                              ["-m", "pytest", "-q", "tests"]]


@pytest.mark.parametrize("out, rc, expect", [("2 passed, 1 failed in 3s", "1", "test suite failed (exit 1)"),
                                             ("no tests ran in 0.01s", "5", "test suite failed (exit 5)"),
                                             ("0 passed in 0.01s", "0", "no passing tests"),
                                             ("", "0", "no passing tests")])
def test_ci_script_fails_when_tests_do_not_pass(box, out, rc, expect):
    r = box.run(script=REPO / ".ci" / "run", STUB_PYTEST_OUT=out, STUB_PYTEST_RC=rc)
    assert r.returncode != 0
    assert expect in r.stdout
