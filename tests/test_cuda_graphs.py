"""--cuda-graphs: each training micro-batch replayed as one graph. Real CUDA graphs need a GPU (bench/bench.py
--check-graphs trains with and without them there and compares the weights bit for bit); here a stand-in graph that
reruns the captured function on the graph's own tensors pins down everything around it: which micro-batch runs
eagerly, which is captured and which replayed, the graph's copies of the batch, its gradient buffers, the loss's
divisor and the keys."""
import copy
import dataclasses

import pytest
import torch

import train_gpt as tg
from proxy_shards import build_shards


class RerunGraph:
    """Stands in for CudaGraph: capture runs the function once (as CudaGraph's eager run before its capture does) and
    keeps it; replay runs it again, on whatever its captured tensors hold then."""

    def capture(self, fn):
        fn()
        self.fn = fn

    def replay(self):
        self.fn()


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("graphs")
    build_shards(folder / "data", train_shards=1, tokens_per_train_shard=80_000, val_tokens=10_000)
    args = tg.parse_args(["--smoke", "--device", "cpu", "--compile", "off", "--seed", "0",
                          "--train-bs-schedule", "512,1024,1536", "--train-bs-extension", "1536",
                          "--train-max-seq-len", "128",
                          "--data-path", str(folder / "data"), "--log-dir", str(folder / "logs")])
    rt = tg.resolve_runtime(args, env={})
    return tg.build_trainer(args, rt, folder / "logs" / "graphs.txt")


def train_steps(trainer, graphs, steps_per_stage: int = 1, one_micro_batch: bool = False) -> tuple[list, list, list]:
    """steps_per_stage training steps of every stage from the trainer's current weights (one_micro_batch: each step
    one micro-batch, as on 8 GPUs): the weights after, every micro-batch's loss, and per step the params whose
    gradients its graph key says it starts."""
    trainer.graphs = graphs
    args, model = trainer.args, trainer.model
    micro_batches = 1 if one_micro_batch else trainer.rt.grad_accum_steps
    step, losses, starts = 0, [], []
    for stage in tg.stages(args):
        model.yarn.set_window(stage.ws_long)
        batches = trainer.new_batches(stage.batch_size)
        for _ in range(steps_per_stage):
            if graphs is not None:
                starts.append({id(graphs.params[i]) for i in graphs.key((), 0, 0)[-1]})
            trainer.train_step(step, batches, None, stage.ws_short, stage.ws_long, micro_batches, losses)
            step += 1
    return [p.detach().clone() for p in model.parameters()], losses, starts


def from_the_start(trainer, initial):
    trainer.model.load_state_dict(initial["model"])
    for opt, state in zip((trainer.adam, trainer.muon), initial["opts"]):
        opt.load_state_dict(state)
    trainer.model.zero_grad(set_to_none=True)
    trainer.model.yarn.reset()


def test_training_through_replayed_graphs_matches_eager_training_bit_for_bit(trainer):
    initial = copy.deepcopy(dict(model=trainer.model.state_dict(),
                                 opts=[o.state_dict() for o in (trainer.adam, trainer.muon)]))
    eager, eager_losses, _ = train_steps(trainer, None)
    from_the_start(trainer, initial)
    graphs = tg.MicroBatchGraphs(trainer.model, trainer.adam, trainer.muon.grad_buffers, new_graph=RerunGraph)
    graphed, graphed_losses, _ = train_steps(trainer, graphs)
    from_the_start(trainer, initial)
    assert all(torch.equal(a, b) for a, b in zip(graphed, eager))
    assert all(torch.equal(a, b) for a, b in zip(graphed_losses, eager_losses))
    assert any(not torch.equal(a, b) for a, b in zip(graphed, initial["model"].values()))  # it did train
    micro_batches = trainer.rt.grad_accum_steps * len(tg.stages(trainer.args))
    # one key per stage: its first micro-batch eager, its second captured, the rest replayed
    assert graphs.captures == len(tg.stages(trainer.args)) == len(graphs.graphs)
    assert graphs.replays == micro_batches - 2 * graphs.captures


