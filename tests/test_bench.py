"""bench/bench.py: the parts that run without a GPU (synthetic data, FLOP count, MFU, the table, profile summaries);
the log readers of bench/loss/ and the 8-GPU model of bench/multi_gpu/."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import train_gpt as tg

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path[:0] = [str(BENCH), str(BENCH / "loss"), str(BENCH / "multi_gpu")]
import bench  # noqa: E402


def test_synthetic_shards_are_valid_speedrun_shards_of_bos_started_documents(tmp_path):
    bench.make_synthetic_shards(tmp_path, train_tokens=200_000, val_tokens=50_001)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["fineweb_train_000001.bin", "fineweb_train_000002.bin", "fineweb_val_000000.bin"]
    total = 0
    for name in files[:2]:
        tokens = tg.load_data_shard(tmp_path / name).numpy()
        total += len(tokens)
        starts = np.flatnonzero(tokens == tg.BOS_ID)
        assert starts[0] == 0
        lengths = np.diff(np.append(starts, len(tokens)))
        assert lengths.max() <= 8192 and np.median(lengths) > 100
        assert tokens.max() <= tg.BOS_ID
    assert total == 200_000
    assert tg.read_shard_header(tmp_path / files[2]) == 50_001


def test_synthetic_shards_are_reused_when_present(tmp_path):
    bench.make_synthetic_shards(tmp_path, 20_000, 5_000)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    bench.make_synthetic_shards(tmp_path, 20_000, 5_000)
    assert before == {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()}


def test_document_lengths_sum_exactly_and_respect_bounds():
    lengths = bench.document_lengths(1_000_000, np.random.default_rng(0))
    assert sum(lengths) == 1_000_000
    assert min(lengths[:-1]) >= 16 and max(lengths) <= 8192


def test_matmul_params_of_the_record_model_is_114m():
    with torch.device("meta"):
        model = tg.GPT(tg.Hyperparameters(), max_seq_len=2048)
    # 10 attention stacks (4 x 768 x 768) with their 6 x 12 gates, 11 MLPs (2 x 3072 x 768), lm_head 50304 x 768
    assert bench.matmul_params(model) == 10 * (4 * 768 ** 2 + 72) + 11 * 2 * 3072 * 768 + 50304 * 768 == 114_131_664


def test_mfu_formula():
    # the reference's stage 3 on the H100: 393,216 tokens in 721 ms against a 798 TFLOP/s peak
    assert bench.mfu(393_216 / 0.721, 114_130_944, 798e12) == pytest.approx(0.468, abs=1e-3)


def test_bench_args_are_the_trainers_flags_with_the_benchmarks_data():
    args = bench.bench_args(Path("/tmp/bench_data"), seed=7, train_flags=["--kernels", "plain", "--fp8", "off"])
    assert (args.kernels, args.fp8, args.seed, args.data_path) == ("plain", "off", 7, "/tmp/bench_data")
    assert args.train_bs_schedule == tg.Hyperparameters().train_bs_schedule
    with pytest.raises(tg.ConfigError, match="--orthogonalizer"):
        bench.bench_args(Path("/tmp/bench_data"), seed=7, train_flags=["--orthogonalizer", "newton"])


def test_format_table_lists_every_stage_and_the_comparison_with_the_reference():
    stages = [dict(name=s.name, tokens_per_step=s.batch_size, windows=f"{s.ws_short},{s.ws_long}", median_ms=ms,
                   tokens_per_s=s.batch_size / ms * 1e3, mfu=0.5, peak_allocated_gib=20.0,
                   reference_ms=bench.REFERENCE_H100_MS.get(i + 1))
              for i, (s, ms) in enumerate(zip(tg.stages(tg.Hyperparameters()), (200, 400, 600, 610)))]
    result = dict(stages=stages, matmul_params=114_130_944, bf16_peak_tflops=800.0,
                  cold_start=dict(this_process_s=100.0, warm_up_s=90.0, cache_present_at_start=False,
                                  cache_mb_after=150.0, cached_s=25.0),
                  optimizers=dict(normuon_ms=5.0, distadam_ms=2.0),
                  orthogonalizer={"mlp 22x3072x768": dict(polar=dict(ms=2.0, polar_rel_err=0.1),
                                                          turbo=dict(ms=1.5, polar_rel_err=0.1))})
    table = bench.format_table(result)
    assert "stage 3" in table and "extension" in table
    assert "0.832" in table  # 600 / 721
    assert "with that cache: 25.0s" in table and "NorMuon step alone 5.00 ms" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_bench_without_cuda_fails_with_one_line(capsys):
    assert bench.main(["--out", "/nonexistent/x.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "CUDA" in err[0]


def test_run_summary_reads_finished_logs_and_leaves_out_console_copies_and_profiles(tmp_path):
    """bench/loss/run_summary.py: stage throughput from the validation lines at the stage boundaries; the console copy
    of a run, a profile and an unfinished log are not counted as runs."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_records import make_log
    import run_summary
    log = make_log(loss=2.9, time_ms=96_000.0, total=96, val_every=30)  # 1 s per step, validations at 0/30/60/90/96
    (tmp_path / "w1_seed1.txt").write_text(log)
    (tmp_path / "console_seed1.txt").write_text(log)
    (tmp_path / "w1_seed1_profile.txt").write_text("profile (step 75)\n")
    (tmp_path / "w1_seed2.txt").write_text(make_log(total=96, val_every=30, finish=False))
    out = tmp_path / "summary.json"
    assert run_summary.main([str(tmp_path), "--json", str(out)]) == 0
    import json
    rows = json.loads(out.read_text())
    assert [r["log"] for r in rows] == ["w1_seed1.txt"]
    r = rows[0]
    assert r["val_loss"]["96"] == 2.9 and r["warm_up_s"] == 93.2 and r["peak_allocated_mib"] == 30000
    for i, tokens in enumerate((131072, 262144, 393216), start=1):
        assert r[f"stage{i}_ms_per_step"] == pytest.approx(1000.0)
        assert r[f"stage{i}_tokens_per_s"] == pytest.approx(tokens)


