"""bench/kernels/orthogonalizer_bench.py on the CPU: the stacks it derives are the ones NorMuon orthogonalizes, its
error and singular-value statistics on tiny float64 matrices, the capture of a real (small) run, its JSON."""
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "bench" / "kernels"), str(Path(__file__).resolve().parent)]
import orthogonalizer_bench as ob  # noqa: E402
import train_gpt as tg  # noqa: E402
from proxy_shards import build_shards  # noqa: E402


def what_normuon_orthogonalizes(params: list, world: int, monkeypatch) -> list:
    """Every (group, shape, dtype, rank) NorMuon passes to its orthogonalizer at `world` ranks: one NorMuon per rank
    (its world faked), each rank's shard updated once through _update_shard with the orthogonalizer recording."""
    seen = []
    for rank in range(world):
        monkeypatch.setattr(tg, "_dist_world", lambda rank=rank: (world, rank))
        muon = tg.NorMuon(params)
        calls = []
        muon._orthogonalize_fn = lambda u, turbo=False: calls.append(u) or u
        for group, layout in zip(muon.param_groups, muon._layout):
            n = layout["hi"] - layout["lo"]
            if n > 0:
                with torch.no_grad():  # as NorMuon.step calls it
                    layout["shard"].zero_()
                    muon._update_shard(group, layout, layout["shard"][:n])
                u = calls[-1]
                seen.append((group["label"], tuple(u.shape), str(u.dtype).removeprefix("torch."), rank))
    return sorted(seen)


def flattened(shapes: list) -> list:
    return sorted((e["group"], tuple(e["shape"]), e["dtype"], r) for e in shapes for r in e["ranks"])


# The record's layers and labels (so its 8-GPU grouping applies) at a width that costs the CPU nothing.
SMALL_MODEL = ["--smoke", "--model-dim", "32", "--num-heads", "2", "--head-dim", "16"]


def small_model_params() -> list:
    model = tg.GPT(tg.parse_args(SMALL_MODEL), max_seq_len=256)
    params = [p for p in model.parameters() if p.treatment != "adam"]
    return sorted(params, key=lambda p: p.treatment == "gate")  # build_optimizers' order: matrices, then gates


@pytest.fixture(scope="module")
def small_params() -> list:
    return small_model_params()


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_derived_stacks_are_what_normuon_orthogonalizes_on_every_rank(world, small_params, monkeypatch):
    """On a small CPU model and on the record model on the meta device: shard_shapes' list, rank by rank, equals
    the inputs NorMuon's _update_shard gives its orthogonalizer (attention stacks viewed as their four blocks, the
    last rank's shorter chunk, empty ranks left out)."""
    for params in (small_params, ob.normuon_params(world)):
        assert flattened(ob.shard_shapes(params, world)) == what_normuon_orthogonalizes(params, world, monkeypatch)


def test_the_record_models_stacks_at_one_four_and_eight_gpus():
    one = {ob.stack_name(e["group"], e["shape"]): (e["ranks"], e["dtype"])
           for e in ob.shard_shapes(ob.normuon_params(1), 1)}
    assert one == {"attn 40x768x768": ([0], "float32"), "mlp 22x3072x768": ([0], "float32"),
                   "attn_gate 10x6x12": ([0], "bfloat16"), "smear_gate 1x1x12": ([0], "bfloat16")}
    eight = {ob.stack_name(e["group"], e["shape"]): e["ranks"] for e in ob.shard_shapes(ob.normuon_params(8), 8)}
    assert eight == {"smear_gate 1x1x12": [0], "attn_gate 2x6x12": [0, 1, 2, 3, 4],
                     "attn+mlp 8x768x768": [0, 1, 2, 3, 4], "attn+mlp 2x3072x768": [5, 6, 7],
                     "mlp 2x3072x768": list(range(8))}
    four = {ob.stack_name(e["group"], e["shape"]): e["ranks"] for e in ob.shard_shapes(ob.normuon_params(4), 4)}
    assert four["attn 12x768x768"] == [0, 1, 2] and four["attn 4x768x768"] == [3]  # 10 = 3 + 3 + 3 + 1


def orthonormal(n: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(n, max(rows, cols), min(rows, cols), dtype=torch.float64,
                                       generator=torch.Generator().manual_seed(seed)))
    return q if rows >= cols else q.mT


def test_an_exactly_orthogonal_input_has_no_error_and_unit_singular_values():
    Q = orthonormal(3, 5, 8)
    row = ob.accuracy(Q, orthogonalize=lambda G, turbo: G)
    assert row["matrices"] == 3 and row["zero_matrices_skipped"] == 0
    for mode in ("polar", "turbo"):
        assert row[mode]["rel_err"] < 1e-12
        assert all(abs(v - 1) < 1e-12 for v in row[mode]["output_sv"].values())
    assert all(abs(v - 1) < 1e-12 for v in row["input_sv_over_largest"].values())
    assert list(row["input_sv_over_largest"]) == ["p0", "p1", "p5", "p50", "p95", "p99", "p100"]


