"""bench/loss/proxy_runs.sh and bench/multi_gpu/kill_test.sh on the CPU, with a stand-in `python3` first on PATH that
records its argv and environment and writes the log a training run would leave."""
import json
import os
import sys
from pathlib import Path

import pytest

from processes import run_group

REPO = Path(__file__).resolve().parents[1]
PROXY_RUNS = REPO / "bench" / "loss" / "proxy_runs.sh"
KILL_TEST = REPO / "bench" / "multi_gpu" / "kill_test.sh"

# The stand-in: one JSON line per call (argv, NCCL variables, FAULT_*), then the trainer's log at
# <--log-dir>/<--run-id>.txt with one validation line. Seeds listed in STUB_FAIL_SEEDS exit 3; with FAULT_KIND set it
# prints the fault launcher's line (and exits 1, as torchrun does when a rank dies).
STUB = f"""#!{sys.executable}
import json, os, sys, time
argv = sys.argv[1:]
env = {{k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                                      "PYTHONUNBUFFERED", "FAULT_RANK", "FAULT_STEP", "FAULT_KIND")}}
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps(dict(argv=argv, env=env)) + "\\n")
opt = {{argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}}
if "--log-dir" in opt:
    with open(os.path.join(opt["--log-dir"], opt["--run-id"] + ".txt"), "w") as f:
        f.write("step:96/96 val_loss:3.1234 train_time:45000ms step_avg:468.75ms\\n")
print("stand-in trainer ran")
if os.environ.get("FAULT_KIND"):
    print(f"fault injected: rank 1 kill at step 5, unix time {{time.time() - 0.5:.3f}}", flush=True)
    sys.exit(1)
sys.exit(3 if opt.get("--seed") in os.environ.get("STUB_FAIL_SEEDS", "").split() else 0)
"""


@pytest.fixture
def stub(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(STUB)
    (bin_dir / "python3").chmod(0o755)
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "fineweb_train_000001.bin").write_bytes(b"")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", STUB_LOG=str(tmp_path / "calls.jsonl"))
    env.pop("PYTHON", None)

    def run(script, *args, **extra_env):
        p = run_group(["bash", str(script), *args], cwd=tmp_path, env=dict(env, **extra_env),
                           capture_output=True, text=True, timeout=60)
        log = tmp_path / "calls.jsonl"
        calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
        return p, calls
    run.tmp, run.shards = tmp_path, shards
    return run


def schedule(data, seed, run_id, log_dir):
    return ["--data-path", str(data), "--num-scheduled-iterations", "90", "--num-extension-iterations", "6",
            "--val-loss-every", "30", "--val-batch-size", "524288", "--val-tokens", "1572864", "--seed", str(seed),
            "--run-id", run_id, "--log-dir", str(log_dir)]


def test_one_torchrun_per_seed_with_the_proxy_schedule_and_extra_flags(stub):
    out = stub.tmp / "out"
    p, calls = stub(PROXY_RUNS, "--seeds", "3 7", "--nproc", "2", "--label", "ab", "--out", str(out),
                    "--data", str(stub.shards), "--", "--attn-backend", "varlen", "--fused-fp8-head", "false")
    assert p.returncode == 0, p.stderr
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train_gpt.py"]
    assert [c["argv"] for c in calls] == [
        launcher + schedule(stub.shards, s, f"ab_seed{s}", out / "ab") + ["--attn-backend", "varlen",
                                                                          "--fused-fp8-head", "false"]
        for s in (3, 7)]
    for c in calls:  # NVLink multicast stays off for NCCL and symmetric memory
        assert c["env"] == dict(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
                                PYTHONUNBUFFERED="1", FAULT_RANK=None, FAULT_STEP=None, FAULT_KIND=None)
    for s in (3, 7):
        assert (out / "ab" / f"console_seed{s}.txt").read_text() == "stand-in trainer ran\n"
        assert f"ab seed {s}: exit 0 after " in p.stdout
    assert p.stdout.count("val_loss:3.1234") == 2