class _FakeEvent:
    def __init__(self, name, start_us, end_us, cuda):
        self.name = name
        self.time_range = type("R", (), dict(start=start_us, end=end_us))()
        self.device_type = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU


def test_profile_summary_reports_gpu_idle_time_and_host_waits():
    """Kernels busy 0-4 ms and 6-10 ms of a 10 ms span -> 2 ms idle; two stream syncs and a memcpy on the CPU."""
    events = [_FakeEvent("gemm", 0, 4000, True), _FakeEvent("ncclKernel_AllReduce", 1000, 2000, True),
              _FakeEvent("relu", 6000, 10000, True), _FakeEvent("cudaStreamSynchronize", 100, 600, False),
              _FakeEvent("cudaStreamSynchronize", 700, 800, False), _FakeEvent("cudaMemcpyAsync", 0, 50, False),
              _FakeEvent("cudaLaunchKernel", 0, 5, False)]
    prof = type("P", (), dict(events=lambda self: events))()
    text = bench.summarize_profile(prof, "fake")
    assert "GPU span 10.00" in text and "compute busy 8.00" in text and "idle 2.00" in text
    assert "cudaStreamSynchronize 2x 0.60 ms" in text and "cudaMemcpyAsync 1x 0.05 ms" in text
    assert "cudaLaunchKernel" not in text.split("host waits")[1].splitlines()[0]


def test_profile_summary_says_none_when_the_step_never_waits():
    events = [_FakeEvent("gemm", 0, 1000, True), _FakeEvent("cudaLaunchKernel", 0, 5, False)]
    prof = type("P", (), dict(events=lambda self: events))()
    assert "host waits (CUDA runtime calls that block the CPU): none" in bench.summarize_profile(prof, "fake")


def test_format_table_reports_the_fused_kernels_and_host_syncs():
    stages = [dict(name="stage 1", tokens_per_step=131072, windows="128,384", median_ms=250.0, tokens_per_s=5e5,
                   mfu=0.5, peak_allocated_gib=20.0, reference_ms=274.0)]
    result = dict(stages=stages, matmul_params=114_130_944, bf16_peak_tflops=800.0, fused="attention,mlp",
                  cold_start=dict(this_process_s=100.0, warm_up_s=90.0, cache_present_at_start=False,
                                  cache_mb_after=150.0),
                  host_syncs_in_a_stage3_step=dict(count=0, first=[]))
    assert "fused kernels attention,mlp; synchronising CUDA calls in a stage-3 step: 0" in bench.format_table(result)


