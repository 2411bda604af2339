"""Parallel compile: the trunk split into graphs over consecutive blocks, the compile jobs, the helper processes
that compile them (their environment, failures, time-outs), the passes that compile one job, and when helpers are
started at all (configuration, a loaded bundle, the marker of an earlier run)."""
import dataclasses
import json
import sys
import textwrap
import time

import pytest
import torch

import train_gpt as tg

SMOKE = tg.Hyperparameters(**tg.SMOKE_PRESET)
CPU = ["--device", "cpu", "--compile", "off"]


def smoke_model(trunk_graphs, seed=0, max_seq_len=512):
    torch.manual_seed(seed)
    m = tg.GPT(SMOKE, max_seq_len=max_seq_len, trunk_graphs=trunk_graphs)
    with torch.no_grad():
        m.lm_head.weight.normal_(0, 0.02, generator=torch.Generator().manual_seed(seed + 1))
    return m


def test_trunk_graphs_cover_blocks_1_to_11_in_order_with_the_larger_parts_last():
    for parts in range(1, 12):
        bounds = tg.trunk_bounds(12, parts)
        assert len(bounds) == parts and bounds[0][0] == 1 and bounds[-1][1] == 12
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        sizes = [last - first for first, last in bounds]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes)
    assert tg.trunk_bounds(12, 3) == [(1, 4), (4, 8), (8, 12)]