def test_with_one_micro_batch_a_step_the_graphs_write_the_gradients_they_start_and_match_eager_bit_for_bit(trainer):
    initial = copy.deepcopy(dict(model=trainer.model.state_dict(),
                                 opts=[o.state_dict() for o in (trainer.adam, trainer.muon)]))
    eager, eager_losses, _ = train_steps(trainer, None, steps_per_stage=6, one_micro_batch=True)
    from_the_start(trainer, initial)
    graphs = tg.MicroBatchGraphs(trainer.model, trainer.adam, trainer.muon.grad_buffers, writes_first=True,
                                 new_graph=RerunGraph)
    graphed, graphed_losses, starts = train_steps(trainer, graphs, steps_per_stage=6, one_micro_batch=True)
    from_the_start(trainer, initial)
    assert all(torch.equal(a, b) for a, b in zip(graphed, eager))
    assert all(torch.equal(a, b) for a, b in zip(graphed_losses, eager_losses))
    assert any(not torch.equal(a, b) for a, b in zip(graphed, initial["model"].values()))  # it did train
    # NorMuon sums one step's gradients, Adam two: an even step starts every gradient, an odd one NorMuon's only
    everything = {id(p) for p in trainer.model.parameters()}
    normuon = {id(p) for p in trainer.muon.grad_buffers}
    assert starts == [everything if k % 2 == 0 else normuon for k in range(len(starts))]
    # two keys a stage, each first run eagerly, then captured, then replayed
    stages = len(tg.stages(trainer.args))
    assert (graphs.captures, graphs.replays) == (2 * stages, 2 * stages)


def test_a_stage_gets_a_new_graph_when_its_windows_or_softmax_scale_change(trainer):
    graphs = tg.MicroBatchGraphs(trainer.model, trainer.adam, new_graph=RerunGraph)
    batch = (torch.zeros(128, dtype=torch.int32), torch.zeros(128, dtype=torch.int64),
             torch.zeros(4, dtype=torch.int32))
    base = graphs.key(batch, 1, 3)
    assert graphs.key(batch, 1, 3) == base
    assert graphs.key(batch, 2, 3) != base and graphs.key(batch, 1, 4) != base
    assert graphs.key(batch[:1] + (torch.zeros(256, dtype=torch.int64),) + batch[2:], 1, 3) != base
    trainer.model.yarn.stretch(3, 7)  # YaRN raises the softmax scale, a host value frozen into a captured graph
    try:
        assert graphs.key(batch, 1, 3) != base
    finally:
        trainer.model.yarn.reset()


def test_gradients_set_to_none_come_back_zeroed_and_eager_ones_are_copied_into_the_buffers(trainer):
    model = trainer.model
    graphs = tg.MicroBatchGraphs(model, trainer.adam, trainer.muon.grad_buffers, new_graph=RerunGraph)
    try:
        for p in model.parameters():
            p.grad = torch.full_like(p, 2.0)
        graphs.attach_grads()
        buffers = [p.grad for p in model.parameters()]
        # NorMuon's gradients accumulate in the rows of its gradient stacks, where its reduce-scatter reads them
        muon_params = trainer.muon.grad_buffers.keys()
        assert len(muon_params) > 0
        assert all(p.grad is trainer.muon.grad_buffers[p] for p in muon_params)
        assert all(torch.equal(p.grad, torch.full_like(p, 2.0)) for p in muon_params)
        model.zero_grad(set_to_none=True)
        first, second = list(model.parameters())[:2]
        second.grad = torch.full_like(second, 3.0)  # as an eager backward leaves it
        graphs.attach_grads()
        assert all(p.grad is b for p, b in zip(model.parameters(), buffers))
        assert torch.count_nonzero(first.grad) == 0
        assert torch.equal(second.grad, torch.full_like(second, 3.0))
    finally:
        model.zero_grad(set_to_none=True)


def test_cuda_graphs_resolve_on_with_cuda_and_compile_at_every_world_size_and_refuse_the_cpu():
    args = tg.parse_args(["--smoke", "--device", "cpu", "--compile", "off"])
    assert tg.resolve_runtime(args, env={}).cuda_graphs is False  # auto on the CPU
    assert tg.resolve_runtime(args, env={"WORLD_SIZE": "2", "RANK": "0"}).cuda_graphs is False  # gloo: eager
    assert tg.resolve_cuda_graphs(tg.parse_args([]), "cuda", True) is True
    assert tg.resolve_cuda_graphs(tg.parse_args([]), "cuda", False) is False  # graphs of eager kernels: no
    assert tg.resolve_cuda_graphs(tg.parse_args(["--cuda-graphs", "off"]), "cuda", True) is False
    with pytest.raises(tg.ConfigError, match="needs a CUDA GPU"):
        tg.resolve_runtime(tg.parse_args(["--smoke", "--device", "cpu", "--cuda-graphs", "on"]), env={})


# Two processes (gloo): the micro-batch that ends an Adam step launches DistAdam's reduce-scatters from its gradient
# hooks. It gets a graph of its own, whose replay must leave the averaged gradients where DistAdam's step reads them.