def test_host_time_by_op_ranks_the_ops_that_cost_the_cpu_most():
    from torch.profiler import ProfilerActivity, profile
    a = torch.randn(256, 256)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            torch.mm(a, a)
        torch.relu(a)
    text = bench.host_time_by_op(prof, rows=5)
    assert text.startswith("host time by op")
    body = text.split("\n", 1)[1]
    assert "aten::mm" in body and "aten::relu" in body
    assert body.index("aten::mm") < body.index("aten::relu")  # five 256^3 matmuls cost more than one relu


def test_profile_summary_totals_gpu_time_by_kind_of_kernel():
    """Two cuBLAS GEMMs (3 ms), an FA4 kernel (2 ms), an Inductor kernel and one of ours: one line per kind."""
    events = [_FakeEvent("nvjet_sm90_tst_192x192", 0, 1000, True), _FakeEvent("nvjet_sm90_tst_256x128", 1000, 3000, True),
              _FakeEvent("kernel_cutlass_kernel_flash_attncuteflash_bwd", 3000, 5000, True),
              _FakeEvent("triton_red_fused__fused_rms_norm_add", 5000, 5500, True),
              _FakeEvent("_softcap_ce_backward_kernel", 5500, 6000, True)]
    prof = type("P", (), dict(events=lambda self: events))()
    kinds = bench.summarize_profile(prof, "fake").split("GPU time by kind of kernel")[1].split("\n\n")[0]
    assert "3.00      2  cuBLAS/CUTLASS GEMMs" in kinds and "2.00      1  FlashAttention" in kinds
    assert "0.50      1  Inductor's Triton kernels" in kinds and "0.50      1  our Triton kernels" in kinds
    assert kinds.index("cuBLAS") < kinds.index("FlashAttention") < kinds.index("Inductor")


def test_profile_summary_names_the_operation_of_an_aten_kernel():
    """ATen's templated kernel names start with namespaces; the list keeps the part that says what the kernel does."""
    name = ("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<at::native::"
            "CUDAFunctorOnSelf_add<float> >(at::TensorIteratorBase&, at::native::CUDAFunctorOnSelf_add<float> const&)")
    prof = type("P", (), dict(events=lambda self: [_FakeEvent(name, 0, 1000, True)]))()
    top = bench.summarize_profile(prof, "fake").split("top kernels by GPU time")[1]
    assert "elementwise_kernel<128, 4, gpu_kernel_impl_nocast<CUDAFunctorOnSelf_add<float> >" in top


def test_profile_lists_ops_by_their_input_shapes():
    """The shapes table ties an op to the tensors it ran on (here a transpose copy of a 64 x 32 tensor)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.randn(64, 32).t().contiguous()
    text = bench.gpu_time_by_op_and_shape(prof)
    assert text.startswith("GPU time by op and input shapes")
    assert any("aten::transpose" in line and "[64, 32]" in line for line in text.splitlines())


def test_as_world_size_gives_every_micro_batch_the_token_count_of_the_wider_run():
    """Two processes as ranks of an 8-GPU run: one micro-batch per rank and step, each of 1/8 of the stage's batch."""
    full = bench.bench_args(Path("/tmp/bench_data"), seed=1)
    args = bench.as_world_size(full, world=2, as_world=8)
    micro_batches = tg.grad_accum_steps_for(8)
    assert micro_batches == 1
    for scaled, original in zip((*args.train_bs_schedule, args.train_bs_extension, args.val_batch_size),
                                (*full.train_bs_schedule, full.train_bs_extension, full.val_batch_size)):
        assert scaled // (micro_batches * 2) == original // 8
    assert args.val_tokens == args.val_batch_size  # one validation step, as bench_args sets it
    assert bench.as_world_size(full, world=1, as_world=1) == full


@pytest.mark.parametrize("flags, env", [(["--as-world-size", "3"], {}), (["--as-world-size", "1"], {"WORLD_SIZE": "2"}),
                                        (["--cached-start"], {"WORLD_SIZE": "2"})])