@pytest.mark.parametrize("parts", [2, 3, 11])
def test_a_split_trunk_computes_the_same_loss_and_gradients_as_one_graph(parts):
    """The parts hand over (x, x0, skip, backout, value embeddings): same ops in the same order as one trunk."""
    whole, split = smoke_model(1), smoke_model(parts)
    batch = tg.synthetic_micro_batch(256, 128, SMOKE.vocab_size, "cpu", seed=3)
    losses = [m(*batch, 1, 3, 128) for m in (whole, split)]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(whole.named_parameters(), split.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_trunk_parts_limit_returns_the_carry_of_the_first_parts():
    m = smoke_model(3)
    batch = tg.synthetic_micro_batch(256, 256, SMOKE.vocab_size, "cpu", seed=4)
    with torch.no_grad():
        x, x0, skip, backout, ve = m(*batch, 1, 3, 256, trunk_parts=1)
    assert x.shape == x0.shape == (256, SMOKE.model_dim) and skip is None and backout is None and len(ve) == 3


def test_synthetic_micro_batch_has_the_loaders_shapes_and_dtypes():
    inputs, targets, cu = tg.synthetic_micro_batch(1000, 256, 50257, "cpu")
    assert inputs.dtype == torch.int32 and targets.dtype == torch.int64 and cu.dtype == torch.int32
    assert inputs.shape == targets.shape == (1000,) and cu.shape == (tg.max_num_docs_for(1000),)
    assert cu[:6].tolist() == [0, 256, 512, 768, 1000, 1000]  # documents of at most max_seq_len, then padding
    assert int(inputs.max()) < 50257


def test_compile_jobs_are_the_trunk_parts_the_head_and_on_one_gpu_the_optimizers():
    assert tg.compile_jobs(3, 1) == ["trunk0", "trunk1", "trunk2", "head", "optimizers"]
    assert tg.compile_jobs(1, 8) == ["trunk0", "head"]  # sharded optimizers need the process group


@pytest.mark.parametrize("flag, device, local_world, expected", [
    ("auto", "cuda", "1", 2), ("auto", "cuda", "8", 1), ("on", "cuda", "8", 2), ("off", "cuda", "1", 1),
    ("auto", "cpu", "1", 1)])
def test_the_trunk_is_split_only_where_compile_workers_run(flag, device, local_world, expected):
    """One graph fuses across blocks (a little faster at stages 2-3): the split is for configurations whose
    helpers compile the parts side by side. On the CPU nothing compiles unless asked."""
    args = tg.parse_args(["--parallel-compile", flag])
    assert tg.resolve_trunk_graphs(args, device, {"LOCAL_WORLD_SIZE": local_world}) == expected


def test_parallel_compile_other_than_auto_on_or_off_is_a_config_error():
    with pytest.raises(tg.ConfigError, match="--parallel-compile"):
        tg.parse_args(["--parallel-compile", "maybe"])


def test_helpers_are_skipped_with_a_loaded_bundle_or_after_a_run_of_the_same_script(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    args, env = tg.parse_args([]), {"LOCAL_WORLD_SIZE": "1", "WORLD_SIZE": "1"}
    assert tg.wants_parallel_compile(args, "cuda", cache_loaded=False, env=env)
    assert not tg.wants_parallel_compile(args, "cuda", cache_loaded=True, env=env)
    assert not tg.wants_parallel_compile(args, "cpu", cache_loaded=False, env=env)
    marker = tg.compiled_marker(args, 1, tg.PARALLEL_TRUNK_GRAPHS)
    assert marker.parent.parent == tmp_path
    marker.parent.mkdir(parents=True)
    marker.touch()
    assert not tg.wants_parallel_compile(args, "cuda", cache_loaded=False, env=env)
    assert tg.wants_parallel_compile(tg.parse_args(["--mlp-kernel", "inductor"]), "cuda", False, env)
    # a one-graph run's marker does not stand for the split trunk's graphs
    assert tg.compiled_marker(args, 1, 1) != marker


def test_marker_changes_with_what_shapes_a_graph_not_with_seeds_logs_or_schedule_length(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    base = tg.compiled_marker(tg.parse_args([]), 1, 3)
    for same in (["--seed", "5"], ["--run-id", "x", "--log-dir", "elsewhere"], ["--num-scheduled-iterations", "90"],
                 ["--data-path", "data/proxy", "--train-epochs", "20"], ["--parallel-compile", "on"],
                 ["--cuda-graphs", "off"]):
        assert tg.compiled_marker(tg.parse_args(same), 1, 3) == base, same
    for other in (["--fp8", "off"], ["--val-batch-size", "524288"], ["--mlp-kernel", "inductor"]):
        assert tg.compiled_marker(tg.parse_args(other), 1, 3) != base, other
    assert tg.compiled_marker(tg.parse_args([]), 2, 3) != base
    assert tg.compiled_marker(tg.parse_args([]), 1, 2) != base


def test_settings_reach_the_helpers_unchanged_through_json():
    args = tg.parse_args(["--ws-schedule", "3,5,9", "--seed", "4", "--fp8", "off", "--smoke"])
    back = tg.hyperparameters_from_json(tg.hyperparameters_to_json(args))
    assert back == args and isinstance(back.ws_schedule, tuple)


HELPER = textwrap.dedent("""
    import json, os, sys, time
    job = os.environ["SPEEDRUN_COMPILE_JOB"]
    keep = ("SPEEDRUN_COMPILE_JOB", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_ERROR_FILE")
    with open(os.path.join(sys.argv[1], job + ".json"), "w") as f:
        json.dump(dict({k: os.environ.get(k) for k in keep},
                       args=json.loads(os.environ["SPEEDRUN_COMPILE_ARGS"])), f)
    if job == "head":
        print("compiling the head"); print("RuntimeError: the head failed"); sys.exit(3)
    if job == "optimizers":
        time.sleep(30)
""")


def test_helpers_get_their_job_and_the_settings_but_no_rank_and_failures_are_one_line_each(tmp_path):
    """A helper is no rank of the job (no RANK, no torchrun error file); WORLD_SIZE and LOCAL_RANK keep the shapes
    and the GPU. A helper that fails, or outlives the time-out, costs its job a compile in the warm-up: one line
    with the job, why, its last output line and its log."""
    args = tg.parse_args(["--seed", "9"])
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "TORCHELASTIC_ERROR_FILE": "/tmp/x", "PATH": "/usr/bin"}
    t = time.time()
    workers = tg.CompileWorkers.start(args, ["trunk1", "head", "optimizers"], env,
                                      command=[sys.executable, "-c", HELPER, str(tmp_path)])
    problems = workers.wait(timeout_s=8)
    assert time.time() - t < 20
    assert set(workers.seconds) == {"trunk1", "head"}  # the optimizers' helper never exited
    seen = json.loads((tmp_path / "trunk1.json").read_text())
    assert seen == dict(SPEEDRUN_COMPILE_JOB="trunk1", RANK=None, WORLD_SIZE="1", LOCAL_RANK="0",
                        TORCHELASTIC_ERROR_FILE=None, args=json.loads(tg.hyperparameters_to_json(args)))
    assert len(problems) == 2
    head, optimizers = problems
    assert head.startswith("compile worker for head failed (exit 3: RuntimeError: the head failed; log ")
    assert optimizers.startswith("compile worker for optimizers failed (still running after 8s")
    assert all(line.endswith("the warm-up compiles it here") for line in problems)
    assert workers.log_dir.is_dir()  # kept for the failures' logs
    workers.stop()


def test_helpers_that_all_succeed_leave_no_logs_and_stop_kills_the_rest(tmp_path):
    ok = tg.CompileWorkers.start(tg.parse_args([]), ["trunk1"], {"PATH": "/usr/bin"},
                                 command=[sys.executable, "-c", "pass"])
    assert ok.wait() == [] and not ok.log_dir.exists()
    slow = tg.CompileWorkers.start(tg.parse_args([]), ["trunk1"], {"PATH": "/usr/bin"},
                                   command=[sys.executable, "-c", "import time; time.sleep(60)"])
    t = time.time()
    slow.stop()
    assert time.time() - t < 10 and all(proc.poll() is not None for proc, _ in slow.procs.values())


class Recorder:
    """Stands in for a compiled region: runs the eager function and records the call."""

    def __init__(self, fn, calls, name):
        self.fn, self.calls, self.name = fn, calls, name

    def __call__(self, *a, **k):
        self.calls.append((self.name, a[:2] if self.name == "trunk" else (), torch.is_grad_enabled()))
        return self.fn(*a, **k)


def recorded_model():
    m, calls = smoke_model(3), []
    m._trunk, m._head = Recorder(m.trunk_part, calls, "trunk"), Recorder(m.head, calls, "head")
    return m, calls


def test_compile_passes_of_a_trunk_part_run_only_that_part_compiled_and_stop_after_it_in_validation():
    m, calls = recorded_model()
    rt = tg.resolve_runtime(tg.Hyperparameters(**tg.SMOKE_PRESET, device="cpu", compile="off"), env={})
    tg.run_compile_passes(m, SMOKE, rt, "trunk1")
    assert calls == [("trunk", (4, 8), True), ("trunk", (4, 8), False)]  # train, then validation
    assert m.compiled_jobs is None and m.training
    assert all(p.grad is None for p in m.parameters())


def test_compile_passes_of_the_head_run_a_whole_validation_micro_batch_through_it():
    m, calls = recorded_model()
    rt = tg.resolve_runtime(tg.Hyperparameters(**tg.SMOKE_PRESET, device="cpu", compile="off"), env={})
    tg.run_compile_passes(m, SMOKE, rt, "head")
    assert calls == [("head", (), True), ("head", (), False)]


def test_compile_passes_of_the_optimizers_step_a_fresh_pair_twice_and_clear_the_gradients():
    m, calls = recorded_model()
    rt = tg.resolve_runtime(tg.Hyperparameters(**tg.SMOKE_PRESET, device="cpu", compile="off"), env={})
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    tg.run_compile_passes(m, SMOKE, rt, "optimizers")
    assert calls == []  # the model runs eagerly: only the optimizers' graphs belong to this job
    assert not torch.equal(before["blocks.1.mlp.c_fc"], m.blocks[1].mlp.c_fc)  # NorMuon stepped
    assert not torch.equal(before["scalars"], m.scalars)  # so did Adam, on the second step
    assert all(p.grad is None for p in m.parameters())


def test_warm_up_with_workers_stops_them_when_its_own_job_found_everything_cached(monkeypatch):
    """With the marker gone but the caches warm, the trainer's own job compiles nothing: waiting for the helpers
    would only cost their start-up."""
    events = []
    workers = types_namespace(procs={"trunk1": None}, stop=lambda: events.append("stop"),
                              wait=lambda: events.append("wait") or [], seconds={"trunk1": 12.5})
    trainer = types_namespace(args=SMOKE, rt=types_namespace(trunk_graphs=3, world_size=1), model=None,
                              workers=workers, warm_up_times=[], log=events.append, console=events.append)
    monkeypatch.setattr(tg, "run_compile_passes", lambda *a: None)
    tg.Trainer.compile_side_by_side(trainer)
    assert events[0] == "stop" and "was in the caches" in events[1] and "wait" not in events
    misses = iter([0, 2])  # the own job compiled two graphs: the helpers are compiling too
    monkeypatch.setattr(tg, "compile_cache_misses", lambda: next(misses))
    events.clear()
    tg.Trainer.compile_side_by_side(trainer)
    assert events[0] == "wait" and "stop" not in events
    assert "1 of 1 jobs in helper processes (trunk1 12.5s)" in events[1]


def types_namespace(**kw):
    import types
    return types.SimpleNamespace(**kw)


class Stop(Exception):
    """Ends a run right after the point under test."""


def record_start_up(monkeypatch, events, fail):
    """open_compile_cache and start_compile_workers recorded; the next step (train_run or build_trainer) fails."""
    monkeypatch.setattr(tg, "open_compile_cache", lambda args: events.append("cache") or (None, True, "loaded"))
    workers = types_namespace(stop=lambda: events.append("stop"), seconds={})
    monkeypatch.setattr(tg, "start_compile_workers",
                        lambda args, cache_loaded: events.append(("workers", cache_loaded)) or workers)

    def next_step(*a, **k):
        events.append(("next", a[-1] is workers))
        raise Stop
    monkeypatch.setattr(tg, fail, next_step)


def test_run_starts_the_workers_after_the_compile_cache_and_stops_them_when_the_run_fails(monkeypatch):
    events = []
    record_start_up(monkeypatch, events, "train_run")
    with pytest.raises(Stop):
        tg.run(tg.parse_args(CPU))
    assert events == ["cache", ("workers", True), ("next", True), "stop"]


def test_benchmark_starts_the_workers_as_the_trainer_does(monkeypatch, tmp_path):
    sys.path.insert(0, str(tg.Path(tg.__file__).parent / "bench"))
    import bench
    events = []
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # bench.py measures its size
    record_start_up(monkeypatch, events, "build_trainer")
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "make_synthetic_shards", lambda *a, **k: None)
    with pytest.raises(Stop):
        bench.main(["--out", str(tmp_path / "b.json"), "--data-dir", str(tmp_path / "data"), "--", *CPU])
    assert events == ["cache", ("workers", True), ("next", True), "stop"]


def test_run_config_names_the_trunk_graphs_and_whether_helpers_compiled():
    rt = tg.resolve_runtime(tg.parse_args(CPU), env={}, parallel_compile=False)
    line = rt.config_line(tg.parse_args(CPU))
    assert " trunk_graphs=1 parallel_compile=0 " in line
    assert dataclasses.replace(rt, parallel_compile=True, trunk_graphs=3).config_line(tg.parse_args(CPU)).count(
        "trunk_graphs=3 parallel_compile=1") == 1
