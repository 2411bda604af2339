"""--cuda-graphs: each training micro-batch replayed as one graph. Real CUDA graphs need a GPU (bench/bench.py
--check-graphs trains with and without them there and compares the weights bit for bit); here stand-in graphs pin
down everything around them: that a key's first micro-batch is captured and later ones replayed, the graph's copies
of the batch, its gradient buffers, the loss's divisor and the keys. A traced stand-in (make_fx) freezes the host
values a micro-batch reads, as a CUDA graph does, to show the rule GPT.forward states: a Python number the forward
reads reaches the replays only as a tensor or as an entry of MicroBatchGraphs.key()."""
import copy
import dataclasses
import re
import types

import pytest
import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import train_gpt as tg
from dist_utils import runtime_for
from proxy_shards import build_shards


class RerunGraph:
    """Stands in for CudaGraph's first capture, which runs the micro-batch as it captures: capture runs the function
    and keeps it (True: its work is done); replay runs it again, on whatever its captured tensors hold then."""

    def capture(self, fn) -> bool:
        fn()
        self.fn = fn
        return True

    def replay(self):
        self.fn()


class DeferredGraph:
    """Stands in for CudaGraph's later captures, which only record: capture keeps the function without running it
    (False: a replay must do the work); replay runs it."""

    def capture(self, fn) -> bool:
        self.fn = fn
        return False

    def replay(self):
        self.fn()


class TracedGraph:
    """Records like a CUDA graph: capture traces the function with make_fx on the real tensors it touches (which runs
    it once, so its work is done) into a graph of tensor ops, the autograd backward and the copies into the graphs'
    buffers included. Every Python number the function read is written into that graph as a constant; the tensors
    stay the same objects. replay runs the recorded ops again, and no Python."""

    def capture(self, fn) -> bool:
        self.graph = make_fx(fn, tracing_mode="real")()
        return True

    def replay(self):
        with torch.no_grad():  # the backward is among the recorded ops: nothing for autograd to do
            self.graph()


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("graphs")
    build_shards(folder / "data", train_shards=1, tokens_per_train_shard=80_000, val_tokens=10_000)
    # two stages and the extension, micro-batches of 16 and 32 tokens: the CPU's time goes to the op count of a
    # micro-batch (twelve layers, forward and backward) and to the optimizers' passes over the five vocab x width
    # tables, so fewer micro-batches and a 64-wide model (one head), not fewer tokens, make the tests fast
    args = tg.parse_args(["--smoke", "--device", "cpu", "--compile", "off", "--seed", "0", "--model-dim", "64",
                          "--num-heads", "1", "--train-bs-schedule", "128,256", "--ws-schedule", "3,7",
                          "--lr-plateaus", "1,1.5", "--lr-plateau-starts", "0,0.5", "--train-bs-extension", "256",
                          "--train-max-seq-len", "128",
                          "--data-path", str(folder / "data"), "--log-dir", str(folder / "logs")])
    # two micro-batches a step (as at four ranks) instead of one process's eight: what the graphs do with a step's
    # first, later and last micro-batch is the same, at a quarter of the CPU time (four a step at two ranks: below)
    runtime = dataclasses.replace(runtime_for(args), grad_accum_steps=2)
    return tg.build_trainer(args, runtime, folder / "logs" / "graphs.txt")


@pytest.fixture(scope="module")
def initial(trainer):
    return copy.deepcopy(dict(model=trainer.model.state_dict(),
                              opts=[o.state_dict() for o in (trainer.adam, trainer.muon)]))