def test_bench_refuses_a_world_it_cannot_stand_for_in_one_line(monkeypatch, capsys, flags, env):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert bench.main(["--out", "/nonexistent/x.json", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ")


def test_profile_timeline_counts_the_communication_no_compute_hides():
    """NCCL busy 1-2 ms (under a GEMM) and 4-6 ms (alone): 3 ms busy, 1 overlapped, 2 exposed; idle 0."""
    kernels = [("gemm", 0.0, 4.0), ("ncclDevKernel_ReduceScatter", 1.0, 2.0), ("ncclDevKernel_AllGather", 4.0, 6.0),
               ("relu", 6.0, 7.0)]
    t = bench.profile_timeline(kernels)
    assert t == dict(span_ms=7.0, compute_busy_ms=5.0, communication_busy_ms=3.0, communication_overlapped_ms=1.0,
                     communication_exposed_ms=2.0, idle_ms=0.0)


def test_val_steps_reports_the_welch_interval_and_the_smallest_shift_the_runs_could_detect():
    """Per checkpoint: the difference of the means, Welch's p and 95 % interval, and (t_0.975 + t_0.8) x the standard
    error as the shift two sets of this size and spread could detect; steps one set lacks, or with one run, skipped."""
    import math
    import val_steps
    from scipy import stats
    a, b = [2.40, 2.41, 2.39, 2.40], [2.42, 2.43, 2.41]
    new = {310: dict(mean=sum(a) / 4, n=4, losses=a), 100: dict(mean=3.2, n=1, losses=[3.2])}
    prior = {310: dict(mean=sum(b) / 3, n=3, losses=b), 100: dict(mean=3.1, n=2, losses=[3.1, 3.0])}
    out = val_steps.compare_sets(new, prior)
    assert list(out) == [310]
    row = out[310]
    se = math.sqrt(stats.tvar(a) / 4 + stats.tvar(b) / 3)
    df = se ** 4 / ((stats.tvar(a) / 4) ** 2 / 3 + (stats.tvar(b) / 3) ** 2 / 2)
    assert row["diff"] == pytest.approx(-0.02) and row["df"] == pytest.approx(df)
    assert row["p"] == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue)
    assert row["ci95"] == pytest.approx([-0.02 - stats.t.ppf(0.975, df) * se, -0.02 + stats.t.ppf(0.975, df) * se])
    assert row["detectable_shift"] == pytest.approx((stats.t.ppf(0.975, df) + stats.t.ppf(0.8, df)) * se)
    assert (row["n_new"], row["n_prior"]) == (4, 3)


def test_the_8_gpu_step_launches_the_records_normuon_groups_and_every_adam_collective_every_other_step():
    import nccl_bandwidth
    rows = nccl_bandwidth.step_collectives(8)
    normuon = {what.split(" (")[0]: nbytes for op, what, _, nbytes, per_step in rows
               if op == "reduce_scatter" and per_step == 1.0}
    # groups of 1, 10, 16 and 16 matrices, each padded to 8 x ceil(n / 8); the hidden matrices are fp32
    assert normuon["NorMuon attn+mlp"] == normuon["NorMuon mlp"] == 16 * 3072 * 768 * 4
    assert normuon["NorMuon attn_gate"] == 16 * 6 * 12 * 2
    adam = [(what, nbytes) for op, what, _, nbytes, per_step in rows if per_step == 0.5]
    # the 62 scalars travel as DistAdam pads them in its own buffers: 8 x ceil(62 / 8) = 64
    assert len(adam) == 2 * 6 and sum(n for _, n in adam) == 2 * (5 * 50304 * 768 * 2 + 64 * 4)


def test_the_8_gpu_model_adds_to_an_eighth_of_one_gpus_step_the_idle_time_and_the_exposed_communication(tmp_path):
    import json
    import predict_8gpu
    args = tg.Hyperparameters()
    names = [s.name for s in tg.stages(args)]
    timeline = dict(communication_busy_ms=4.0, communication_exposed_ms=1.0, idle_ms=0.5, compute_busy_ms=30.0)
    rank = dict(world_size=2, as_world_size=8, stages=[
        dict(name=n, median_ms=ms, host_ms=ms / 4, timeline=timeline) for n, ms in zip(names, (30, 50, 70, 70))])
    w1 = dict(world_size=1, as_world_size=1, stages=[dict(name=n, median_ms=ms) for n, ms in
                                                     zip(names, (200, 400, 600, 608))])
    files = {}
    for name, content in (("rank", rank), ("w1", w1), ("nccl", dict(for_world_size=8, per_step_ms_at_target=8.0))):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(content))
    argv = ["--rank-bench", str(files["rank"]), "--w1-bench", str(files["w1"]), "--nccl", str(files["nccl"])]
    assert predict_8gpu.main(argv + ["--out", str(tmp_path / "p.json")]) == 0
    p = json.loads((tmp_path / "p.json").read_text())
    # 200 / 8 + 0.5 idle + 8 ms of W=8 collectives x the quarter W=2 leaves exposed
    assert [r["predicted_ms"] for r in p["stages"]] == [27.5, 52.5, 77.5, 78.5]
    assert [r["record_ms"] for r in p["stages"]] == [33.0, 60.0, 87.5, 88.0]  # the upstream logs' medians
    assert p["steps_per_stage"] == {"stage 1": 707, "stage 2": 707, "stage 3": 706, "extension": 40}
    assert p["predicted_total_s"] == pytest.approx((707 * 27.5 + 707 * 52.5 + 706 * 77.5 + 40 * 78.5) / 1000)
    assert p["record_total_s"] == pytest.approx(131.156)
    # beside it, the rank's own steps: 30 / 50 / 70 / 70 ms
    assert p["rank_step_total_s"] == pytest.approx((707 * 30 + 707 * 50 + 706 * 70 + 40 * 70) / 1000)
    files["rank"].write_text(json.dumps(dict(rank, as_world_size=1)))
    assert predict_8gpu.main(argv) == 2


