import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# GPT-2 BPE files ship with the repo, so tokenization never needs the network.
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(REPO / "data" / "tiktoken_cache"))

import pytest  # noqa: E402

from processes import RUN_DIR_ENV, STARTED_GROUPS, group_members, kill_group, recorded_groups_left  # noqa: E402

# The run's own folder (`./run.sh test` makes one and removes it; a bare pytest gets one here): the compile caches,
# the process groups tests started, the test each process is running. Workers and the commands tests start inherit
# it through the environment, which is set here, before anything imports torch.
IS_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
OWN_RUN_DIR = not os.environ.get(RUN_DIR_ENV)
if OWN_RUN_DIR:
    os.environ[RUN_DIR_ENV] = tempfile.mkdtemp(prefix="speedrun-tests-")
RUN_DIR = Path(os.environ[RUN_DIR_ENV])
# Compiled kernels from another run may not fit this one: Inductor's cache key leaves out the CPU's vector ISA
# (tests/INDUCTOR_CACHE_SEGFAULT.md), and a user's own cache folder is no exception. The suite always compiles into
# its own folders; tests of the caches themselves name other folders explicitly. TRITON_CACHE_DIR is left unset, as
# the trainer expects (Inductor and the trainer then put Triton's cache in Inductor's folder, per GPU); Triton's own
# default, under TRITON_HOME, is the run's too.
CACHE_DIRS = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_HOME", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "QUACK_CACHE_DIR")
USERS_CACHE_DIRS = {} if IS_WORKER else {var: os.environ[var] for var in CACHE_DIRS + ("TRITON_CACHE_DIR",)
                                         if os.environ.get(var) and not os.environ[var].startswith(str(RUN_DIR))}
for var in CACHE_DIRS:
    os.environ[var] = str(RUN_DIR / "caches" / var.lower())
os.environ.pop("TRITON_CACHE_DIR", None)
# Inductor compiles in a pool of subprocesses when it may use more than one thread; with a worker per core there is
# no core to spare, and each pool's processes cost seconds of importing torch. One thread: it compiles in-process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
CRASHED = RUN_DIR / "crashed"  # written by the main process when a worker dies: the others stop after their test
RUNNING = RUN_DIR / "running"  # a file per process, naming its running test (run.sh reads them if the suite hangs)
PROCESS_NAME = os.environ.get("PYTEST_XDIST_WORKER", "main")
CONFIG = None  # pytest's, from pytest_configure

if IS_WORKER:  # `./run.sh test` runs a worker per core: one thread each, not one per core
    import torch
    torch.set_num_threads(1)

if IS_WORKER and sys.platform.startswith("linux"):
    import ctypes
    import signal

    _libc = ctypes.CDLL(None, use_errno=True)
    _forking_pid = [0]

    def _die_with_the_worker():
        # A process a test forks (the gloo ranks of tests/dist_utils.py) holds the worker's pipe to the main process.
        # Were it to outlive a worker that crashed, the main process would wait for that pipe to close, for ever.
        _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        if os.getppid() != _forking_pid[0]:  # the worker died before the line above
            os._exit(1)

    os.register_at_fork(before=lambda: _forking_pid.__setitem__(0, os.getpid()), after_in_child=_die_with_the_worker)


class CrashStop:
    """The main process of an xdist run: a worker that crashed (or was killed by the per-test timeout) stops the run."""

    def __init__(self, config):
        self.config = config
        self.started = {}  # nodeid: when its worker started it

    def pytest_runtest_logstart(self, nodeid, location):
        self.started[nodeid] = time.monotonic()

    @pytest.hookimpl
    def pytest_handlecrashitem(self, crashitem, report, sched):
        CRASHED.write_text(crashitem)
        # pytest-timeout's thread method ends the worker, which xdist reports as a crash; its stacks went to the
        # worker's stdout, which xdist does not show. Say which it was.
        limit = per_test_limit(self.config)
        if limit and time.monotonic() - self.started.get(crashitem, time.monotonic()) >= limit:
            report.longrepr = (f"{report.longrepr}: it ran past the per-test limit of {limit:g} s (pytest.ini's "
                               f"timeout) and was stopped; `python3 -m pytest -n 0 {crashitem}` prints where it hung")


def per_test_limit(config) -> float:
    if not config.pluginmanager.hasplugin("timeout"):
        return 0.0
    from pytest_timeout import get_env_settings
    return get_env_settings(config).timeout or 0.0


