"""Running Triton kernels for real on the CPU: TRITON_INTERPRET=1 must be set before triton is imported, and other
tests import triton without it, so kernel tests run a script in a fresh process and read back its JSON."""
import json
import os
import sys
from pathlib import Path

import pytest

from processes import run_group

REPO = Path(__file__).resolve().parents[1]


def run_in_triton_interpreter(script: str) -> list:
    """Run a script that prints a JSON list as its last line, in a fresh process with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = run_group([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