def train_steps(trainer, graphs, steps_per_stage: int = 1, one_micro_batch: bool = False) -> tuple[list, list, list]:
    """steps_per_stage training steps (Trainer.train_step) of every stage from the trainer's current weights
    (one_micro_batch: each step one micro-batch, as on 8 GPUs): the weights after, every micro-batch's loss, and per
    step the params whose gradients its graph key says it starts."""
    trainer.graphs = graphs
    args, model = trainer.args, trainer.model
    micro_batches = 1 if one_micro_batch else trainer.runtime.grad_accum_steps
    step, losses, starts = 0, [], []

    def micro_batch(*a):  # train_step's own call, watched: every micro-batch's loss
        loss = tg.Trainer.micro_batch(trainer, *a)
        if graphs is not None:
            assert loss is graphs.loss  # the graphs' loss buffer, which the next micro-batch overwrites
        losses.append(loss.clone())
        return loss

    trainer.micro_batch = micro_batch
    try:
        for stage in tg.stages(args):
            model.yarn.set_window(stage.ws_long)
            batches = trainer.new_batches(stage.batch_size)
            for _ in range(steps_per_stage):
                if graphs is not None:
                    starts.append({id(graphs.params[i]) for i in graphs.key((), 0, 0)[-1]})
                before = len(losses)
                last = trainer.train_step(step, batches, None, stage.ws_short, stage.ws_long, micro_batches)
                assert len(losses) - before == micro_batches
                assert torch.equal(last, losses[-1])  # train_step returns the step's last micro-batch loss
                step += 1
    finally:
        del trainer.micro_batch
    return [p.detach().clone() for p in model.parameters()], losses, starts


def from_the_start(trainer, initial):
    trainer.model.load_state_dict(initial["model"])
    for opt, state in zip((trainer.adam, trainer.muon), initial["opts"]):
        opt.load_state_dict(state)
    trainer.model.zero_grad(set_to_none=True)
    trainer.model.yarn.reset()
    trainer.graphs = None


@pytest.fixture(scope="module")
def eager_steps(trainer, initial):
    """Eager training, once per module: (steps_per_stage, one_micro_batch) -> train_steps' result."""
    done = {}

    def get(steps_per_stage: int, one_micro_batch: bool):
        if (steps_per_stage, one_micro_batch) not in done:
            from_the_start(trainer, initial)
            done[steps_per_stage, one_micro_batch] = train_steps(trainer, None, steps_per_stage, one_micro_batch)
            from_the_start(trainer, initial)
        return done[steps_per_stage, one_micro_batch]
    return get


# A capture that ran the micro-batch (CudaGraph's first) must not be replayed as well, and one that only recorded
# (every later capture) must be replayed at once: either mistake adds a micro-batch's gradients twice or never.
@pytest.mark.parametrize("graph", [RerunGraph, DeferredGraph], ids=["capture-runs", "capture-records"])
def test_training_through_replayed_graphs_matches_eager_training_bit_for_bit(trainer, initial, eager_steps, graph,
                                                                              monkeypatch):
    eager, eager_losses, _ = eager_steps(1, False)
    from_the_start(trainer, initial)
    monkeypatch.setattr(tg, "CudaGraph", graph)  # what MicroBatchGraphs records a micro-batch with
    graphs = tg.MicroBatchGraphs(trainer.model, trainer.adam, trainer.muon.grad_buffers)
    try:
        graphed, graphed_losses, _ = train_steps(trainer, graphs)
    finally:
        from_the_start(trainer, initial)
    assert all(torch.equal(a, b) for a, b in zip(graphed, eager))
    assert len(graphed_losses) == len(eager_losses)
    assert all(torch.equal(a, b) for a, b in zip(graphed_losses, eager_losses))
    assert any(not torch.equal(a, b) for a, b in zip(graphed, initial["model"].values()))  # it did train
    # one key per stage, captured at its first micro-batch; every later one replays
    micro_batches = trainer.runtime.grad_accum_steps * len(tg.stages(trainer.args))
    assert graphs.captures == len(tg.stages(trainer.args)) == len(graphs.graphs)
    assert graphs.replays == micro_batches - (graphs.captures if graph is RerunGraph else 0)


