"""GPU checks of a speedrunner's edits, on whole runs of an edited copy of train_gpt.py (the record's widths, short
schedule, synthetic shards):
  * an edited plain mlp() (GELU): --kernels fused refuses in one line, as its fused twin computes the old mlp; the
    other three fused kernels listed run beside the edited plain mlp and train;
  * --cuda-graphs check: a run whose forward reads a Python number that changes with the step (planted) stops at a
    stage's first step with one line and exit 2; the same run unplanted passes every stage's check.

    python3 -m pytest -m gpu tests/gpu/test_gpu_edits.py
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from proxy_shards import build_shards  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

SOURCE = (Path(__file__).resolve().parents[2] / "train_gpt.py").read_text()
SHORT = ["--smoke", "--device", "cuda", "--compile", "off", "--seed", "0", "--model-dim", "768", "--num-heads", "6",
         "--head-dim", "128", "--train-bs-schedule", "65536,131072,196608", "--train-bs-extension", "196608",
         "--train-max-seq-len", "2048", "--val-batch-size", "65536", "--val-tokens", "65536",
         "--num-scheduled-iterations", "9", "--num-extension-iterations", "0", "--val-loss-every", "0"]
GELU = ("    return F.relu(F.linear(x, w_fc)).square() @ w_proj\n", "    return F.gelu(F.linear(x, w_fc)) @ w_proj\n")
# A step-dependent number the forward reads: set by each training step, frozen into a graph at its capture.
PLANTED = [("        adam_steps = step % 2 == 1\n",
            "        adam_steps = step % 2 == 1\n        self.model.drift = step / 100\n"),
           ("        x = x0 = norm(torch.cat([x[:1], x[1:] + gate * x[:-1]]))\n",
            "        x = x0 = norm(torch.cat([x[:1], x[1:] + gate * x[:-1]])) * (1 + getattr(self, 'drift', 0.0))\n")]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu_edits") / "data"
    build_shards(folder, train_shards=2, tokens_per_train_shard=1_500_000, val_tokens=100_000, kind="patterned")
    return folder


def run_edited(tmp_path, data, replacements, *flags):
    source = SOURCE
    for old, new in replacements:
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    tmp_path.mkdir(parents=True, exist_ok=True)
    script = tmp_path / "train_gpt.py"
    script.write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")}
    r = subprocess.run([sys.executable, str(script), *SHORT, "--data-path", str(data), "--log-dir",
                        str(tmp_path / "logs"), "--run-id", "edit", *flags], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=600)
    log = tmp_path / "logs" / "edit.txt"
    return r, log.read_text() if log.exists() else ""


def test_an_edited_plain_mlp_is_refused_fused_and_trains_plain_beside_the_other_fused_kernels(tmp_path, data):
    r, _ = run_edited(tmp_path, data, [GELU], "--kernels", "fused")
    assert r.returncode == 2 and r.stdout.strip() == "" and len(r.stderr.strip().splitlines()) == 1, r
    assert "the fused mlp kernel computes mlp as written when it was made" in r.stderr
    others = "attention,attention_output,lm_head_loss"
    r, log = run_edited(tmp_path / "listed", data, [GELU], "--kernels", others)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"kernels={others} fused={others} " in log
    assert re.search(r"^summary: val_loss \d+\.\d+ at step 9", log, re.M)


def test_the_graphs_check_stops_a_run_whose_forward_reads_a_step_dependent_number(tmp_path, data):
    r, log = run_edited(tmp_path, data, PLANTED, "--cuda-graphs", "check")
    said = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert re.fullmatch(r"stopped at step \d+: stage \d's CUDA graph gives loss [\d.]+ and eager [\d.]+: the forward "
                        r"reads a value that changed since the graphs were captured \(README: Changing the model\)",
                        said), said
    assert log.rstrip().splitlines()[-1] == said
    r, log = run_edited(tmp_path / "unplanted", data, [], "--cuda-graphs", "check")
    assert r.returncode == 0, r.stderr[-3000:]
    checks = re.findall(r"^cuda graphs check: (stage \d) at step (\d+): graph and eager loss", log, re.M)
    assert [s for s, _ in checks] == ["stage 1", "stage 2", "stage 3"], checks
