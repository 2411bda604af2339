"""torchrun entry point for the fault tests: train_gpt.main() with one rank made to fail at a given step.

FAULT_RANK, FAULT_STEP and FAULT_KIND (raise: a data error | bug: any other exception | kill) come from the
environment; every other rank runs the unmodified trainer and must not hang.
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
    real_train_step, real_warm_up = tg.Trainer.train_step, tg.Trainer.warm_up_kernels
    armed = {"after_warm_up": False}

    def warm_up_then_arm(self, *args, **kwargs):
        result = real_warm_up(self, *args, **kwargs)
        armed["after_warm_up"] = True
        return result

    def failing_train_step(self, step, *args, **kwargs):
        if armed["after_warm_up"] and step == fault_step:  # a timed step, not warm-up
            print(f"fault injected: rank {rank} {kind} at step {step}, unix time {time.time():.3f}", flush=True)
            if kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if kind == "bug":
                raise RuntimeError(f"simulated bug in rank {rank} at step {step}")
            raise tg.ShardError(f"simulated corrupt shard seen by rank {rank} at step {step}")
        return real_train_step(self, step, *args, **kwargs)

    tg.Trainer.train_step, tg.Trainer.warm_up_kernels = failing_train_step, warm_up_then_arm

sys.exit(tg.main())