def pytest_configure(config):
    global CONFIG
    CONFIG = config
    if config.pluginmanager.hasplugin("xdist") and not IS_WORKER:
        # A worker that crashes is not replaced: with --dist loadfile the new one would start with the very test that
        # crashed (xdist hands it the rest of that file), crash again, and so on, 4 times per worker.
        if config.option.maxworkerrestart is None:
            config.option.maxworkerrestart = "0"
        config.option.loadscopereorder = False  # files go out in the order of SLOW_FILES_FIRST (below)
        config.pluginmanager.register(CrashStop(config), "speedrun-crash-stop")


# With --dist loadfile (run.sh), a worker that takes a long file last keeps the suite waiting while the other core
# idles. The files below (the slowest, slowest first; seconds on 2 busy cores, natively) are started before the
# rest, which follow in collection order; xdist's own ordering, by the number of tests in a file, is turned off.
SLOW_FILES_FIRST = (
    "test_smoke_e2e.py",       # 110: the 2-process smoke run
    "test_run_sh.py",          # 65: ./run.sh launch, for real
    "test_model.py",           # 55: a compiled model
    "test_compile_cache.py",   # 50: fresh processes that compile
    "test_records.py",         # 45
    "test_data_download.py",   # 40
    "test_cuda_graphs.py",     # 35: the graph checks, two of them on two ranks
    "test_cli_and_errors.py",  # 35: the script as a user runs it, under torchrun too
    "test_launchers.py",       # 30: four 2-process launches side by side, killed or interrupted
    "test_mlp_kernels.py",     # 30: a compiled model
    "test_faults.py",          # 30: two 2-process runs
    "test_run_guards.py",      # 25: four trainers side by side
    "test_fp8.py",             # 25: the Triton interpreter
    "test_suite_guards.py",    # 20: planted suites
    "test_triton_kernels.py",  # 15: the Triton interpreter
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_report_header(config):
    return f"compile caches: {RUN_DIR / 'caches'} (this run's own, removed at its end)"


def pytest_sessionstart(session):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if USERS_CACHE_DIRS and reporter:  # said even under -q: the user chose those folders
        reporter.write_line("compile caches: this run's own; not used: "
                            + ", ".join(f"{k}={v}" for k, v in USERS_CACHE_DIRS.items()))


def runs_tests_here() -> bool:
    return not CONFIG.pluginmanager.hasplugin("dsession")  # xdist's main process hears of its workers' tests


def pytest_runtest_logstart(nodeid, location):
    if runs_tests_here():
        RUNNING.mkdir(parents=True, exist_ok=True)
        (RUNNING / PROCESS_NAME).write_text(nodeid + "\n")


def pytest_runtest_logfinish(nodeid, location):
    if runs_tests_here():
        (RUNNING / PROCESS_NAME).unlink(missing_ok=True)


@pytest.fixture(autouse=True)
def cache_dirs_as_the_run_set_them():
    """Trainer code run in-process (open_compile_cache) names kernel-cache folders in os.environ: they must not carry
    over into the next test, which may check what an unset variable gives."""
    before = {var: os.environ.get(var) for var in CACHE_DIRS + ("TRITON_CACHE_DIR",)}
    yield
    for var, value in before.items():
        if value is None:
            os.environ.pop(var, None)
        else:
            os.environ[var] = value


@pytest.fixture(autouse=True)
def no_signals_left_blocked():
    """A test that leaves a signal blocked in this worker makes every process it starts later deaf to it."""
    yield
    import signal
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    if blocked:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, blocked)
        pytest.fail(f"the test left signals blocked: {sorted(s.name for s in blocked)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if IS_WORKER and CRASHED.exists():
        item.session.shouldstop = f"stopped: a test process crashed while running {CRASHED.read_text()}"


def pytest_sessionfinish(session, exitstatus):
    """Nothing a test started may outlive the suite: a survivor is killed, and the run fails, naming it. The main
    process also finds the groups of a test process that died before it could stop them."""
    left = {pgid: group_members(pgid) for pgid in STARTED_GROUPS}
    left = {pgid: pids for pgid, pids in left.items() if pids}
    if not IS_WORKER:
        left.update(recorded_groups_left())
    for pgid in left:
        kill_group(pgid)
    if left:
        print(f"\nerror: processes started by tests were still running at the end (killed now): "
              f"{', '.join(f'group {g}: pids {p}' for g, p in left.items())}", file=sys.stderr)
        session.exitstatus = 1
    if not IS_WORKER and CRASHED.exists():
        session.exitstatus = 1  # failed, as the crash report says; not pytest's 2 for a run stopped by hand


def pytest_unconfigure(config):
    if OWN_RUN_DIR and not IS_WORKER:
        import shutil
        shutil.rmtree(RUN_DIR, ignore_errors=True)