@pytest.mark.parametrize("graph", [RerunGraph, DeferredGraph], ids=["capture-runs", "capture-records"])
def test_with_one_micro_batch_a_step_the_graphs_write_the_gradients_they_start_and_match_eager_bit_for_bit(
        trainer, initial, eager_steps, graph, monkeypatch):
    eager, eager_losses, _ = eager_steps(3, True)
    from_the_start(trainer, initial)
    monkeypatch.setattr(tg, "CudaGraph", graph)  # what MicroBatchGraphs records a micro-batch with
    graphs = tg.MicroBatchGraphs(trainer.model, trainer.adam, trainer.muon.grad_buffers, writes_first=True)
    try:
        graphed, graphed_losses, starts = train_steps(trainer, graphs, steps_per_stage=3, one_micro_batch=True)
    finally:
        from_the_start(trainer, initial)
    assert all(torch.equal(a, b) for a, b in zip(graphed, eager))
    assert len(graphed_losses) == len(eager_losses)
    assert all(torch.equal(a, b) for a, b in zip(graphed_losses, eager_losses))
    assert any(not torch.equal(a, b) for a, b in zip(graphed, initial["model"].values()))  # it did train
    # NorMuon sums one step's gradients, Adam two: an even step starts every gradient, an odd one NorMuon's only
    everything = {id(p) for p in trainer.model.parameters()}
    normuon = {id(p) for p in trainer.muon.grad_buffers}
    assert starts == [everything if k % 2 == 0 else normuon for k in range(len(starts))]
    # two keys a stage (steps go on counting across stages, so each stage has both parities), each captured at its
    # first micro-batch, then replayed
    stages = len(tg.stages(trainer.args))
    assert graphs.captures == 2 * stages == len(graphs.graphs)
    assert graphs.replays == 3 * stages - (graphs.captures if graph is RerunGraph else 0)


def test_the_buffers_every_graph_shares_are_made_up_front(trainer):
    graphs = tg.MicroBatchGraphs(trainer.model, trainer.adam, trainer.muon.grad_buffers)
    assert graphs.graphs == {} and graphs.captures == 0
    # outside any graph's memory pool: the gradients every graph adds into (NorMuon's rows of its gradient stacks,
    # zeros for the rest), the loss's divisor and the loss
    assert len(graphs.grads) == len(graphs.params) == len(list(trainer.model.parameters()))
    for p, g in zip(graphs.params, graphs.grads):
        if p in trainer.muon.grad_buffers:
            assert g is trainer.muon.grad_buffers[p]
        else:
            assert g.shape == p.shape and g.dtype == p.dtype and torch.count_nonzero(g) == 0
    assert graphs.divisor.shape == graphs.loss.shape == ()


def test_a_stage_gets_a_new_graph_when_its_windows_or_softmax_scale_change(trainer):
    graphs = tg.MicroBatchGraphs(trainer.model, trainer.adam)
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
    graphs = tg.MicroBatchGraphs(model, trainer.adam, trainer.muon.grad_buffers)
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


def torchrun_env(world_size, rank) -> dict:
    """The launcher's variables of a rank that torchrun started."""
    return dict(WORLD_SIZE=str(world_size), RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def test_cuda_graphs_resolve_on_with_cuda_and_compile_at_every_world_size_and_refuse_the_cpu(monkeypatch):
    args = tg.parse_args(["--smoke", "--device", "cpu", "--compile", "off"])
    assert runtime_for(args).cuda_graphs is False  # auto on the CPU
    assert runtime_for(args, **torchrun_env(2, 0)).cuda_graphs is False  # gloo
    with pytest.raises(tg.ConfigError, match="needs a CUDA GPU"):
        runtime_for(tg.parse_args(["--smoke", "--device", "cpu", "--cuda-graphs", "on"]))
    # where CUDA is visible (faked: resolve_runtime only asks whether it is; plain kernels need no GPU check)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    on_cuda = lambda *flags, world="1": runtime_for(tg.parse_args(["--kernels", "plain", *flags]),
                                                   **torchrun_env(world, 0))
    assert all(on_cuda(world=w).cuda_graphs is True for w in ("1", "2", "4", "8"))
    assert on_cuda("--compile", "off").cuda_graphs is False  # graphs of eager kernels: no
    assert on_cuda("--cuda-graphs", "off").cuda_graphs is False
    assert on_cuda("--compile", "off", "--cuda-graphs", "on").cuda_graphs is True  # asked for: granted