def test_error_and_singular_values_of_a_known_matrix():
    """G = U diag(4, 2, 1) Vᵀ orthogonalized as G / 4: singular values 1, 1/2, 1/4 against the polar factor U Vᵀ,
    so the relative error is sqrt(0 + 1/4 + 9/16) / sqrt(3)."""
    U = orthonormal(1, 6, 3, seed=1)
    V = orthonormal(1, 3, 3, seed=2)
    G = U @ torch.diag(torch.tensor([4.0, 2.0, 1.0], dtype=torch.float64)) @ V.mT
    row = ob.accuracy(G, orthogonalize=lambda G, turbo: G / 4)
    assert row["polar"]["rel_err"] == pytest.approx((0.25 + 0.5625) ** 0.5 / 3 ** 0.5, rel=1e-12)
    sv = row["polar"]["output_sv"]
    assert (sv["p0"], sv["p50"], sv["p100"]) == pytest.approx((0.25, 0.5, 1.0), rel=1e-12)
    assert sv["p1"] == pytest.approx(0.25 + 0.02 * 0.25, rel=1e-12)  # linear interpolation between order statistics
    inp = row["input_sv_over_largest"]
    assert (inp["p0"], inp["p50"], inp["p100"]) == pytest.approx((0.25, 0.5, 1.0), rel=1e-12)


