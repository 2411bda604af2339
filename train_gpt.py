"""speedrun: train a GPT-2 (124M-class) language model to 3.28 val loss on FineWeb, fast.

One file, read top to bottom:
    1. config       Hyperparameters (the SPEC's values as defaults) and the command line
    2. kernels      Triton kernels, Polar Express / Turbo-Muon orthogonalizers, the FP8 lm_head op
    3. optimizers   NorMuon (sharded, reduce-scatter -> update -> all-gather) and DistAdam
    4. model        GPT with value embeddings, smear gate, sparse attention gates, YaRN rotary
    5. data         shard reader, BOS-aligned batching, async shard preloading
    6. schedules    batch size, learning rate, attention windows, Muon momentum
    7. train loop   untimed kernel warm-up, timed training, validation, logging
    8. main()

Launch:  torchrun --standalone --nproc_per_node=8 train_gpt.py   (1, 2, 4 or 8 GPUs; same global batch)
CPU:     torchrun --standalone --nproc_per_node=2 train_gpt.py --smoke --data-path data/proxy
Importing this module has no side effects: no CUDA, no process group, no file reads.
"""
import os

# Must be set before torch initialises CUDA: fewer fragmentation stalls when batch sizes change.
os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")

import argparse
import copy
import dataclasses
import gc
import glob
import math
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

try:  # Triton is optional: without it (or without a GPU) every kernel has a PyTorch fallback.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on machines without triton
    triton = None
    tl = None


# =====================================================================================
# 1. Config
# =====================================================================================

@dataclass
class Hyperparameters:
    # data (file patterns are relative to data_path)
    data_path: str = "data/fineweb10B"
    train_files: str = "fineweb_train_*.bin"
    val_files: str = "fineweb_val_*.bin"
    train_epochs: int = 1                 # >1 lets the loader cycle over a small (proxy) train set
    val_tokens: int = 10_485_760          # the metric: the first 10*2^20 tokens of the val shard
    val_batch_size: int = 4 * 64 * 1024 * 8
    train_max_seq_len: int = 2048         # documents longer than this are truncated
    # schedule
    num_scheduled_iterations: int = 2120
    num_extension_iterations: int = 40
    cooldown_frac: float = 0.55
    train_bs_schedule: tuple = (8 * 2048 * 8, 16 * 2048 * 8, 24 * 2048 * 8)
    train_bs_extension: int = 24 * 2048 * 8
    lr_plateaus: tuple = (1.0, 1.51, 1.93)  # ~ (bs / 131072) ** 0.6 for the three batch stages
    lr_floor: float = 0.1
    ws_schedule: tuple = (3, 7, 11)       # long attention window per stage, in blocks of block_size
    ws_final: int = 13                    # long window for the extension steps
    ws_validate_post_yarn_ext: int = 20   # long window for the final validation (no YaRN update)
    block_size: int = 128
    muon_momentum_warmup: tuple = (0.85, 0.95, 300)    # start, end, steps
    muon_momentum_cooldown: tuple = (0.95, 0.1, 50)    # start value, total drop, steps before the end
    warmup_steps_per_stage: int = 10      # untimed kernel warm-up steps per window stage
    # model
    vocab_size: int = 50257
    num_layers: int = 12
    model_dim: int = 768
    num_heads: int = 6
    head_dim: int = 128
    # optimizers
    adam_lr: float = 0.008
    adam_betas: tuple = (0.65, 0.95)
    adam_eps: float = 1e-8
    muon_lr: float = 0.023
    muon_weight_decay: float = 1.2
    muon_beta2: float = 0.95
    orthogonalizer: str = "polar"         # polar | turbo
    # run
    val_loss_every: int = 250             # 0: only at the end
    save_checkpoint: bool = False
    run_id: str = ""                      # default: a random UUID4
    seed: int = -1                        # -1: no seeding, like the record (rank 0's init is broadcast)
    device: str = "auto"                  # auto | cuda | cpu
    attn_backend: str = "auto"            # auto | fa3 | varlen | reference
    compile: str = "auto"                 # auto (on for CUDA) | on | off
    log_dir: str = "logs"
    smoke: bool = False                   # tiny preset for CPUs and tests (see SMOKE_PRESET)

    @property
    def num_iterations(self) -> int:
        return self.num_scheduled_iterations + self.num_extension_iterations


# `--smoke`: small enough for 2 CPU cores in about a minute, same code paths as the record.
SMOKE_PRESET = dict(
    model_dim=128, num_heads=2, head_dim=64,
    train_bs_schedule=(2048 * 2, 2048 * 4, 2048 * 6), train_bs_extension=2048 * 6,
    train_max_seq_len=256, val_batch_size=8192, val_tokens=16384,
    num_scheduled_iterations=30, num_extension_iterations=3, val_loss_every=10,
    warmup_steps_per_stage=2,
)


def _parse_value(kind, text):
    if kind is bool:
        low = text.lower()
        if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")
        return low in ("1", "true", "yes", "on")
    return kind(text)