# ----------------------------------------------------------------------------------------------------
# The rule GPT.forward states, shown with a graph that really freezes host values (TracedGraph)
# ----------------------------------------------------------------------------------------------------

class GainModel(nn.Module):
    """loss = sum((gain · x Wᵀ - y)²), where `gain` is a Python number the forward reads (as GPT.forward reads
    yarn.attn_scale and its windows)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8, generator=torch.Generator().manual_seed(0)))
        self.gain = 1.0
        self.yarn = types.SimpleNamespace(attn_scale=0.1)  # MicroBatchGraphs.key() reads the softmax scale here

    def forward(self, x, y):
        return (self.gain * torch.nn.functional.linear(x, self.w) - y).square().sum()


class GainKeyedGraphs(tg.MicroBatchGraphs):
    """What a speedrunner adds with such a number: it joins the key, so each value gets a graph of its own."""

    def key(self, batch, ws_short, ws_long):
        return (self.model.gain, *super().key(batch, ws_short, ws_long))


def micro_batches_of(model, plan, graphs=None):
    """Run plan = [(gain, micro-batches per step, batches)] step by step, eagerly or through graphs: every
    micro-batch's loss and each step's gradient."""
    def forward_backward(x, y, ws_short, ws_long, divisor):
        loss = model(x, y)
        (loss / divisor).backward()
        return loss.detach()

    losses, grads = [], []
    for gain, micro_batches, batches in plan:
        model.gain = gain
        for batch in batches:
            if graphs is None:
                losses.append(forward_backward(*batch, 1, 3, micro_batches))
            else:
                loss = graphs.run(batch, 1, 3, micro_batches, forward_backward)
                assert loss is graphs.loss  # the graphs' loss buffer, returned
                losses.append(loss.clone())
        grads.append(model.w.grad.clone())
        model.zero_grad(set_to_none=True)  # as train_step leaves them
    return losses, grads


def batches(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("graph", [RerunGraph, DeferredGraph], ids=["capture-runs", "capture-records"])
def test_each_keys_first_micro_batch_is_captured_the_later_ones_replay_and_each_runs_once(graph, monkeypatch):
    model, events = GainModel(), []

    class Watched(graph):
        def capture(self, fn):
            events.append("capture")
            return super().capture(lambda: (events.append("run"), fn()))

        def replay(self):
            events.append("replay")
            super().replay()

    graphs = GainKeyedGraphs(model, tg.DistAdam(list(model.parameters())))
    monkeypatch.setattr(tg, "CudaGraph", Watched)
    micro_batches_of(model, [(1.0, 2, batches(2, 6)), (0.5, 2, batches(2, 7)), (1.0, 1, batches(1, 8))], graphs)
    if graph is RerunGraph:  # the capture did the micro-batch's work: no replay of it
        assert events == ["capture", "run", "replay", "run", "capture", "run", "replay", "run", "replay", "run"]
    else:  # the capture only recorded: replayed at once
        assert events == ["capture", "replay", "run", "replay", "run", "capture", "replay", "run", "replay", "run",
                          "replay", "run"]
    assert graphs.captures == 2 and len(graphs.graphs) == 2


def test_a_python_number_the_forward_reads_is_frozen_at_capture_unless_the_graph_key_holds_it(monkeypatch):
    monkeypatch.setattr(tg, "CudaGraph", TracedGraph)
    model = GainModel()
    adam = tg.DistAdam(list(model.parameters()))
    plan = [(1.0, 2, batches(2, 1)), (0.5, 2, batches(2, 2))]  # the gain changes between steps
    eager_losses, eager_grads = micro_batches_of(model, plan)
    at_capture = micro_batches_of(model, [(1.0, m, b) for _, m, b in plan])  # eagerly, the gain never changed

    frozen = tg.MicroBatchGraphs(model, adam)
    losses, grads = micro_batches_of(model, plan, frozen)
    assert frozen.captures == 1 and frozen.replays == 3
    # the first step matches eager (new batches reach the replays through the graph's copies) ...
    assert all(torch.equal(a, b) for a, b in zip(losses[:2], eager_losses[:2]))
    assert torch.equal(grads[0], eager_grads[0])
    # ... the second computed with the gain of the capture, not the one the model now holds
    assert not any(torch.equal(a, b) for a, b in zip(losses[2:], eager_losses[2:]))
    assert not torch.equal(grads[1], eager_grads[1])
    assert all(torch.equal(a, b) for a, b in zip(losses, at_capture[0])) and torch.equal(grads[1], at_capture[1][1])

    keyed = GainKeyedGraphs(model, adam)
    losses, grads = micro_batches_of(model, plan, keyed)
    assert keyed.captures == 2 and keyed.replays == 2  # one graph per gain
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses))
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads))


def test_a_value_the_graphs_read_from_a_tensor_reaches_every_replay(monkeypatch):
    """The loss's divisor (micro-batches per step) changes without a new key: the graphs read it from a tensor."""
    monkeypatch.setattr(tg, "CudaGraph", TracedGraph)
    model = GainModel()
    plan = [(1.0, 2, batches(2, 3)), (1.0, 4, batches(4, 4)), (1.0, 1, batches(1, 5))]
    eager_losses, eager_grads = micro_batches_of(model, plan)
    graphs = tg.MicroBatchGraphs(model, tg.DistAdam(list(model.parameters())))
    losses, grads = micro_batches_of(model, plan, graphs)
    assert graphs.captures == 1 and graphs.replays == 6
    assert all(torch.equal(a, b) for a, b in zip(losses, eager_losses))
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads))
    assert not torch.equal(grads[1], 2 * grads[1])  # not all zero: the divisors differ in what they give