def test_defaults_and_another_script_for_an_ab(stub):
    old = stub.tmp / "train_gpt_upstream.py"
    old.write_text("# the other trainer\n")
    p, calls = stub(PROXY_RUNS, "--script", str(old), "--out", str(stub.tmp / "o"), "--data", str(stub.shards))
    assert p.returncode == 0, p.stderr
    assert [c["argv"][:5] for c in calls] == [["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                                               str(old)]] * 3
    assert [c["argv"][5:] for c in calls] == [schedule(stub.shards, s, f"run_seed{s}", stub.tmp / "o" / "run")
                                              for s in (1, 2, 3)]


def test_a_failed_seed_does_not_stop_the_others_but_fails_the_call(stub):
    p, calls = stub(PROXY_RUNS, "--seeds", "1 2 3", "--out", str(stub.tmp / "o"), "--data", str(stub.shards),
                    STUB_FAIL_SEEDS="2")
    assert p.returncode == 1
    assert len(calls) == 3
    assert "run seed 2: exit 3 after" in p.stdout and "run seed 3: exit 0 after" in p.stdout


def test_no_run_starts_without_min_left_seconds_before_the_deadline(stub):
    p, calls = stub(PROXY_RUNS, "--seeds", "1 2", "--budget", "30", "--min-left", "100", "--out", str(stub.tmp / "o"),
                    "--data", str(stub.shards))
    assert p.returncode == 1 and calls == []
    assert "run: seed 1 and later not started" in p.stdout


def test_a_run_under_a_deadline_is_cut_by_timeout(stub):
    p, calls = stub(PROXY_RUNS, "--seeds", "5", "--budget", "300", "--min-left", "10", "--out", str(stub.tmp / "o"),
                    "--data", str(stub.shards))
    assert p.returncode == 0, p.stderr
    assert [c["argv"][-1] for c in calls] == [str(stub.tmp / "o" / "run")]


@pytest.mark.parametrize("args, message", [
    (["--seeds", "1 x"], "'x' is not a whole number"),
    (["--nproc", "2", "--bogus"], "unknown option --bogus"),
    (["--script", "no_such_trainer.py"], "no script no_such_trainer.py"),
    (["--data", "/nonexistent/shards"], "no shards in /nonexistent/shards"),
])
def test_bad_arguments_fail_before_any_run(stub, args, message):
    p, calls = stub(PROXY_RUNS, "--out", str(stub.tmp / "o"), *args)
    assert p.returncode == 2 and calls == []
    assert message in p.stderr


def test_help_prints_the_usage(stub):
    p, calls = stub(PROXY_RUNS, "--help")
    assert p.returncode == 0 and calls == []
    assert p.stdout.startswith("The 90+6-step proxy schedule") and "--deadline EPOCH" in p.stdout


def test_kill_test_runs_the_fault_launcher_on_two_ranks_and_writes_its_json(stub):
    out = stub.tmp / "k"
    p, calls = stub(KILL_TEST, OUT=str(out), DATA=str(stub.shards), FAULT_STEP="7")
    assert p.returncode == 0, p.stderr
    assert [c["argv"][:5] for c in calls] == [["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                               "tests/fault_launcher.py"]]
    assert calls[0]["argv"][5:] == schedule(stub.shards, 1, "kill_seed1", out / "kill")
    assert {k: calls[0]["env"][k] for k in ("FAULT_RANK", "FAULT_STEP", "FAULT_KIND")} == \
        dict(FAULT_RANK="1", FAULT_STEP="7", FAULT_KIND="kill")
    result = json.loads((out / "kill" / "kill_test.json").read_text())
    assert result["fault"] == dict(rank=1, step=7, kind="kill") and result["nproc"] == 2
    assert result["job_exit_status"] == 1
    assert 0.4 < result["seconds_from_fault_to_job_end"] < 30
    assert "job exit 1; ended" in p.stdout