def test_the_rank_method_takes_the_slowest_emulated_rank_and_adds_the_exposed_w8_collectives(tmp_path):
    import json
    import predict_8gpu
    names = [s.name for s in tg.stages(tg.Hyperparameters())]
    files = {}

    def write(name, content):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(content))
        return str(files[name])

    for rank, ms in ((0, (24.2, 45.9, 68.4, 68.6)), (7, (23.4, 46.3, 65.3, 65.6))):
        write(f"rank{rank}", dict(world_size=1, as_world_size=8, as_rank=rank, device="H200", commit="abc1234",
                                  stages=[dict(name=n, median_ms=m) for n, m in zip(names, ms)]))
    timeline = dict(communication_busy_ms=4.0, communication_exposed_ms=1.0)
    write("exposure", dict(world_size=2, as_world_size=8, device="H200", commit="def5678",
                           stages=[dict(name=n, timeline=timeline) for n in names]))
    write("nccl", dict(for_world_size=8, per_step_ms_at_target=8.0))
    write("w1", dict(world_size=1, as_world_size=1, stages=[dict(name=n, median_ms=ms)
                                                            for n, ms in zip(names, (200, 400, 600, 608))]))
    argv = ["--rank-bench", str(files["rank0"]), str(files["rank7"]), "--exposure", str(files["exposure"]),
            "--nccl", str(files["nccl"]), "--w1-bench", str(files["w1"]), "--out", str(tmp_path / "p.json")]
    assert predict_8gpu.main(argv) == 0
    p = json.loads((tmp_path / "p.json").read_text())
    # per stage the slower rank (0, 7, 0, 0) + 8 ms of W=8 collectives x the quarter left exposed
    assert [r["slowest_rank"] for r in p["stages"]] == [0, 7, 0, 0]
    assert [r["predicted_ms"] for r in p["stages"]] == pytest.approx([26.2, 48.3, 70.4, 70.6])
    assert [r["one_gpu_step_over_8_ms"] for r in p["stages"]] == [25.0, 50.0, 75.0, 76.0]
    assert p["predicted_total_s"] == pytest.approx((707 * 26.2 + 707 * 48.3 + 706 * 70.4 + 40 * 70.6) / 1000)
    assert p["inputs"]["exposure"]["commit"] == "def5678" and [r["as_rank"] for r in p["inputs"]["ranks"]] == [0, 7]
    # emulated ranks need the exposure of a run on several GPUs
    assert predict_8gpu.main([a for a in argv if a not in ("--exposure", str(files["exposure"]))]) == 2
    # a rank run several times counts as the median of its runs
    write("rank7b", dict(json.loads(files["rank7"].read_text()), stages=[dict(name=n, median_ms=m) for n, m in
                                                                         zip(names, (23.0, 46.9, 65.1, 65.6))]))
    write("rank7c", dict(json.loads(files["rank7"].read_text()), stages=[dict(name=n, median_ms=m) for n, m in
                                                                         zip(names, (23.2, 46.5, 65.2, 65.6))]))
    assert predict_8gpu.main(["--rank-bench", str(files["rank0"]), str(files["rank7"]), str(files["rank7b"]),
                              str(files["rank7c"]), *argv[3:]]) == 0
    p = json.loads((tmp_path / "p.json").read_text())
    assert p["stages"][1]["rank_steps_ms"] == {"0": 45.9, "7": 46.5} and p["stages"][1]["slowest_rank"] == 7


