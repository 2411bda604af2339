#!/usr/bin/env bash
# speedrun launcher. The usage text below is also what `./run.sh --help` prints.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: ./run.sh [COMMAND] [ARGS...]

On a Linux machine with NVIDIA GPUs and internet:
  ./run.sh [TRAIN_ARGS...]        same as `./run.sh train`
  ./run.sh train [TRAIN_ARGS...]  setup-gpu, check TRAIN_ARGS, download 9 FineWeb train shards + the val
                                  shard into data/fineweb10B/ (skipped with --data-path DIR), then
                                  `./run.sh launch <GPUs> TRAIN_ARGS`
  ./run.sh setup-gpu              pip-install requirements.txt, then requirements-gpu.txt (optional
                                  FlashAttention-4 and quack-kernels; skipped where they do not install)

On any machine, GPU or not:
  ./run.sh launch NPROC [TRAIN_ARGS...]
                                  train_gpt.py --check TRAIN_ARGS, then NPROC processes of it under torchrun
                                  (--standalone), without torchrun's own failure report. Exit status: 0 done, 2 bad
                                  input, 3 loss went non-finite, 130/143 SIGINT/SIGTERM; any other failure of a
                                  process adds one run.sh line naming its rank and status. E.g. on a CPU:
                                  ./run.sh launch 2 --smoke --data-path data/proxy
  ./run.sh setup-cpu              a CPU build of torch, then requirements-dev.txt (runtime packages + pytest).
                                  Keeps an installed torch >= 2.10; else installs from download.pytorch.org/whl/cpu,
                                  or where that is unreachable, the CPU build pip finds elsewhere (never a CUDA
                                  build: exit 2 if there is none). TORCH_CPU_SPEC / TORCH_CPU_INDEX skip all that
                                  and set the torch requirement and its index (TORCH_CPU_INDEX= : pip's default)
  ./run.sh test [PYTEST_ARGS...]  the test suite on the CPU, a worker per core (pytest -n auto; -n 0: one); no GPU,
                                  no network, only `./run.sh setup-cpu` (or requirements-dev.txt) first
  ./run.sh proxy [CORPUS_DIR]     build data/proxy/ shards from CORPUS_DIR/{train,val}.jsonl.xz (offline;
                                  default ../shared/corpus); train on them with --data-path data/proxy,
                                  e.g. on a CPU: ./run.sh launch 2 --smoke --data-path data/proxy
  ./run.sh record NAME N [OPTIONS] [TRAIN_ARGS...]
                                  run the trainer N times, collect the logs into records/<date>_NAME
                                  (--not-a-record: into logs/not_records/<date>_NAME, no records row)
                                  (python3 records/compare.py run --help lists the OPTIONS)
  ./run.sh help | -h | --help     this text

Arguments that start with "-" go to train_gpt.py (`./run.sh --data-path data/proxy`); `python3 train_gpt.py
--help` lists them. Packages go into the CURRENT Python environment (activate a venv first for isolation);
PYTHON=/path/to/python picks the interpreter (default python3).
EOF
}