def test_all_zero_matrices_are_counted_and_left_out():
    G = torch.randn(3, 4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    G[1] = 0
    row = ob.accuracy(G, orthogonalize=lambda G, turbo: ob.polar_factor(G))
    assert row["matrices"] == 2 and row["zero_matrices_skipped"] == 1 and row["polar"]["rel_err"] < 1e-12
    assert ob.accuracy(torch.zeros(2, 3, 3)) == dict(matrices=0, zero_matrices_skipped=2)


def test_the_trainers_orthogonalizers_measure_as_approximate_polar_factors():
    """polar_express itself (the CPU's fp32 path) through the default argument, tall matrices included."""
    G = torch.randn(4, 24, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    row = ob.accuracy(G)
    for mode in ("polar", "turbo"):
        assert 0 < row[mode]["rel_err"] < 0.2, row
        assert 0.5 < row[mode]["output_sv"]["p50"] < 1.2 and row[mode]["output_sv"]["p100"] < 1.2, row


def fake_timings(slow_shape):
    """(orthogonalizers, timer, calls): turbo takes 2 ms on slow_shape and 0.5 ms elsewhere, polar always 1 ms."""
    calls = []

    def fn(G, turbo=False):
        calls.append((tuple(G.shape), turbo))
        return 2.0 if turbo and tuple(G.shape) == slow_shape else 0.5 if turbo else 1.0
    return dict(eager=fn, compiled=fn), (lambda f: f()), calls


SMALL_SHAPES = {1: [dict(group="attn", ranks=[0], shape=[8, 16, 16], dtype="float32"),
                    dict(group="gate", ranks=[0], shape=[2, 3, 12], dtype="bfloat16")],
                8: [dict(group="attn", ranks=[0, 1], shape=[8, 16, 16], dtype="float32"),
                    dict(group="attn", ranks=[2], shape=[4, 16, 16], dtype="float32")]}


def test_speed_rows_time_each_shape_once_and_flag_where_turbo_is_slower():
    fns, timer, calls = fake_timings(slow_shape=(4, 16, 16))
    rows = ob.speed_rows(SMALL_SHAPES, fns, timer, device="cpu")
    assert len(rows) == 4 and len(calls) == 3 * 2 * 2  # 3 distinct shapes x 2 ways x polar/turbo
    by = {(r["world_size"], tuple(r["shape"])): r for r in rows}
    assert by[(8, (4, 16, 16))]["turbo_slower"] == ["eager", "compiled"]
    assert by[(8, (4, 16, 16))]["compiled_ms"] == dict(polar=1.0, turbo=2.0, turbo_over_polar=2.0)
    assert by[(1, (8, 16, 16))]["turbo_slower"] == [] and by[(8, (8, 16, 16))]["ranks"] == [0, 1]
    assert by[(1, (8, 16, 16))]["eager_ms"]["turbo_over_polar"] == 0.5


def test_the_json_has_every_section_and_stays_small():
    shapes = {w: ob.shard_shapes(ob.normuon_params(w), w) for w in ob.WORLDS}
    result = ob.new_result(shapes, ["x_capture_step0.pt"], "cpu", "abc123")
    stacks = {"attn 4x16x16": torch.randn(4, 16, 16, dtype=torch.float64), "gate 2x3x12": torch.randn(2, 3, 12)}
    result["accuracy"]["gaussian"] = {k: ob.accuracy(G) for k, G in stacks.items()}
    fns, timer, _ = fake_timings(slow_shape=(4, 16, 16))
    ob.add_speed(result, ob.speed_rows(SMALL_SHAPES, fns, timer, device="cpu"))
    text = json.dumps(result, indent=1)
    assert len(text) < 2_000_000
    back = json.loads(text)
    assert {"question", "device", "torch", "triton", "commit", "date", "command", "shapes", "captured_files",
            "accuracy", "speed", "turbo_slower"} <= set(back)
    assert set(back["shapes"]) == {"1", "2", "4", "8"}
    assert set(back["accuracy"]["gaussian"]["attn 4x16x16"]) == {"matrices", "zero_matrices_skipped",
                                                                  "input_sv_over_largest", "polar", "turbo"}
    assert back["turbo_slower"] == ["W=8 attn 4x16x16 eager", "W=8 attn 4x16x16 compiled"]
    table = ob.table(back)
    assert "attn 4x16x16" in table and "turbo slower: eager,compiled" in table


def test_the_recorder_keeps_the_first_matrices_of_each_group_at_the_chosen_steps():
    rec = ob.Recorder(lambda u, turbo=False: u * 2, ["attn", "mlp"], steps=[3], keep=2)
    a, m = torch.randn(8, 4, 4), torch.randn(5, 6, 4)
    rec.step = 2
    assert torch.equal(rec(a), a * 2) and rec.captured == {}
    rec.step = 3
    rec(a, turbo=True)
    rec(m)
    assert list(rec.captured[3]) == ["attn 8x4x4", "mlp 5x6x4"]
    assert torch.equal(rec.captured[3]["attn 8x4x4"], a[:2].bfloat16())
    assert rec.captured[3]["mlp 5x6x4"].shape == (2, 6, 4)


def cheap_forward_backward(self, inputs, targets, cu_seqlens, ws_short, ws_long, divisor):
    """A micro-batch's stand-in: a loss over NorMuon's matrices themselves, backward through autograd into their
    gradients as the model's would (the smoke model's real pass takes seconds per micro-batch on a CPU without bf16
    GEMMs; DistAdam skips parameters without a gradient)."""
    loss = sum((p.float() ** 2).sum() for group in self.muon.param_groups for p in group["params"]) * 1e-3
    (loss / divisor).backward()
    return loss.detach()


def test_capture_steps_through_training_and_records_each_group_at_the_chosen_steps(tmp_path, monkeypatch):
    """train_gpt's build path, its data and train_step on the CPU (a small model, warm-up skipped, a cheap loss
    for each micro-batch): NorMuon's input for every group recorded at steps 0 and 3 only, keyed as shard_shapes
    names the stacks of one GPU, the first 2 matrices of each in bf16."""
    build_shards(tmp_path / "data", train_shards=1, tokens_per_train_shard=60_000, val_tokens=5_000)
    monkeypatch.setattr(tg.Trainer, "warm_up_kernels", lambda self: None)
    monkeypatch.setattr(tg.Trainer, "forward_backward", cheap_forward_backward)
    flags = [*SMALL_MODEL, "--device", "cpu", "--num-scheduled-iterations", "6", "--num-extension-iterations", "1",
             "--val-batch-size", "4096", "--val-tokens", "4096"]
    captured = ob.capture(str(tmp_path / "data"), [0, 3], 2, flags, tmp_path / "out" / "log.txt")
    assert sorted(captured) == [0, 3]
    expected = [ob.stack_name(e["group"], e["shape"]) for e in ob.shard_shapes(small_model_params(), 1)]
    for step, stacks in captured.items():
        assert sorted(stacks) == sorted(expected), step
        assert all(t.dtype == torch.bfloat16 and t.size(0) == min(2, int(name.split()[-1].split("x")[0]))
                   for name, t in stacks.items())
    assert captured[0]["mlp 22x128x32"].abs().sum() > 0 and captured[3]["mlp 22x128x32"].abs().sum() > 0
    assert (tmp_path / "out" / "log.txt").exists()
    with pytest.raises(tg.ConfigError, match="past the run's last step"):
        ob.capture(str(tmp_path / "data"), [7], 2, flags, tmp_path / "out" / "log2.txt")


@pytest.mark.parametrize("argv, message", [
    (["--capture-steps", "0,x"], "--capture-steps '0,x': give comma-separated steps from 0"),
    (["--capture-steps=-5"], "--capture-steps '-5': give comma-separated steps from 0"),
    (["--keep", "0"], "--keep 0"),
    ([], "needs a CUDA GPU"),
])
def test_bad_input_or_no_gpu_is_one_line_and_exit_2_writing_nothing(argv, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ob.main(["--out", str(tmp_path / "o.json"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("error: ")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_output_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the GPU check: the outputs come first
    (tmp_path / "o_capture_step5.pt").write_text("mine")
    assert ob.main(["--out", str(tmp_path / "o.json"), "--capture-steps", "0,5"]) == 2
    assert "o_capture_step5.pt exists" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o_capture_step5.pt"]
    assert (tmp_path / "o_capture_step5.pt").read_text() == "mine"
