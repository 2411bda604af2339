"""Running Triton kernels for real on the CPU: TRITON_INTERPRET=1 must be set before triton is imported, and other
tests import triton without it, so kernel tests run a script in a fresh process and read back its JSON.

A module's scripts can share that process (run_scripts_in_triton_interpreter, from a module-scoped fixture): each
fresh process costs seconds of importing torch and train_gpt, the scripts themselves often less."""
import json
import os
import sys
from pathlib import Path

import pytest

from processes import run_group

REPO = Path(__file__).resolve().parents[1]

# Runs the scripts read from stdin ({name: source}) one after the other, each printing a JSON list as its last line;
# whatever module-level names of train_gpt a script sets (SOFTCAP, CE_FORWARD_TILE, a stand-in fa4_interface) are
# put back before the next, which also starts from the same global seed. A script that fails gives its traceback.
RUNNER = r"""
import contextlib, io, json, sys, traceback
import torch
import train_gpt as tg
results = {}
for name, script in json.loads(sys.stdin.read()).items():
    saved = dict(vars(tg))
    torch.manual_seed(0)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(script, f"<{name}>", "exec"), {"__name__": "__main__"})
        results[name] = json.loads(out.getvalue().strip().splitlines()[-1])
    except BaseException:
        results[name] = {"error": traceback.format_exc(), "stdout": out.getvalue()[-2000:]}
    finally:
        vars(tg).update(saved)  # names added are kept: Triton's interpreter adds its own to a kernel's globals
print("RESULTS=" + json.dumps(results))
"""


def _interpreter_env() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run_in_triton_interpreter(script: str) -> list:
    """Run a script that prints a JSON list as its last line, in a fresh process with TRITON_INTERPRET=1."""
    pytest.importorskip("triton")
    proc = run_group([sys.executable, "-c", script], cwd=REPO, env=_interpreter_env(), capture_output=True,
                     text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_scripts_in_triton_interpreter(scripts: dict) -> dict:
    """{name: script} -> {name: the JSON list its last line printed, or {"error": its traceback}}: the scripts run
    one after the other in one fresh process with TRITON_INTERPRET=1. Read a result with interpreted()."""
    pytest.importorskip("triton")
    proc = run_group([sys.executable, "-c", RUNNER], cwd=REPO, env=_interpreter_env(), capture_output=True,
                     text=True, timeout=600, input=json.dumps(scripts))
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS=")][-1]
    return json.loads(line[len("RESULTS="):])


def interpreted(results: dict, name: str) -> list:
    """One script's rows from run_scripts_in_triton_interpreter; a script that failed fails the test with its
    traceback."""
    rows = results[name]
    assert not (isinstance(rows, dict) and "error" in rows), f"{name} failed in the interpreter:\n" + \
        rows.get("stdout", "") + rows["error"]
    return rows
