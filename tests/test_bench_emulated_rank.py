"""bench.py --as-world-size 8 on one process: rank r of 8 through torch's fake process group. One training step
there updates exactly what rank r of a real 8-process run (gloo) updates, for every r: the emulation times a rank of
the 8-GPU run. The ranks' work differs only in the gates they update."""
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import train_gpt as tg
from dist_utils import runtime_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench  # noqa: E402

WORLD = 8
# large learning rates: every update shows, in the bf16 gates too
FLAGS = ["--smoke", "--device", "cpu", "--seed", "0", "--model-dim", "32", "--num-heads", "2", "--head-dim", "16",
         "--muon-lr", "2", "--adam-lr", "1"]


class Done:
    def wait(self):
        pass


def one_step_updates(rank: int, world_size: int) -> dict:
    """In a process that is rank `rank` of `world_size` (a real or a fake group): one step of the record's model at
    width 32 on the same micro-batch on every rank, with the optimizers' all-gathers left out, so that each rank's
    parameters change only where its optimizer shard updated them. Returns {name: rows that changed} and the
    rank's work (bench.rank_work)."""
    torch.set_num_threads(1)
    args = tg.parse_args(FLAGS)
    runtime = dataclasses.replace(runtime_for(args), world_size=world_size, rank=rank, grad_accum_steps=1)
    model, adam, muon = tg.build_model_and_optimizers(args, runtime)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # every parameter non-zero, the same on every rank
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g).mul(0.02).to(p.dtype))
    real_all_gather, tg.all_gather = tg.all_gather, lambda out, inp, async_op=False: Done()
    try:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        T = 64
        x = torch.randint(0, 50257, (T,), generator=g, dtype=torch.int32)
        y = torch.randint(0, 50257, (T,), generator=g)
        cu = torch.tensor([0, T] + [T] * (tg.max_num_docs_for(T) - 2), dtype=torch.int32)
        adam.should_sync = True
        model(x, y, cu, 1, 3, T).backward()
        adam.should_sync = False
        adam.step()
        muon.step()
    finally:
        tg.all_gather = real_all_gather
    changed = {n: torch.nonzero((p.detach() != before[n]).reshape(max(p.shape[0], 1) if p.dim() else 1, -1).any(1))
               .flatten().tolist() for n, p in model.named_parameters()}
    return dict(changed={n: rows for n, rows in changed.items() if rows}, work=bench.rank_work(muon, adam))


def emulated(rank: int) -> dict:
    bench.emulate_rank(rank, WORLD)
    try:
        return one_step_updates(rank, WORLD)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def real_ranks():
    from dist_utils import run_gloo
    return run_gloo(one_step_updates, WORLD)


@pytest.fixture(scope="module")
def emulated_ranks():
    return [emulated(rank) for rank in range(WORLD)]


@pytest.mark.slow
@pytest.mark.parametrize("rank", range(WORLD))
def test_one_process_as_rank_r_of_8_updates_exactly_what_rank_r_of_a_real_8_process_run_updates(real_ranks,
                                                                                            emulated_ranks, rank):
    assert emulated_ranks[rank]["changed"] == real_ranks[rank]["changed"]
    assert emulated_ranks[rank]["work"] == real_ranks[rank]["work"]


def test_the_emulated_ranks_share_normuons_matrices_out_each_to_exactly_one_rank(emulated_ranks):
    args = tg.parse_args(FLAGS)
    matrices = {n for n, p in tg.GPT(args, 64).named_parameters() if p.treatment != "adam"}
    owners = {n: [r for r, e in enumerate(emulated_ranks) if n in e["changed"]] for n in matrices}
    assert {n: rs for n, rs in owners.items() if len(rs) != 1} == {}
    assert len({r for rs in owners.values() for r in rs}) > 1


def test_the_ranks_of_8_split_normuons_groups_and_distadams_rows_as_the_record_does(emulated_ranks):
    """Every rank updates two of the 16 attention+MLP and two of the 16 MLP matrices; the 10 attention gates go two
    a rank to ranks 0-4 and the smear gate to rank 0; DistAdam's rows split evenly (its 62 scalars padded to 64)."""
    matrices = {label: [dict((l, n) for l, n, *_ in e["work"]["normuon"])[label] for e in emulated_ranks]
                for label, *_ in emulated_ranks[0]["work"]["normuon"]}
    assert matrices == {"smear_gate": [1] + [0] * 7, "attn_gate": [2] * 5 + [0] * 3, "attn+mlp": [2] * 8,
                        "mlp": [2] * 8}
    rows = [e["work"]["distadam"] for e in emulated_ranks]
    assert all(r == rows[0] for r in rows)
    expected = [("lm_head", 6288), ("scalars", 8)] + [("value_embed", 6288)] * 3 + [("embed", 6288)]
    assert [(label, n) for label, n, *_ in rows[0]] == expected


def test_normuons_per_group_timing_reports_the_groups_this_rank_updates_and_leaves_the_weights_as_they_were(
        monkeypatch):
    """bench.measure_normuon_groups on rank 7 of 8 (no gates there): the two groups of 3072x768 matrices, each with
    its orthogonalizer's FLOPs; the profile stands in for the GPU (one 1 ms kernel per update)."""
    calls = []
    monkeypatch.setattr(bench, "profile_of", lambda fn: calls.append(fn()) or "profile")
    monkeypatch.setattr(bench, "profile_kernels", lambda prof: [("kernel", 0.0, 1.0)] * 10)
    bench.emulate_rank(7, WORLD)
    try:
        args = tg.parse_args(FLAGS)
        runtime = dataclasses.replace(runtime_for(args), world_size=WORLD, rank=7, grad_accum_steps=1)
        model, adam, muon = tg.build_model_and_optimizers(args, runtime)
        for layout in muon._layout:
            layout["shard"].normal_()
        before = [p.detach().clone() for p in model.parameters()]
        result = bench.measure_normuon_groups(muon, peak_flops=1e12, repeats=10)
    finally:
        dist.destroy_process_group()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert set(result["groups"]) == {"attn+mlp", "mlp"} and len(calls) == 2
    mlp = result["groups"]["mlp"]
    assert mlp["matrices"] == 2 and mlp["shape"] == [128, 32] and mlp["gpu_ms"] == 1.0
    assert mlp["orthogonalizer_flops"] == bench.polar_flops(2, 128, 32, 5)
    assert mlp["flop_time_ms"] == pytest.approx(1e3 * mlp["orthogonalizer_flops"] / 1e12)
    assert result["gpu_ms"] == 2.0
