import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# GPT-2 BPE files ship with the repo, so tokenization never needs the network.
os.environ.setdefault("TIKTOKEN_CACHE_DIR", str(REPO / "data" / "tiktoken_cache"))

from processes import STARTED_GROUPS, group_members, kill_group  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):  # `./run.sh test` runs a worker per core: one thread each, not one per core
    import torch
    torch.set_num_threads(1)


def pytest_sessionfinish(session, exitstatus):
    """Nothing a test started may outlive the suite: a survivor is killed, and the run fails, naming it."""
    left = {pgid: group_members(pgid) for pgid in STARTED_GROUPS}
    left = {pgid: pids for pgid, pids in left.items() if pids}
    for pgid in left:
        kill_group(pgid)
    if left:
        print(f"\nerror: processes started by tests were still running at the end (killed now): "
              f"{', '.join(f'group {g}: pids {p}' for g, p in left.items())}", file=sys.stderr)
        session.exitstatus = 1
