"""bench/kernels/normuon_shard_bench.py: NorMuon at a rank's shard, measured in one process as rank R of W (torch's
fake process group), and the A/B summary of two sets of its runs."""
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "kernels"))
import normuon_shard_bench as nsb  # noqa: E402

TINY = ["--model-dim", "32", "--num-heads", "2", "--head-dim", "16"]


@pytest.fixture
def on_the_cpu(monkeypatch):
    """The script's measurement on the CPU: one 1 ms kernel per profiled call stands in for the GPU."""
    tg, bench = nsb.load_trainer(ROOT)
    monkeypatch.setattr(nsb, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)  # bench.timed's, around each call
    monkeypatch.setattr(bench, "bf16_peak_flops", lambda: 1e12)
    profiled = []

    def profile_of(fn):
        profiled.append(fn)
        fn()
        return "profile"
    monkeypatch.setattr(bench, "profile_of", profile_of)
    monkeypatch.setattr(bench, "profile_kernels", lambda prof: [("kernel", 0.0, 1.0)] * 3)
    return profiled


@pytest.mark.parametrize("rank,groups", [(0, {"smear_gate", "attn_gate", "attn+mlp", "mlp"}),
                                         (7, {"attn+mlp", "mlp"})])
def test_a_rank_of_8_reports_the_groups_it_updates_and_leaves_no_process_group(on_the_cpu, rank, groups, tmp_path):
    out = tmp_path / "r.json"
    assert nsb.main(["--out", str(out), "--rank", str(rank), "--repeats", "3", "--", *TINY]) == 0
    assert not dist.is_initialized()
    d = json.loads(out.read_text())
    assert (d["world_size"], d["rank"], d["orthogonalizer"]) == (8, rank, "polar")
    assert set(d["normuon_groups"]["groups"]) == groups
    assert d["normuon_groups"]["groups"]["mlp"]["matrices"] == 2
    # the stand-in profile: three 1 ms kernels over 3 calls, 1 ms per call, for every group and the whole step
    assert all(g["gpu_ms"] == 1.0 for g in d["normuon_groups"]["groups"].values())
    assert d["step"]["gpu_ms"] == 1.0 and d["step"]["wall_ms"] > 0


def test_a_bad_rank_is_one_line_and_exit_2(capsys):
    assert nsb.main(["--out", "x.json", "--rank", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --world-size 8 --rank 8")


def test_the_comparison_gives_each_groups_difference_of_medians_and_an_interval_around_it(tmp_path):
    def run(name, mlp_ms, step_ms):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(dict(normuon_groups=dict(groups=dict(mlp=dict(gpu_ms=mlp_ms))),
                                        step=dict(gpu_ms=step_ms, wall_ms=7.0))))
        return str(path)
    a = [run(f"a{i}", ms, 1.0 + ms) for i, ms in enumerate((0.34, 0.33, 0.35))]
    b = [run(f"b{i}", ms, 1.0 + ms) for i, ms in enumerate((0.24, 0.25, 0.23))]
    rows = nsb.compare(a, b)
    mlp = rows["mlp"]
    assert mlp["a_median_ms"] == 0.34 and mlp["b_median_ms"] == 0.24
    assert mlp["b_minus_a_ms"] == pytest.approx(-0.10)
    lo, hi = mlp["interval_95_ms"]
    assert -0.12 - 1e-9 <= lo <= -0.10 <= hi <= -0.08 + 1e-9
    assert rows["NorMuon.step (GPU)"]["b_minus_a_ms"] == pytest.approx(-0.10)
    assert rows["NorMuon.step (wall)"]["interval_95_ms"] == [0.0, 0.0]