case $0 in */*) cd "${0%/*}" ;; esac  # no command substitution: a signal during one would be lost
PY=${PYTHON:-python3}
COMMANDS="train, launch, setup-gpu, setup-cpu, test, proxy, record, help"

die() {  # die EXIT_CODE MESSAGE: one line on stderr
    echo "run.sh: $2" >&2
    exit "$1"
}

# Every command but help runs $PY: one that cannot be run would fail part-way, as a bare shell error (status 127).
# command -v only looks it up, no process started. Help needs no Python, and a word that is no command is reported
# as that (below).
case "${1:-}" in
    -h | --help | help) ;;
    *)
        if [[ ${1:-} == -* || ", $COMMANDS, " == *", ${1:-train}, "* ]] && ! command -v "$PY" >/dev/null 2>&1; then
            [ -z "${PYTHON:-}" ] || die 2 "PYTHON=$PYTHON names no runnable interpreter (not found, or not executable); set PYTHON=/path/to/python3, or unset it to use python3 from PATH"
            die 2 "python3 is not on PATH (and PYTHON is not set); install Python 3, or set PYTHON=/path/to/python3"
        fi ;;
esac

wait_until_gone() {  # wait_until_gone PID: its exit status, also where a trap cut a wait short while it stopped
    local rc=0
    wait "$1" || rc=$?
    while kill -0 "$1" 2>/dev/null; do
        rc=0
        wait "$1" || rc=$?
    done
    return "$rc"
}

num_gpus() {
    # nvidia-smi missing, or present but failing (no driver), both mean no usable GPU.
    if command -v nvidia-smi >/dev/null 2>&1; then
        { nvidia-smi -L 2>/dev/null || true; } | grep -c '^GPU' || true
    else
        echo 0
    fi
}

require_gpu() {
    # Checked before anything is installed or downloaded: without a GPU those steps only waste minutes (9 shards
    # of Hub retries when offline) before the trainer fails anyway.
    local n; n=$(num_gpus)
    if [ "$n" -lt 1 ]; then
        cat >&2 <<'EOF'
run.sh: no NVIDIA GPU found (nvidia-smi is missing or lists no GPU); training the speedrun needs one, so nothing was installed or downloaded.
  CPU test suite:                     ./run.sh setup-cpu && ./run.sh test
  CPU smoke run on offline proxy data: ./run.sh proxy CORPUS_DIR && ./run.sh launch 2 --smoke --data-path data/proxy
EOF
        exit 2
    fi
    GPUS=$n
}

setup_gpu() {
    echo "run.sh: installing requirements.txt into $("$PY" -c 'import sys; print(sys.prefix)')"
    "$PY" -m pip install -q --disable-pip-version-check -r requirements.txt
    local cuda
    cuda=$("$PY" -c 'import torch; print(torch.version.cuda if torch.cuda.is_available() else "")' 2>/dev/null) || cuda=""
    if [ -z "$cuda" ]; then
        die 2 "the installed torch cannot use the GPU (a CPU-only build?); install a CUDA build, e.g. $PY -m pip install --force-reinstall torch --index-url https://download.pytorch.org/whl/cu130, then re-run"
    fi
    # FlashAttention-4 and quack-kernels are optional (the trainer falls back to PyTorch's FA2 kernels and Inductor's
    # MLP) and their CuTe DSL is the CUDA 13 build, so they are only tried on CUDA 13 torch, and a failed install
    # does not stop the run.
    if ! [[ $cuda =~ ^[0-9]+ ]] || [ "${BASH_REMATCH[0]}" -lt 13 ]; then
        echo "run.sh: skipping requirements-gpu.txt (FlashAttention-4 and quack-kernels need a CUDA 13 build of torch, this one is CUDA $cuda); attention uses PyTorch's FA2 kernels, the MLP Inductor's"
    elif ! "$PY" -m pip install -q --disable-pip-version-check -r requirements-gpu.txt; then
        echo "run.sh: requirements-gpu.txt did not install (see above); carrying on without FlashAttention-4 and quack-kernels (attention uses PyTorch's FA2 kernels, the MLP Inductor's)"
    fi
    compile_bytecode
}

compile_bytecode() {
    # pip writes Python bytecode when it installs, but some images ship torch without it (and with
    # PYTHONDONTWRITEBYTECODE set, nothing writes it later): then every rank of every start of the trainer
    # compiles thousands of source files again (seconds each time). Once, here.
    local dirs
    dirs=$("$PY" -c 'import importlib.util as u, os  # package_dirs_for_bytecode
for name in ("torch", "triton", "sympy", "numpy", "flash_attn", "quack", "cutlass"):
    spec = u.find_spec(name)
    if spec and spec.submodule_search_locations:
        print(os.path.realpath(list(spec.submodule_search_locations)[0]))' 2>/dev/null) || return 0
    [ -n "$dirs" ] || return 0
    echo "run.sh: compiling the Python bytecode of the packages the trainer imports"
    # shellcheck disable=SC2086
    "$PY" -m compileall -q -j 0 $dirs >/dev/null 2>&1 || echo "run.sh: bytecode compilation incomplete (not needed to train)"
}

# --data-path DIR other than the default means the data is already there (e.g. proxy shards): no FineWeb download.
custom_data_path() {
    local prev="" a p
    for a in "$@"; do
        p=""
        case "$a" in
            --data-path=*) p=${a#--data-path=} ;;
            *) [ "$prev" = "--data-path" ] && p=$a ;;
        esac
        prev=$a
        if [ -n "$p" ]; then
            p=${p#./}; p=${p%/}
            [ "$p" != "data/fineweb10B" ] && return 0
        fi
    done
    return 1
}

usable_gpus() {  # sets N_GPUS from GPUS (require_gpu): 1, 2, 4 or 8 keep the global batch by gradient accumulation
    local k
    N_GPUS=$GPUS
    if [ "$N_GPUS" -gt 8 ] || [ $((8 % N_GPUS)) -ne 0 ]; then
        for k in 8 4 2 1; do if [ "$N_GPUS" -ge $k ]; then N_GPUS=$k; break; fi; done
        echo "run.sh: using $N_GPUS of the visible GPUs (the trainer supports 1, 2, 4 or 8 per node)" >&2
    fi
}

launch() {  # launch NPROC [train_gpt.py args...]: the check, then NPROC workers of train_gpt.py
    local n=$1
    shift
    # The device machines have no NVLink multicast: NCCL, symmetric memory and NVSHMEM must not try it.
    export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
        NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
    # Bad flags or data fail here, in one process, as one line with exit status 2; under torchrun every worker
    # would meet them. A signal to this shell alone (not its group, as a terminal's Ctrl-C) is passed on to the
    # check, which says it was interrupted; the shell then exits with its status.
    local check rc=0
    WORLD_SIZE=$n "$PY" train_gpt.py --check "$@" &
    check=$!
    trap 'kill -INT "$check" 2>/dev/null || true' INT
    trap 'kill -TERM "$check" 2>/dev/null || true' TERM
    trap 'kill -HUP "$check" 2>/dev/null || true' HUP
    wait_until_gone "$check" || rc=$?
    trap - INT TERM HUP
    case $rc in
        0) ;;
        2 | 129 | 130 | 143) exit "$rc" ;;  # the check said why itself
        *) die 2 "the check ($PY train_gpt.py --check) ended with status $rc; is $PY a Python with torch (PYTHON picks it)?" ;;
    esac
    # torchrun itself, as a command, answers any failed worker with its own report (a traceback, a "Root Cause"
    # table, logged "failed (exitcode ...)" lines) and exit status 1, under the trainer's one-line error. Its run()
    # is called here instead, its loggers quiet: the trainer's own exit status comes out, with at most one line.
    local quiet_torchrun
    quiet_torchrun=$(cat <<'EOF'
import logging, os, signal, sys  # quiet_torchrun NPROC SCRIPT [ARGS...]

# Until torchrun installs its own handlers (before it starts a worker), a signal has nothing to stop but this.
def interrupted(signum, frame):
    print(f"interrupted by {signal.Signals(signum).name} while starting", flush=True)
    os._exit(128 + signum)
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, interrupted)

import uuid
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import get_args_parser, run
import train_gpt

# torchrun's modules set their loggers' levels, and torch its own handlers, each on import: only the process-wide
# switch holds for all of them. This process runs nothing but torchrun.
logging.disable(logging.ERROR)

# The trainer said why itself: bad input, a non-finite loss, a full disk, another rank gone first, the signals.
TRAINER_REPORTS = {2, 3, 4, train_gpt.PeerGone.status, 129, 130, 143}
nproc, script, args = sys.argv[1], sys.argv[2], sys.argv[3:]
# The workers die with this process (train_gpt.die_with_the_launcher), which names itself so that they can tell.
os.environ[train_gpt.LAUNCHER_PID_ENV] = str(os.getpid())
# The run id is picked here when not given: a rank that dies without a word is then named in its run's log.
settings = train_gpt.parse_args(args)  # the check passed: no error here
if not settings.run_id:
    args += ["--run-id", str(uuid.uuid4())]
log = train_gpt.log_path(settings, settings.run_id or args[-1])
log_before = train_gpt.file_identity(log)
try:
    # torchrun's default of OMP_NUM_THREADS=1 per worker (where unset) still applies, without its warning.
    run(get_args_parser().parse_args(["--standalone", f"--nproc_per_node={nproc}", script, *args]))
    status = 0
except ChildFailedError as e:
    # The first rank to fail. torchrun stops the others with SIGTERM, and a rank whose collective failed because
    # another had ended stops too: those are not the cause, though they may fail within the same second (the
    # failures' time is in whole seconds).
    consequences = (-signal.SIGTERM, 128 + signal.SIGTERM, train_gpt.PeerGone.status)
    causes = sorted((f.timestamp, r) for r, f in e.failures.items() if f.exitcode not in consequences)
    rank, failure = (causes[0][1], e.failures[causes[0][1]]) if causes else e.get_first_failure()
    status, said = failure.exitcode, ""
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        said = f"rank {rank} was killed by {name}"
        status = 128 - status
    elif status not in TRAINER_REPORTS:
        said = f"rank {rank} exited with status {status}"
    elif status > 128 and rank != 0:  # a signal to that rank alone: rank 0, which speaks, was stopped by torchrun
        said = f"rank {rank} was interrupted by {signal.Signals(status - 128).name}"
    if said:
        print(f"run.sh: {said} (its output is above)", file=sys.stderr)
        if train_gpt.file_identity(log) != log_before:  # this run's log, not an earlier one of its run id
            train_gpt.end_log_of_a_dead_run(log, f"stopped: {said}")
except SignalException as e:  # Ctrl-C or a SIGTERM to torchrun: it has already stopped the workers
    status = 128 + e.sigval
sys.exit(status)
EOF
)
    exec "$PY" -c "$quiet_torchrun" "$n" train_gpt.py "$@"
}

train() {
    require_gpu
    setup_gpu
    usable_gpus
    if custom_data_path "$@"; then
        echo "run.sh: --data-path given, not downloading FineWeb"
    else
        # A typo in a flag should not cost the download first: the settings alone are checked before it.
        WORLD_SIZE=$N_GPUS "$PY" train_gpt.py --check-flags "$@"
        "$PY" data/cached_fineweb10B.py 9
    fi
    launch "$N_GPUS" "$@"
}

CPU_INDEX=https://download.pytorch.org/whl/cpu

pip_install() {
    "$PY" -m pip install --disable-pip-version-check "$@"
}

torch_pick() {  # torch_pick [PIP_ARGS...]: "VERSION<tab>BUILD<tab>SOURCE" of the torch>=2.10 pip would install
    # BUILD: cpu, cuda (it requires nvidia-* packages or has a +cu label) or another local label (rocm6.2, xpu);
    # SOURCE: the wheel's path for a local file, else its URL. Nothing is installed: a dry run writes a report.
    local report rc=0
    report=$(mktemp)
    pip_install --dry-run --quiet --report "$report" --no-deps --ignore-installed "$@" "torch>=2.10" >&2 &&
        "$PY" -c 'import json, re, sys, urllib.parse, urllib.request  # torch_pick
picks = [i for i in json.load(open(sys.argv[1]))["install"] if i["metadata"]["name"].lower() == "torch"]
if not picks:
    sys.exit(1)
meta, url = picks[0]["metadata"], picks[0]["download_info"]["url"]
label = meta["version"].partition("+")[2].lower()
nvidia = any(re.match(r"nvidia[-_.]", r, re.I) for r in meta.get("requires_dist") or [])
build = "cuda" if nvidia or label.startswith("cu") else "cpu" if label in ("", "cpu") or label.startswith("cpu") else label
parts = urllib.parse.urlsplit(url)
print(meta["version"], build, urllib.request.url2pathname(parts.path) if parts.scheme == "file" else url, sep="\t")' \
        "$report" || rc=1
    rm -f "$report"
    return $rc
}

install_cpu_torch() {  # the detection of setup-cpu: keep, CPU index, or a CPU build pip finds; never a CUDA build
    local kept why pick version build source offer
    # 1. A torch that satisfies requirements.txt stays (compared as pip compares, pre-releases included): pip will
    # not touch it either.
    kept=$("$PY" -c 'import torch  # torch_to_keep
from pip._vendor.packaging.specifiers import SpecifierSet
if SpecifierSet(">=2.10").contains(torch.__version__, prereleases=True):
    print(torch.__version__)' 2>/dev/null) || kept=""
    if [ -n "$kept" ]; then
        echo "run.sh: keeping the installed torch $kept (requirements.txt asks for >= 2.10)"
        return
    fi
    # 2. PyTorch's CPU index, asked once with a 5 s limit (DNS included): where it is unreachable, pip would retry
    # it for minutes.
    if why=$("$PY" -c 'import os, sys, threading, urllib.request  # cpu_index_probe
why = []
def probe():
    try:
        urllib.request.urlopen(sys.argv[1], timeout=5).close()
        why.append("")
    except Exception as e:
        why.append(str(getattr(e, "reason", e)) or type(e).__name__)
thread = threading.Thread(target=probe, daemon=True)
thread.start()
thread.join(5)
print(why[0] if why else "no answer within 5 s"); sys.stdout.flush()
os._exit(0 if why and not why[0] else 1)' "$CPU_INDEX/torch/"); then
        echo "run.sh: installing torch from $CPU_INDEX (the CPU build)"
        pip_install torch --index-url "$CPU_INDEX"
        return
    fi
    # 3. Without that index, pip's configured sources on Linux x86_64 usually offer PyPI's torch, the CUDA build.
    # Then only local wheels (pip's find-links) are asked, and a CPU build there is installed as that very file
    # (with --no-index its dependencies could not be found).
    pick=$(torch_pick) || pick=""
    IFS=$'\t' read -r version build source <<<"$pick" || true
    if [ "$build" = cpu ]; then
        echo "run.sh: download.pytorch.org unreachable ($why); installing torch $version found by pip (a CPU build)"
        pip_install "torch==$version"
        return
    fi
    offer="pip finds no torch>=2.10 here"
    [ -z "$pick" ] || offer="pip offers only a $([ "$build" = cuda ] && echo CUDA || echo non-CPU) build here (torch $version)"
    pick=$(torch_pick --no-index 2>/dev/null) || pick=""
    IFS=$'\t' read -r version build source <<<"$pick" || true
    if [ "$build" = cpu ]; then
        echo "run.sh: download.pytorch.org unreachable ($why) and $offer; installing the CPU build torch $version from pip's local wheels ($source)"
        pip_install "$source"
        return
    fi
    die 2 "download.pytorch.org is unreachable ($why) and $offer; setup-cpu never installs a CUDA build. Install a CPU build of torch yourself, e.g. $PY -m pip install torch --index-url $CPU_INDEX where that index is reachable, or $PY -m pip install /path/to/torch-*+cpu*.whl, then rerun ./run.sh setup-cpu (it keeps that torch)"
}

setup_cpu() {
    # A plain `pip install torch` on Linux x86_64 pulls PyPI's multi-GB CUDA build, so the torch step is
    # install_cpu_torch, unless TORCH_CPU_SPEC or TORCH_CPU_INDEX is set: then exactly that is installed.
    echo "run.sh: installing CPU torch and requirements-dev.txt into $("$PY" -c 'import sys; print(sys.prefix)')"
    if [ -n "${TORCH_CPU_SPEC:-}" ] || [ -n "${TORCH_CPU_INDEX+set}" ]; then
        local spec=${TORCH_CPU_SPEC:-torch} index=${TORCH_CPU_INDEX-$CPU_INDEX}
        echo "run.sh: installing $spec${index:+ from $index} (TORCH_CPU_SPEC / TORCH_CPU_INDEX)"
        pip_install "$spec" ${index:+--index-url "$index"}
    else
        install_cpu_torch
    fi
    pip_install -r requirements-dev.txt
    "$PY" -c 'import torch, triton, pytest; print("run.sh: CPU test environment ready: torch", torch.__version__, "triton", triton.__version__, "pytest", pytest.__version__)'
}

TEST_SUITE_LIMIT_MIN=60  # the suite: 5-7 minutes on 2 idle cores, 27 on 2 cores shared with 4 other test runs; a test
                         # that hangs is stopped after 10 (pytest.ini)

run_tests() {
    # find_spec only looks the packages up (no torch import), so this check costs milliseconds.
    local missing
    # Printed as the packages to install: pytest-timeout's module is pytest_timeout (without it pytest.ini's per-test
    # limit is silently off), pytest-xdist's xdist.
    missing=$("$PY" -c 'import importlib.util as u; print(", ".join(p for m, p in (("pytest", "pytest"), ("xdist", "pytest-xdist"), ("pytest_timeout", "pytest-timeout"), ("torch", "torch"), ("triton", "triton"), ("numpy", "numpy"), ("tiktoken", "tiktoken")) if u.find_spec(m) is None))') \
        || die 2 "cannot run $PY; set PYTHON=/path/to/python"
    if [ -n "$missing" ]; then
        die 2 "the test environment is not set up ($missing not installed for $PY); run ./run.sh setup-cpu first (CPU torch + requirements-dev.txt), or $PY -m pip install -r requirements-dev.txt where torch is already installed"
    fi
    # A test file or folder that is not there: pytest would only say that no test ran.
    local a
    for a in "$@"; do
        a=${a%%::*}
        if [[ $a != -* && ($a == *.py || $a == */*) && ! -e $a ]]; then
            die 2 "$a: no such test file or folder (paths are relative to the repository root, e.g. tests/test_model.py)"
        fi
    done
    # The run's own folder (tests/conftest.py): its compile caches, the process groups tests start, the test each
    # process is running. Removed at the end, whatever happened.
    local dir pid rc=0 stop=""
    dir=$(mktemp -d "${TMPDIR:-/tmp}/speedrun-tests-XXXXXX")
    # One worker per core (pytest-xdist), each test file on one worker: a file's module-scoped fixtures (the smoke
    # run) then run once, and the two cores of a small machine halve the suite's time. A test that crashes or runs
    # past its limit (pytest.ini) fails the run; as the last guard, a run still going after TEST_SUITE_LIMIT_MIN is
    # interrupted as Ctrl-C would, and killed a minute later. timeout puts the suite in a process group of its own
    # (workers and what they fork included) that it signals whole; the terminal's Ctrl-C then reaches only this
    # shell, so the suite runs in the background and the traps below pass INT and TERM on, as INT (pytest cleans up).
    # The arguments go to pytest as given: with no path among them, pytest.ini's testpaths picks tests/ (run.sh runs
    # from the repository root, pytest's rootdir); a `tests` of our own would add the whole suite to
    # `./run.sh test tests/test_x.py`.
    SPEEDRUN_TEST_RUN_DIR=$dir timeout --signal=INT --kill-after=60 "${TEST_SUITE_LIMIT_MIN}m" \
        "$PY" -m pytest -q -n auto --dist loadfile "$@" &
    pid=$!
    trap 'stop=130; kill -INT "$pid" 2>/dev/null || true' INT
    trap 'stop=143; kill -INT "$pid" 2>/dev/null || true' TERM
    wait_until_gone "$pid" || rc=$?
    trap - INT TERM
    local running
    running=$(cat "$dir"/running/* 2>/dev/null | tr '\n' ' ') || true
    running=${running% }
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "run.sh: the test suite ran past its ${TEST_SUITE_LIMIT_MIN}-minute limit and was stopped; tests running then: ${running:-none}" >&2
        rc=1
    elif [ -n "$stop" ]; then
        rc=$stop  # stopped by a signal: its status, whatever pytest made of it
    elif [ "$rc" -gt 128 ]; then  # pytest itself died (one process, -n 0, that crashed or was killed)
        echo "run.sh: the test run was killed by signal $((rc - 128)); tests running then: ${running:-none}" >&2
    fi
    # Groups a test started are killed by the suite itself, unless it was killed first (it records them here).
    local group
    for group in "$dir"/groups/*; do
        [ -e "$group" ] && kill -KILL -- "-${group##*/}" 2>/dev/null || true
    done
    rm -rf "$dir"
    exit "$rc"
}

