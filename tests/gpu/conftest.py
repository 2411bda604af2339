"""Fixtures of the GPU checks (tests/gpu/): a shared results dict and, on request, one JSON of a run's numbers.

    SPEEDRUN_GPU_JSON=bench/results/<date>_<device>_gpu_checks.json python3 -m pytest -m gpu tests/gpu

writes, at the end of the session, the run's metadata (date, device, torch, triton, python, commit, command), every
measurement the tests put into `gpu_results` (one entry per check: fp8_lm_head, fp8_quantize_<x|w>,
fp8_weight_gradient, attention_<varlen|fa4>_w<window>, attention_speed_<kernel>_w<window>,
attention_fa4_vs_varlen_w<window>, attention_fa4_first_call_s, fused_attention_<stage>_<ve|no_ve>, fused_mlp,
fused_attention_output, fused_lm_head_loss, fused_head_passes_<regime>, triton_<shape>, orthogonalizer <stack>;
fused_<kernel>: "unavailable: ..." where a fused kernel cannot run) and each test's outcome under "outcomes".
SPEEDRUN_COMMIT, when set, is the commit recorded instead of .git's HEAD (a copied working tree may carry a stale .git).
"""
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
JSON_ENV = "SPEEDRUN_GPU_JSON"


def run_metadata() -> dict:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    return dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device",
                torch=torch.__version__, triton=triton_version, python=platform.python_version(),
                commit=os.environ.get("SPEEDRUN_COMMIT") or commit.stdout.strip(),
                command=" ".join([Path(sys.executable).name, "-m", "pytest", *sys.argv[1:]]))


@pytest.fixture(scope="session")
def gpu_results():
    """Measurements of every GPU check in this session, written to $SPEEDRUN_GPU_JSON (if set) at its end."""
    results = {}
    yield results
    path = os.environ.get(JSON_ENV)
    if path:
        record = dict(run_metadata(), **results, outcomes=dict(_OUTCOMES))
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(record, indent=1))


_OUTCOMES = {}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" or report.outcome != "passed":
        _OUTCOMES[item.nodeid.split("::", 1)[-1]] = report.outcome
