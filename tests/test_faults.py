"""A failure on one rank must end the whole job promptly (torchrun tears the other ranks down) instead of
leaving them blocked in a collective: 2 gloo processes, rank 1 raises (a data error or a bug) or is SIGKILLed in its
second timed step."""
import os
import sys
import time
from pathlib import Path

import pytest

from proxy_shards import build_shards
from processes import run_group
from test_cli_and_errors import TINY

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.slow


# A tiny model (test_cli_and_errors.TINY): one stage, 12 steps
FLAGS = [*TINY, "--num-scheduled-iterations", "12"]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults") / "data"
    build_shards(d, train_shards=1, tokens_per_train_shard=120_000, val_tokens=20_000, kind="patterned", seed=1)
    return d


@pytest.mark.parametrize("kind", ["raise", "bug", "kill"])
def test_one_failing_rank_ends_the_job(tmp_path, data, kind):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
               FAULT_RANK="1", FAULT_STEP="1", FAULT_KIND=kind)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(HERE / "fault_launcher.py"), *FLAGS, "--data-path", str(data), "--log-dir", str(tmp_path / "logs")]
    t0 = time.time()
    r = run_group(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.time() - t0
    assert r.returncode != 0
    log = next((tmp_path / "logs").glob("*.txt")).read_text()
    assert "step:1/12 train_time" in log and "step:3/12" not in log  # it stopped at the fault, not at the end
    if kind == "raise":
        assert "error (rank 1): simulated corrupt shard seen by rank 1 at step 1" in r.stderr
    elif kind == "bug":  # a bug is its traceback, never mistaken for running out of memory
        assert "RuntimeError: simulated bug in rank 1 at step 1" in r.stderr and "out of memory" not in r.stderr
    else:
        assert "Signal 9" in r.stderr or "SIGKILL" in r.stderr
    assert elapsed < 150, f"the job took {elapsed:.0f}s to end after one rank failed"
    assert r.left_running == [], "torchrun exited but left workers running"