proxy() {
    [ $# -le 1 ] || die 2 "proxy takes one argument, the corpus folder (got $#); usage: ./run.sh proxy [CORPUS_DIR]"
    local corpus=${1:-../shared/corpus}
    if [ ! -f "$corpus/train.jsonl.xz" ] || [ ! -f "$corpus/val.jsonl.xz" ]; then
        die 2 "no train.jsonl.xz and val.jsonl.xz in '$corpus'; pass the folder that holds them: ./run.sh proxy CORPUS_DIR (a corpus: those two files, one JSON object per line with a \"text\" field; from plain .txt files instead: $PY data/fineweb.py --input TRAIN.txt --val-input VAL.txt --txt-docs-sep --out-dir data/proxy)"
    fi
    exec "$PY" data/fineweb.py --input "$corpus/train.jsonl.xz" --val-input "$corpus/val.jsonl.xz" --out-dir data/proxy
}

# The first word picks the command; none, or a flag, is the default form (flags go to the trainer).
cmd=train
case "${1:-}" in
    -h | --help | help) usage; exit 0 ;;
    "" | -*) ;;
    *) cmd=$1; shift ;;
esac
case "$cmd" in
    train) train "$@" ;;
    launch)
        [[ ${1:-} =~ ^[1248]$ ]] ||
            die 2 "launch needs the number of processes first: 1, 2, 4 or 8 on this machine (got '${1:-}'); usage: ./run.sh launch NPROC [TRAIN_ARGS...]"
        launch "$@" ;;
    setup-gpu | setup-cpu)
        [ $# -eq 0 ] || die 2 "$cmd takes no arguments (got: $*); ./run.sh --help shows the usage"
        if [ "$cmd" = setup-gpu ]; then require_gpu; setup_gpu; else setup_cpu; fi ;;
    test) run_tests "$@" ;;
    proxy) proxy "$@" ;;
    record) exec "$PY" records/compare.py run "$@" ;;
    *) die 2 "unknown command '$cmd' (commands: $COMMANDS); ./run.sh --help shows the usage" ;;
esac