def test_the_rank_method_takes_each_ranks_back_to_back_steps_when_every_input_has_them(tmp_path):
    """Back to back is how the trainer runs its steps (no synchronisation between them): the rank method uses it
    where every rank's JSON has it, and says so; one older input without it puts every rank on its median."""
    import json
    import predict_8gpu
    names = [s.name for s in tg.stages(tg.Hyperparameters())]
    files = []
    for rank, median, back in ((0, 70.0, 66.0), (7, 68.0, 67.0)):
        files.append(tmp_path / f"rank{rank}.json")
        files[-1].write_text(json.dumps(dict(world_size=1, as_world_size=8, as_rank=rank, device="H200", commit="a",
                                             stages=[dict(name=n, median_ms=median, back_to_back_ms=back)
                                                     for n in names])))
    (tmp_path / "exposure.json").write_text(json.dumps(dict(world_size=2, as_world_size=8, stages=[
        dict(name=n, timeline=dict(communication_busy_ms=4.0, communication_exposed_ms=1.0)) for n in names])))
    (tmp_path / "nccl.json").write_text(json.dumps(dict(for_world_size=8, per_step_ms_at_target=8.0)))
    tail = ["--exposure", str(tmp_path / "exposure.json"), "--nccl", str(tmp_path / "nccl.json"),
            "--out", str(tmp_path / "p.json")]
    assert predict_8gpu.main(["--rank-bench", *map(str, files), *tail]) == 0
    p = json.loads((tmp_path / "p.json").read_text())
    assert p["rank_step"].startswith("back_to_back_ms")
    assert [(r["slowest_rank"], r["predicted_ms"]) for r in p["stages"]] == [(7, 69.0)] * len(names)
    old = json.loads(files[1].read_text())
    for stage in old["stages"]:
        del stage["back_to_back_ms"]
    files[1].write_text(json.dumps(old))
    assert predict_8gpu.main(["--rank-bench", *map(str, files), *tail]) == 0
    p = json.loads((tmp_path / "p.json").read_text())
    assert p["rank_step"].startswith("median_ms")
    assert [(r["slowest_rank"], r["predicted_ms"]) for r in p["stages"]] == [(0, 72.0)] * len(names)


def test_the_kernel_benchmarks_refuse_a_machine_without_cuda_in_one_line(capsys):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench" / "kernels"))
    import ce_kernel_bench
    import ce_routes_bench
    for script in (ce_kernel_bench, ce_routes_bench):
        assert script.main(["--out", "unused.json"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error:") and "needs a CUDA GPU" in err[0]


def test_a_range_marked_on_the_gpu_is_not_counted_as_a_kernel():
    """An optimizer's step shows on the GPU as a range from its first kernel to its last, beside the kernels."""
    from types import SimpleNamespace as NS
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, start, end, device=cuda, annotation=False):
        return NS(name=name, device_type=device, time_range=NS(start=start, end=end), is_user_annotation=annotation)
    prof = NS(events=lambda: [event("Optimizer.step#NorMuon.step", 0, 4000, annotation=True),
                              event("kernel_a", 0, 1000), event("kernel_b", 3000, 4000),
                              event("aten::mm", 0, 500, device=cpu), event("empty", 10, 10)])
    assert bench.profile_kernels(prof) == [("kernel_a", 0.0, 1.0), ("kernel_b", 3.0, 4.0)]


def test_back_to_back_timing_synchronises_once_after_the_last_step(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    assert bench.back_to_back_ms(lambda: events.append("step"), 4) >= 0
    assert events == ["sync", "step", "step", "step", "step", "sync"]


def test_the_orthogonalizers_flops_count_its_three_products_per_iteration_in_the_wide_orientation():
    # per iteration X Xᵀ and B·X (2 m² k each) and A·A (2 m³), m the short side
    assert bench.polar_flops(1, 768, 768, 5) == 5 * 6 * 768 ** 3
    assert bench.polar_flops(2, 3072, 768, 5) == bench.polar_flops(2, 768, 3072, 5) == 2 * 5 * (4 * 768 ** 2 * 3072
                                                                                                + 2 * 768 ** 3)
    assert bench.polar_flops(10, 6, 12, 4) == 10 * 4 * (4 * 36 * 12 + 2 * 216)