def parse_args(argv=None) -> Hyperparameters:
    """Every Hyperparameters field becomes --kebab-case; tuples take comma-separated values."""
    defaults = Hyperparameters()
    parser = argparse.ArgumentParser(
        description="NanoGPT speedrun trainer. Defaults are the December 2025 record's settings.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Hyperparameters):
        value = getattr(defaults, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            parser.add_argument(flag, nargs="?", const=True, default=None,
                                type=lambda s: _parse_value(bool, s), help=f"(default {value})")
        elif isinstance(value, tuple):
            kind = type(value[0])
            parser.add_argument(flag, default=None, metavar="A,B,...", help=f"(default {','.join(map(str, value))})",
                                type=lambda s, k=kind: tuple(_parse_value(k, x) for x in s.split(",")))
        else:
            parser.add_argument(flag, type=type(value), default=None, help=f"(default {value!r})")
    given = {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}
    args = Hyperparameters(**(SMOKE_PRESET if given.get("smoke") else {}))
    args = dataclasses.replace(args, **given)  # explicit flags win over the smoke preset
    validate_args(args)
    return args


class ConfigError(ValueError):
    """Bad user input: reported as one line on rank 0, never a traceback."""


def validate_args(args: Hyperparameters):
    def need(cond, msg):
        if not cond:
            raise ConfigError(msg)
    need(args.orthogonalizer in ("polar", "turbo"), f"--orthogonalizer must be polar or turbo, got {args.orthogonalizer!r}")
    need(args.attn_backend in ("auto", "fa3", "varlen", "reference"),
         f"--attn-backend must be auto, fa3, varlen or reference, got {args.attn_backend!r}")
    need(args.device in ("auto", "cuda", "cpu"), f"--device must be auto, cuda or cpu, got {args.device!r}")
    need(args.compile in ("auto", "on", "off"), f"--compile must be auto, on or off, got {args.compile!r}")
    need(args.model_dim == args.num_heads * args.head_dim,
         f"--model-dim ({args.model_dim}) must equal --num-heads x --head-dim ({args.num_heads}x{args.head_dim})")
    need(args.head_dim % 4 == 0, "--head-dim must be a multiple of 4 (half-truncated rotary)")
    need(args.num_layers == 12, "the layer map (skips, value embeddings, backout) is defined for --num-layers 12 only")
    need(len(args.train_bs_schedule) == len(args.ws_schedule) == len(args.lr_plateaus),
         "--train-bs-schedule, --ws-schedule and --lr-plateaus need one entry per stage")
    need(args.num_scheduled_iterations > 0 and args.num_extension_iterations >= 0, "iteration counts must be positive")
    need(args.train_epochs >= 1, "--train-epochs must be >= 1")
    need(args.val_batch_size > 0 and args.val_tokens % args.val_batch_size == 0,
         f"--val-tokens ({args.val_tokens}) must be a multiple of --val-batch-size ({args.val_batch_size})")
    need(args.val_loss_every >= 0, "--val-loss-every must be >= 0")


# =====================================================================================
# 2. Kernels  (TEMPORARY include while the section is developed in parts/; inlined before release)
# =====================================================================================
_PARTS = Path(__file__).resolve().parent / "parts"
exec(compile((_PARTS / "orthogonalizer.py").read_text(), str(_PARTS / "orthogonalizer.py"), "exec"))

# =====================================================================================
# 3. Optimizers  (TEMPORARY include, see above)
# =====================================================================================
exec(compile((_PARTS / "optimizers.py").read_text(), str(_PARTS / "optimizers.py"), "exec"))


# =====================================================================================
# 5. Data (placed here early only in reading order of the docs; see section 5 below)
# =====================================================================================

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
BOS_ID = 50256  # <|endoftext|>, written before every document


class ShardError(ValueError):
    """A data shard is missing, truncated or not in the speedrun format."""


def read_shard_header(path) -> int:
    """Check a shard's header and size; return its token count."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            header = np.frombuffer(f.read(HEADER_INTS * 4), dtype="<i4")
    except OSError as e:
        raise ShardError(f"cannot read shard {path}: {e.strerror}") from None
    if header.size != HEADER_INTS:
        raise ShardError(f"shard {path} is shorter than its 1024-byte header ({size} bytes): re-download or rebuild it")
    if header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION:
        raise ShardError(f"shard {path} has magic {header[0]} version {header[1]}, expected {SHARD_MAGIC} "
                         f"version {SHARD_VERSION}: not a speedrun token shard")
    num_tokens = int(header[2])
    expected = HEADER_INTS * 4 + 2 * num_tokens
    if size != expected:
        raise ShardError(f"shard {path} is {size} bytes but its header promises {num_tokens} tokens "
                         f"({expected} bytes): truncated or corrupt, re-download or rebuild it")
    return num_tokens


def load_data_shard(path, pin_memory: bool = False) -> Tensor:
    """Read a shard's tokens straight into a (optionally pinned) uint16 tensor, no intermediate bytes."""
    num_tokens = read_shard_header(path)
    tokens = torch.empty(num_tokens, dtype=torch.uint16, pin_memory=pin_memory)
    with open(path, "rb", buffering=0) as f:
        f.seek(HEADER_INTS * 4)
        nbytes = f.readinto(tokens.numpy())
    if nbytes != 2 * num_tokens:
        raise ShardError(f"shard {path}: read {nbytes} bytes, expected {2 * num_tokens}")
    return tokens
