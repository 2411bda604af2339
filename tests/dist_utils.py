"""Run a function on W CPU processes joined in a gloo process group and collect each rank's return value.

    results = run_gloo(fn, world_size, *args)   # fn(rank, world_size, *args) -> anything torch.save can store

`fn` must be a module-level function of an importable module (with "spawn", children unpickle it by name).

    runtime = runtime_for(args, **env)          # train_gpt.resolve_runtime with exactly these launcher variables
"""
import contextlib
import os
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@contextlib.contextmanager
def launcher_env(**env):
    """os.environ holding exactly these of torchrun's variables (none: a process started without torchrun), where
    train_gpt reads them; the environment as it was afterwards."""
    saved = {k: os.environ.get(k) for k in LAUNCHER_ENV}
    try:
        for k in LAUNCHER_ENV:
            os.environ.pop(k, None)
        os.environ.update({k: str(v) for k, v in env.items()})
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def runtime_for(args, **env):
    """train_gpt.resolve_runtime(args) in a process with these launcher variables (none: one process)."""
    import train_gpt as tg
    with launcher_env(**env):
        return tg.resolve_runtime(args)


# fork: children inherit the already-imported torch/train_gpt (seconds instead of ~5 s per child on 2 cores).
START_METHOD = "fork" if "fork" in mp.get_all_start_methods() else "spawn"


def _worker(rank, fn, world_size, init_file, out_dir, args):
    torch.set_num_threads(1)  # W processes share few cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        try:
            result = fn(rank, world_size, *args)
        except BaseException:  # ship the traceback to the parent instead of a bare "process exited"
            torch.save({"__error__": traceback.format_exc()}, Path(out_dir) / f"rank{rank}.pt")
            raise
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_gloo(fn, world_size: int, *args):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        try:
            mp.start_processes(_worker, args=(fn, world_size, init_file, tmp, args), nprocs=world_size,
                               join=True, start_method=START_METHOD)
        except Exception as e:
            errors = []
            for r in range(world_size):
                f = Path(tmp) / f"rank{r}.pt"
                if f.exists():
                    res = torch.load(f, weights_only=False)
                    if isinstance(res, dict) and "__error__" in res:
                        errors.append(f"rank {r}:\n{res['__error__']}")
            raise RuntimeError("distributed worker failed\n" + "\n".join(errors)) from e
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