def test_the_graphs_check_names_a_python_number_changed_since_the_capture_and_leaves_the_gradients_as_they_were(
        monkeypatch):
    """--cuda-graphs check (Trainer.graphs_against_eager, at each stage's first step): the same micro-batch through
    its graph and eagerly. Equal losses: one log line, the gradients as before. A number the forward reads that
    changed since the capture (a planted step-dependent value): the run stops with one line saying so, status 2."""
    monkeypatch.setattr(tg, "CudaGraph", TracedGraph)
    model, logged, data = GainModel(), [], iter(batches(4, 9))

    def forward_backward(x, y, ws_short, ws_long, divisor):
        loss = model(x, y)
        (loss / divisor).backward()
        return loss.detach()

    graphs = tg.MicroBatchGraphs(model, tg.DistAdam(list(model.parameters())))
    trainer = types.SimpleNamespace(model=model, graphs=graphs, runtime=types.SimpleNamespace(grad_accum_steps=2),
                                    new_batches=lambda size: types.SimpleNamespace(get=lambda: next(data)),
                                    forward_backward=forward_backward,
                                    log=lambda line, console=True: logged.append(line))
    stage = types.SimpleNamespace(name="stage 2", batch_size=5, ws_short=1, ws_long=3)
    graphs.run(next(data), 1, 3, 2, forward_backward)  # the step's first micro-batch: captured
    grad = model.w.grad.clone()
    tg.Trainer.graphs_against_eager(trainer, 4, stage)
    assert torch.equal(model.w.grad, grad)
    assert len(logged) == 1 and re.fullmatch(r"cuda graphs check: stage 2 at step 4: graph and eager loss [\d.]+",
                                             logged[0])
    model.gain = 0.5  # what an edit reading the step in the forward does
    with pytest.raises(tg.GraphsDiffer) as e:
        tg.Trainer.graphs_against_eager(trainer, 9, stage)
    assert e.value.status == 2 and "\n" not in str(e.value)
    assert re.fullmatch(r"stopped at step 9: stage 2's CUDA graph gives loss [\d.]+ and eager [\d.]+: the forward "
                        r"reads a value that changed since the graphs were captured \(README: Changing the model\)",
                        str(e.value))
    assert torch.equal(model.w.grad, grad) and len(logged) == 1


