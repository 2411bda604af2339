"""torchrun entry point for the fault tests: train_gpt.main() with one rank made to fail at a given step.

FAULT_RANK, FAULT_STEP and FAULT_KIND (raise | kill) come from the environment; every other rank runs
the unmodified trainer and must not hang.
"""
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_gpt as tg  # noqa: E402

rank, fault_rank = int(os.environ["RANK"]), int(os.environ["FAULT_RANK"])
fault_step, kind = int(os.environ["FAULT_STEP"]), os.environ["FAULT_KIND"]

if rank == fault_rank:
    real_train_step = tg.Trainer.train_step
    calls = {"n": 0}

    def failing_train_step(self, step, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] > self.args.warmup_steps_per_stage * 4 and step == fault_step:  # a timed step, not warm-up
            print(f"fault injected: rank {rank} {kind} at step {step}, unix time {time.time():.3f}", flush=True)
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise tg.ShardError(f"simulated corrupt shard seen by rank {rank} at step {step}")
        return real_train_step(self, step, *args, **kwargs)

    tg.Trainer.train_step = failing_train_step

sys.exit(tg.main())