def _graphs_against_eager_on_two_ranks(rank, world_size, data, one_micro_batch=False):
    """Six steps of stage 1 with two ranks (four micro-batches each per step), eagerly and through stand-in graphs:
    the plain micro-batch's key is captured in step 0, the reduce-scattering one (the last of each odd step) runs
    eagerly in step 1, is captured in step 3 and replayed in step 5. one_micro_batch: each rank runs one micro-batch
    a step, as on 8 GPUs (the graphs write the gradients they start): each key first runs in step 0 or 1."""
    args = tg.parse_args(["--smoke", "--device", "cpu", "--compile", "off", "--seed", "0",
                          "--train-max-seq-len", "128", "--data-path", str(data)])
    rt = tg.resolve_runtime(args, env={"WORLD_SIZE": str(world_size), "RANK": str(rank)})
    batch_size = tg.stages(args)[0].batch_size
    if one_micro_batch:
        batch_size //= rt.grad_accum_steps
        rt = dataclasses.replace(rt, grad_accum_steps=1)
    model, adam, muon = tg.build_model_and_optimizers(args, rt)
    train_files, val_file = tg.find_data(args, rt)
    trainer = tg.Trainer(args, rt, model, adam, muon, train_files, val_file, tg.Logger("/dev/null", False))
    stage = tg.stages(args)[0]
    initial = copy.deepcopy(dict(model=model.state_dict(), opts=[o.state_dict() for o in (adam, muon)]))

    def six_steps(graphs):
        trainer.graphs, losses = graphs, []
        batches = trainer.new_batches(batch_size)
        for step in range(6):
            trainer.train_step(step, batches, None, stage.ws_short, stage.ws_long, rt.grad_accum_steps, losses)
        return [p.detach().clone() for p in model.parameters()], losses

    eager, eager_losses = six_steps(None)
    from_the_start(trainer, initial)
    graphs = tg.MicroBatchGraphs(model, adam, muon.grad_buffers, writes_first=one_micro_batch, new_graph=RerunGraph)
    replayed = []
    real_replayed = adam.reduce_scatters_replayed
    adam.reduce_scatters_replayed = lambda params: (replayed.append(len(params)), real_replayed(params))
    graphed, graphed_losses = six_steps(graphs)
    return dict(same_weights=all(torch.equal(a, b) for a, b in zip(graphed, eager)),
                same_losses=all(torch.equal(a, b) for a, b in zip(graphed_losses, eager_losses)),
                weights=[w.float().sum().item() for w in graphed],
                reduce_scattering=[len(entry[2]) for entry in graphs.graphs.values()],
                reduce_scatters_replayed=replayed, captures=graphs.captures, replays=graphs.replays)


@pytest.mark.slow
def test_two_ranks_replay_the_reduce_scattering_micro_batch_as_its_own_graph_and_match_eager_bit_for_bit(tmp_path):
    from dist_utils import run_gloo
    build_shards(tmp_path / "data", train_shards=1, tokens_per_train_shard=80_000, val_tokens=10_000)
    ranks = run_gloo(_graphs_against_eager_on_two_ranks, 2, tmp_path / "data")
    for r in ranks:
        assert r["same_weights"] and r["same_losses"]
        # two keys: the plain micro-batch's graph and the one ending an Adam step, which reduce-scatters all six of
        # DistAdam's params; 24 micro-batches, two run eagerly and two captured, the rest replayed, step 5's last
        # the reduce-scattering graph
        assert r["reduce_scattering"] == [0, 6]
        assert (r["captures"], r["replays"], r["reduce_scatters_replayed"]) == (2, 20, [6])
    assert ranks[0]["weights"] == ranks[1]["weights"]  # the replicas stay identical


@pytest.mark.slow
def test_two_ranks_with_one_micro_batch_a_step_write_the_gradients_they_start_and_match_eager_bit_for_bit(tmp_path):
    from dist_utils import run_gloo
    build_shards(tmp_path / "data", train_shards=1, tokens_per_train_shard=80_000, val_tokens=10_000)
    ranks = run_gloo(_graphs_against_eager_on_two_ranks, 2, tmp_path / "data", True)
    for r in ranks:
        assert r["same_weights"] and r["same_losses"]
        # two keys: the even step's, which starts every gradient, and the odd step's, which starts NorMuon's and
        # reduce-scatters DistAdam's six; each runs eagerly, is captured, then replayed (steps 4 and 5)
        assert r["reduce_scattering"] == [0, 6]
        assert (r["captures"], r["replays"], r["reduce_scatters_replayed"]) == (2, 2, [6])
    assert ranks[0]["weights"] == ranks[1]["weights"]