# Two processes (gloo): the micro-batch that ends an Adam step launches DistAdam's reduce-scatters from its gradient
# hooks. It gets a graph of its own, whose replay must leave the averaged gradients where DistAdam's step reads them.

def _graphs_against_eager_on_two_ranks(rank, world_size, data, one_micro_batch=False):
    """Six steps of stage 1 with two ranks (two micro-batches each per step, as at four ranks: half the CPU time of
    two ranks' four), eagerly and through stand-in graphs: the plain micro-batch's key is captured in step 0, the
    reduce-scattering one (the last of each odd step) is captured in step 1 and replayed in steps 3 and 5.
    one_micro_batch: each rank runs one micro-batch a step, as on 8 GPUs (the graphs write the gradients they start):
    each key is captured in step 0 or 1."""
    args = tg.parse_args(["--smoke", "--device", "cpu", "--compile", "off", "--seed", "0", "--model-dim", "64",
                          "--num-heads", "1", "--train-bs-schedule", "128,256,384", "--train-bs-extension", "384",
                          "--train-max-seq-len", "128", "--data-path", str(data)])
    runtime = runtime_for(args, **torchrun_env(world_size, rank))
    batch_size = tg.stages(args)[0].batch_size
    if one_micro_batch:
        batch_size //= runtime.grad_accum_steps
    runtime = dataclasses.replace(runtime, grad_accum_steps=1 if one_micro_batch else 2)
    model, adam, muon = tg.build_model_and_optimizers(args, runtime)
    train_files, val_file = tg.find_data(args, runtime)
    trainer = tg.Trainer(args, runtime, model, adam, muon, train_files, val_file, tg.Logger("/dev/null", False))
    stage = tg.stages(args)[0]
    initial = copy.deepcopy(dict(model=model.state_dict(), opts=[o.state_dict() for o in (adam, muon)]))

    def six_steps(graphs):
        trainer.graphs, losses = graphs, []
        batches = trainer.new_batches(batch_size)
        for step in range(6):
            losses.append(trainer.train_step(step, batches, None, stage.ws_short, stage.ws_long,
                                             runtime.grad_accum_steps).clone())
        return [p.detach().clone() for p in model.parameters()], losses

    eager, eager_losses = six_steps(None)
    from_the_start(trainer, initial)
    graphs = tg.MicroBatchGraphs(model, adam, muon.grad_buffers, writes_first=one_micro_batch)
    tg.CudaGraph = RerunGraph  # this rank's process only
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
        # DistAdam's params; of 12 micro-batches two are captured (their capture runs them), the rest replayed,
        # the reduce-scattering graph in steps 3 and 5
        assert r["reduce_scattering"] == [0, 6]
        assert (r["captures"], r["replays"], r["reduce_scatters_replayed"]) == (2, 10, [6, 6])
    assert ranks[0]["weights"] == ranks[1]["weights"]  # the replicas stay identical


@pytest.mark.slow
def test_two_ranks_with_one_micro_batch_a_step_write_the_gradients_they_start_and_match_eager_bit_for_bit(tmp_path):
    from dist_utils import run_gloo
    build_shards(tmp_path / "data", train_shards=1, tokens_per_train_shard=80_000, val_tokens=10_000)
    ranks = run_gloo(_graphs_against_eager_on_two_ranks, 2, tmp_path / "data", True)
    for r in ranks:
        assert r["same_weights"] and r["same_losses"]
        # two keys: the even step's, which starts every gradient, and the odd step's, which starts NorMuon's and
        # reduce-scatters DistAdam's six; each captured in step 0 or 1, then replayed (steps 2-5)
        assert r["reduce_scattering"] == [0, 6]
        assert (r["captures"], r["replays"], r["reduce_scatters_replayed"]) == (2, 4, [6, 6])
    assert ranks[0]["weights"] == ranks[1]["weights"]
