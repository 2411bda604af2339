"""speedrun: train a GPT-2 (124M-class) language model to 3.28 val loss on FineWeb, fast.

One file, read top to bottom: the part a speedrunner edits first, then the engine room.
    settings        Hyperparameters (the December 2025 record's values as defaults), one flag each
    model           the plain functions (attention, mlp, softcap, the FP8 lm_head), the layer map, the modules, GPT
    optimizers      Polar Express and Turbo-Muon, NorMuon (sharded Muon with row normalisation), DistAdam (ZeRO-1),
                    and the labels that put each parameter in its group
    data            shard reader, BOS-aligned batching, async shard preloading
    schedules       the stage table (batch size, windows), learning rate, Muon momentum
    training        the step, the timed loop, validation
    engine room     each fused kernel beside the fingerprint of the plain code it computes (FlashAttention-4, quack
                    GEMMs, the FP8 head's cross-entropy, the orthogonalizers' Triton kernels); the runtime, CUDA
                    graphs and diagnostics; the log, checkpoints, locks and how a run ends; the compile cache
    main()          settings -> runtime -> trainer -> run

Launch:  torchrun --standalone --nproc_per_node=8 train_gpt.py   (1, 2, 4 or 8 GPUs; same global batch), or
         ./run.sh launch 8 [FLAGS], which reports a failure in one line without torchrun's own report
CPU:     ./run.sh launch 2 --smoke --data-path data/proxy
Importing this module has no side effects: no CUDA, no process group, no file reads.

Credits. The speedrun is Keller Jordan's modded-nanogpt, grown from Andrej Karpathy's nanoGPT and llm.c; this file
re-implements its December 2025 record (NorMuon speed-ups and fixes, Wo pre-multiply) and its contributors' ideas,
credited where they are used below. Muon: Keller Jordan. Polar Express: Noah Amsel, David Persson, Christopher
Musco, Robert Gower; its symmetric Triton kernels: Byron Xu. Turbo-Muon: Thibaut Boissin et al., with AOL
preconditioning from Bernd Prach and Christoph Lampert. NorMuon: Zichong Li et al. Cautious weight decay: Lizhang
Chen et al. YaRN: Bowen Peng et al. FlashAttention: Tri Dao et al. FineWeb: Guilherme Penedo et al.
"""
import os
import signal
import sys

# A process's first lines. Importing torch takes seconds: from here on, a stop signal ends the process with one line
# (not a KeyboardInterrupt traceback from inside an import), and a worker started by torchrun dies with its launcher
# (torchrun gives each worker a session of its own, so a launcher killed with SIGKILL would leave them training on).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
LAUNCHER_DIED = signal.SIGUSR2              # the parent-death signal: one of its own, so that the log can say why
LAUNCHER_PID_ENV = "SPEEDRUN_LAUNCHER_PID"  # set by ./run.sh launch: the process that starts the workers
STARTED_BY = os.getppid()

def env_rank() -> int:
    """This process's RANK, where the launcher's variables describe a process of a run (else 0: it speaks for itself,
    and resolve_runtime refuses the variables in one line)."""
    try:
        world, rank, local = (int(os.environ.get(k, d)) for k, d in (("WORLD_SIZE", "1"), ("RANK", "0"),
                                                                      ("LOCAL_RANK", "0")))
    except ValueError:
        return 0
    started_by_torchrun = world == 1 or bool(os.environ.get("MASTER_ADDR"))
    return rank if 0 <= local <= rank < world and started_by_torchrun else 0

def launcher_gone() -> bool:
    """Whether the process that started this worker has died: exactly under ./run.sh launch, which names itself;
    under torchrun alone, a parent of pid 1 that is not torchrun (as a container's first process) means it did."""
    expected = os.environ.get(LAUNCHER_PID_ENV)
    if expected:
        return expected != str(os.getppid())
    if os.getppid() != 1:
        return False
    try:
        return b"torch" not in open("/proc/1/cmdline", "rb").read()
    except OSError:
        return False

def stray(signum) -> bool:
    """A LAUNCHER_DIED that did not come from the launcher's death (sent by hand)."""
    return signum == LAUNCHER_DIED and not launcher_gone() and os.getppid() == STARTED_BY

def exit_while_starting(signum, frame):
    if stray(signum):
        return
    if env_rank() == 0:
        said = "stopped while starting: the launcher died" if signum == LAUNCHER_DIED else \
            f"interrupted by {signal.Signals(signum).name} while starting"
        print(said, flush=True)  # on stdout, as the log's last line is echoed: errors alone go to stderr
    os._exit(128 + signum)

def die_with_the_launcher() -> None:
    """Under torchrun on Linux: the launcher's death sends LAUNCHER_DIED (PR_SET_PDEATHSIG), and a launcher that died
    before that line is caught by the check after it."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    import ctypes
    ctypes.CDLL(None).prctl(1, int(LAUNCHER_DIED))  # 1: PR_SET_PDEATHSIG
    if launcher_gone():
        os.kill(os.getpid(), LAUNCHER_DIED)

if __name__ == "__main__":
    for s in (*STOP_SIGNALS, LAUNCHER_DIED):
        signal.signal(s, exit_while_starting)
    die_with_the_launcher()

# Must be set before torch initialises CUDA: fewer fragmentation stalls when batch sizes change.
os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")

import argparse
import ast
import collections
import concurrent.futures
import contextlib
import copy
import ctypes
import dataclasses
import errno
import fcntl
import functools
import gc
import getpass
import glob
import hashlib
import inspect
import json
import math
import re
import shutil
import stat
import subprocess
import sysconfig
import tempfile
import time
import traceback
import typing
import uuid
import warnings
import zipfile
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
    triton = tl = None

def _kernels_usable(t: Tensor) -> bool:
    """Triton kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests)."""
    return triton is not None and (t.is_cuda or _TRITON_INTERPRET)


# =====================================================================================
# Settings: every one a Hyperparameters field and a flag
# =====================================================================================

def setting(default, help, within: str = None, choices: tuple = None, length: int = None, metavar: str = None):
    """A Hyperparameters field: its --help (a function where it quotes tables further down) and what is valid:
    numbers (each value of a tuple) in the interval `within`, one of `choices`, `length` values."""
    return field(default=default, metadata=dict(help=help, choices=choices, within=within, length=length,
                                                metavar=metavar))

COUNT, NONNEGATIVE, BELOW_ONE = "[1, inf)", "[0, inf)", "[0, 1)"   # the intervals most settings live in
INT_LIMIT = 2**31 - 1  # the largest count or size a setting takes: token counts and windows are 32-bit on the device
SEED_LIMIT = 2**64 - 1  # torch.manual_seed's largest seed

@dataclass
class Hyperparameters:
    # data (file patterns are relative to data_path)
    data_path: str = setting("data/fineweb10B", "folder holding the token shards")
    train_files: str = setting("fineweb_train_*.bin", "glob of the training shards in --data-path")
    val_files: str = setting("fineweb_val_*.bin", "glob of the validation shards in --data-path")
    train_epochs: int = setting(1, "passes over the training shards (>1: a small set lasts)", COUNT)
    val_tokens: int = setting(10_485_760, "validation tokens (the metric's: the first 10*2^20)", COUNT)
    val_batch_size: int = setting(4 * 64 * 1024 * 8, "global tokens per validation step", COUNT)
    train_max_seq_len: int = setting(2048, "longest training document, in tokens (cut after)", COUNT)
    # schedule
    num_scheduled_iterations: int = setting(2120, "scheduled steps (batch stages, lr cool-down)", COUNT)
    num_extension_iterations: int = setting(40, "extra steps at the floor lr and final window", NONNEGATIVE)
    cooldown_frac: float = setting(0.55, "share of the scheduled steps cooling the lr to --lr-floor", "(0, 1]")
    train_bs_schedule: tuple = setting((8 * 2048 * 8, 16 * 2048 * 8, 24 * 2048 * 8),
                                       "global tokens per step, per stage (equal thirds)", COUNT)
    train_bs_extension: int = setting(24 * 2048 * 8, "global tokens per step in the extension", COUNT)
    lr_plateaus: tuple = setting((1.0, 1.51, 1.93), "lr multiplier per stage, ~(batch/131072)^0.6", NONNEGATIVE)
    lr_plateau_starts: tuple = setting((0.0, 0.33, 0.66), "where each plateau starts, as a share of the steps",
                                       BELOW_ONE)
    lr_floor: float = setting(0.1, "lr multiplier after the cool-down", NONNEGATIVE)
    ws_schedule: tuple = setting((3, 7, 11), "long attention window per stage, in blocks (short: half)", COUNT)
    ws_final: int = setting(13, "long window of the extension steps, in blocks", COUNT)
    ws_validate_post_yarn_ext: int = setting(20, "long window of the final validation (no YaRN)", COUNT)
    block_size: int = setting(128, "tokens per attention-window block", COUNT)
    muon_momentum_warmup: tuple = setting((0.85, 0.95, 300), "NorMuon momentum START,END over the first STEPS",
                                          NONNEGATIVE, length=3)
    muon_momentum_cooldown: tuple = setting((0.95, 0.85, 50), "the same over the last STEPS (warm-up wins)",
                                            NONNEGATIVE, length=3)
    warmup_steps_per_stage: int = setting(10, "untimed warm-up steps per stage", "[2, inf)")
    # model
    vocab_size: int = setting(50257, "vocabulary (padded to a multiple of 128; uint16 shards)", "[50257, 65536]")
    num_layers: int = setting(12, "transformer blocks (9+; layer_map() says which has what)", COUNT)
    model_dim: int = setting(768, "width of the residual stream", "[12, inf)")
    num_heads: int = setting(6, "attention heads", COUNT)
    head_dim: int = setting(128, "width of each attention head", "[4, inf)")
    # optimizers
    adam_lr: float = setting(0.008, "DistAdam lr (embeddings x75, scalars x5, lm_head x1)", NONNEGATIVE)
    adam_betas: tuple = setting((0.65, 0.95), "DistAdam BETA1,BETA2", BELOW_ONE, length=2)
    adam_eps: float = setting(1e-8, "DistAdam epsilon", "(0, inf)")
    muon_lr: float = setting(0.023, "NorMuon lr for the hidden matrices and gates", NONNEGATIVE)
    muon_weight_decay: float = setting(1.2, "NorMuon cautious weight decay (x the lr)", NONNEGATIVE)
    muon_beta2: float = setting(0.95, "NorMuon second-moment decay", BELOW_ONE)
    orthogonalizer: str = setting("polar", lambda: f"Polar Express ({len(POLAR_EXPRESS_COEFFS)} steps) or Turbo-Muon "
                                  f"({len(TURBO_MUON_COEFFS)}), for NorMuon", choices=("polar", "turbo"))
    # run
    val_loss_every: int = setting(250, "validate every N steps; 0: only at the end", NONNEGATIVE)
    save_checkpoint: bool = setting(False, "save model and optimizer states at the end")
    run_id: str = setting("", "the log's name: <log-dir>/<run-id>.txt; empty: a UUID4")
    replace_log: bool = setting(False, "replace an earlier log (and checkpoint) of --run-id")
    seed: int = setting(-1, "initialisation seed; -1: unseeded, like the record", "[-1, inf)")
    device: str = setting("auto", "auto: CUDA if visible, else the CPU for --smoke", choices=("auto", "cuda", "cpu"))
    kernels: str = setting("fused", lambda: "LIST of " + ", ".join(FUSED_KERNELS), metavar="fused|plain|LIST")
    compile: str = setting("auto", "torch.compile; auto: on for CUDA", choices=("auto", "on", "off"))
    fp8: str = setting("auto", "FP8 lm_head in training; auto: on for CUDA", choices=("auto", "on", "off"))
    cuda_graphs: str = setting("auto", "auto, on, off, or check: each stage's first step against eager",
                               choices=("auto", "on", "off", "check"), metavar="MODE")
    compile_cache: str = setting("", "compiled-kernel bundle (.zip): loaded if it fits, else written")
    log_dir: str = setting("logs", "folder for <run-id>.txt")
    fail_on_recompile: bool = setting(True, "stop if anything compiles in the timed loop")
    smoke: bool = setting(False, "tiny preset for CPUs and tests (flags still win)")
    check: bool = setting(False, "validate settings, outputs and data; exit")
    check_flags: bool = setting(False, "validate the settings only; exit")

    @property
    def num_iterations(self) -> int:
        return self.num_scheduled_iterations + self.num_extension_iterations

# `--smoke`: small enough for 2 CPU processes on 2 cores in a few minutes (the lm_head and the softcapped
# cross-entropy over 50,304 classes dominate there), same code paths as the record.
SMOKE_PRESET = dict(model_dim=128, num_heads=2, head_dim=64, train_bs_schedule=(512, 1024, 1536),
                    train_bs_extension=1536, train_max_seq_len=256, val_batch_size=4096, val_tokens=4096,
                    num_scheduled_iterations=30, num_extension_iterations=3, val_loss_every=10,
                    warmup_steps_per_stage=2)

BOOL_WORDS = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}

def value_parser(kind: type, tuple_of: bool = False):
    """argparse `type` for one field: named after the kind so errors read 'expected int ...', not '<lambda>'."""
    def parse_one(text: str):
        if kind is bool:
            if text.lower() not in BOOL_WORDS:
                raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
            return BOOL_WORDS[text.lower()]
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'a number' if kind is float else 'an integer'}, "
                                             f"got {text!r}") from None

    def parse(text: str):
        try:
            return tuple(parse_one(x) for x in text.split(","))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"expected comma-separated values ({e}) in {text!r}") from None
    return parse if tuple_of else parse_one

def help_text(f) -> str:
    help = f.metadata["help"]
    return help() if callable(help) else help

class ConfigError(ValueError):
    """Bad user input: reported as one line on rank 0, never a traceback."""

class ArgumentParser(argparse.ArgumentParser):
    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)  # --val-loss is not --val-loss-every: a flag is named whole

    def error(self, message):  # one line through main()'s error path instead of usage + message on every rank
        raise ConfigError(f"{message} (see --help)")

def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")

def parse_args(argv=None) -> Hyperparameters:
    """Every Hyperparameters field becomes --kebab-case; tuples take comma-separated values."""
    parser = ArgumentParser(
        usage="torchrun --standalone --nproc_per_node=8 train_gpt.py [FLAGS]",
        formatter_class=lambda prog: argparse.HelpFormatter(prog, max_help_position=34),  # two lines a flag
        description="NanoGPT speedrun trainer. The defaults are the December 2025 record's settings; lists take "
                    "comma-separated values, booleans true/false (a bare boolean flag means true).")
    takes_value = {flag_name(f.name) for f in dataclasses.fields(Hyperparameters) if not isinstance(f.default, bool)}
    for f in dataclasses.fields(Hyperparameters):
        default, choices, flag = f.default, f.metadata["choices"], flag_name(f.name)
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default if default != "" else "''"
        help = f"{help_text(f)} (default: {shown})"
        if isinstance(default, bool):
            parser.add_argument(flag, nargs="?", const=True, metavar="BOOL", type=value_parser(bool), help=help)
        elif isinstance(default, tuple):
            parser.add_argument(flag, metavar=",".join("ABCDE"[:len(default)]),
                                type=value_parser(type(default[0]), tuple_of=True), help=help)
        else:
            metavar = f.metadata["metavar"] or (None if choices else {int: "N", float: "X"}.get(type(default), "TEXT"))
            parser.add_argument(flag, type=value_parser(type(default)), choices=choices, metavar=metavar, help=help)
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, token in enumerate(argv[:-1]):  # argparse takes "-3,0,2" for a flag: glue a negative value to its flag
        if token in takes_value and argv[i + 1] is not None and re.match(r"-(\d|\.|inf|nan)", argv[i + 1], re.I):
            argv[i:i + 2] = [f"{token}={argv[i + 1]}", None]
    given = {k: v for k, v in vars(parser.parse_args([a for a in argv if a is not None])).items() if v is not None}
    args = Hyperparameters(**{**(SMOKE_PRESET if given.get("smoke") else {}), **given})  # flags win over the preset
    validate_args(args)
    return args

def in_interval(x, interval: str) -> bool:
    """x inside an interval written as "[lo, hi)", "(0, inf)", ...; NaN is inside none."""
    lo, hi = (float(v) for v in interval[1:-1].split(","))
    return (lo <= x if interval[0] == "[" else lo < x) and (x <= hi if interval[-1] == "]" else x < hi)

def validate_args(args: Hyperparameters):
    """Every setting checked before anything runs (also under --check): one ConfigError naming the flag."""
    def need(cond, msg):
        if not cond:
            raise ConfigError(msg)
    for f in dataclasses.fields(args):  # argparse checks types, but the benchmark and tests build settings in code
        value, meta, flag = getattr(args, f.name), f.metadata, flag_name(f.name)
        if meta["choices"]:
            need(value in meta["choices"], f"{flag} must be one of {', '.join(meta['choices'])}, got {value!r}")
        values = value if isinstance(value, tuple) else (value,)
        shown = ",".join(map(str, values))
        need(meta["length"] is None or len(values) == meta["length"],
             f"{flag} takes {meta['length']} comma-separated values, got {shown}")
        need(meta["within"] is None or all(in_interval(v, meta["within"]) for v in values),
             f"{flag} must be in {meta['within']}{' (each value)' if len(values) > 1 else ''}, got {shown}")
        if f.name != "seed" and all(type(v) is int for v in values):
            need(all(v <= INT_LIMIT for v in values), f"{flag} must be at most {INT_LIMIT} (2^31-1), got {shown}")
    need(args.seed <= SEED_LIMIT, f"--seed must be at most {SEED_LIMIT} (2^64-1, torch's largest), got {args.seed}")
    longest_window = max(*args.ws_schedule, args.ws_final, args.ws_validate_post_yarn_ext)
    need(longest_window * args.block_size <= INT_LIMIT,
         f"the longest attention window, {longest_window} blocks of --block-size {args.block_size}, must be at most "
         f"{INT_LIMIT} tokens (2^31-1): lower --block-size or the windows")
    need(float(np.float32(args.adam_eps)) >= float(np.finfo(np.float32).tiny), f"--adam-eps {args.adam_eps} is below "
         f"the smallest normal float32 ({np.finfo(np.float32).tiny:.3g}), where Adam adds it: raise it")
    need(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}", args.run_id) or not args.run_id, f"--run-id {args.run_id!r} "
         f"is not a plain file name: use letters, digits, '.', '_' and '-' (it names <log-dir>/<run-id>.txt)")
    need(parse_kernels(args.kernels) is not None, f"--kernels must be fused, plain or a comma-separated list of "
                                                  f"{', '.join(FUSED_KERNELS)}; got {args.kernels!r}")
    layer_map(args.num_layers)  # refuses a count its rule does not cover
    need(args.model_dim == args.num_heads * args.head_dim,
         f"--model-dim ({args.model_dim}) must equal --num-heads x --head-dim ({args.num_heads}x{args.head_dim})")
    need(args.head_dim % 4 == 0, "--head-dim must be a multiple of 4 (half-truncated rotary)")
    need(len(args.train_bs_schedule) == len(args.ws_schedule) == len(args.lr_plateaus) == len(args.lr_plateau_starts),
         "--train-bs-schedule, --ws-schedule, --lr-plateaus and --lr-plateau-starts need one entry per stage")
    stages = len(args.train_bs_schedule)
    need(args.num_scheduled_iterations >= stages, f"--num-scheduled-iterations ({args.num_scheduled_iterations}) "
         f"must be at least the number of batch-size stages ({stages}, from --train-bs-schedule)")
    starts = args.lr_plateau_starts
    need(starts[0] == 0 and all(a < b for a, b in zip(starts, starts[1:])),
         f"--lr-plateau-starts must start at 0 and increase, got {','.join(map(str, starts))}")
    for flag, (start, end, steps) in (("--muon-momentum-warmup", args.muon_momentum_warmup),
                                      ("--muon-momentum-cooldown", args.muon_momentum_cooldown)):
        need(start < 1 and end < 1 and steps == int(steps),
             f"{flag} takes START,END,STEPS: momenta below 1, a whole number of steps; got {start},{end},{steps}")
    need(args.val_tokens % args.val_batch_size == 0,
         f"--val-tokens ({args.val_tokens}) must be a multiple of --val-batch-size ({args.val_batch_size})")


# =====================================================================================
# The model: the functions a speedrunner edits, its layout, its modules
# =====================================================================================

def norm(x: Tensor) -> Tensor:
    return F.rms_norm(x, (x.size(-1),))

def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding of x (T, heads, head_dim) from the tables cos, sin (>= T, head_dim / 2): each pair
    (x1, x2) of the two halves turns by its token's angle."""
    cos, sin = cos[:x.size(0), None, :], sin[:x.size(0), None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)

# Causal attention over packed documents (FlashAttention, Tri Dao et al.): q, k, v are (T, heads, head_dim),
# cu_seqlens marks the document starts, and each query sees itself and at most `window` earlier tokens of its own
# document. `window_table` is a CPU float64 tensor [[scale, short_window], [scale, long_window]] (tokens) and
# `window_row` picks its row: the compiled graphs see the table as data, so one graph serves every window stage and
# every YaRN scale (Python numbers would make each pair a new graph: 4 train + 5 eval compilations instead of 1 + 1).

def scale_and_window(window_table: Tensor, window_row: int) -> tuple:
    """(softmax scale, window in tokens) of the short (0) or long (1) window as Python numbers."""
    scale, window = window_table[window_row].tolist()
    return float(scale), int(window)

def attention_reference(q, k, v, cu_seqlens, max_seqlen, window_table, window_row):
    """Attention in plain PyTorch ops, one document at a time (the CPU's; it cannot be compiled)."""
    scale, window = scale_and_window(window_table, window_row)
    out = torch.zeros_like(q)
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end <= start:
            continue  # zero-length padding entries
        n = end - start
        qd, kd, vd = (t[start:end].transpose(0, 1).float() for t in (q, k, v))
        scores = (qd @ kd.transpose(-1, -2)) * scale
        back = torch.arange(n, device=q.device)[:, None] - torch.arange(n, device=q.device)  # query minus key position
        scores = scores.masked_fill((back < 0) | (back > window), float("-inf"))
        out[start:end] = (scores.softmax(dim=-1) @ vd).transpose(0, 1).to(q.dtype)
    return out

# PyTorch's FlashAttention-2 varlen kernels (torch.nn.attention.varlen's) in our own op, reading the table as it runs.
@torch.library.custom_op("speedrun::flash_varlen", mutates_args=())
def flash_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, window_table: Tensor,
                 window_row: int) -> tuple[Tensor, Tensor, Tensor]:
    scale, window = scale_and_window(window_table, window_row)
    out, lse, _, _, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, False, False,
        scale=scale, window_size_left=window, window_size_right=0)
    rng_state = torch.zeros((2,), dtype=torch.uint64, device=q.device)  # dropout is 0: the backward ignores it
    return out, lse, rng_state

@flash_varlen.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, window_table, window_row):
    return (torch.empty_like(q), q.new_empty((q.size(1), q.size(0)), dtype=torch.float32),
            q.new_empty((2,), dtype=torch.uint64))

@torch.library.custom_op("speedrun::flash_varlen_backward", mutates_args=())
def flash_varlen_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          rng_state: Tensor, cu_seqlens: Tensor, max_seqlen: int, window_table: Tensor,
                          window_row: int) -> tuple[Tensor, Tensor, Tensor]:
    scale, window = scale_and_window(window_table, window_row)
    unused = torch.empty(0, device=q.device)
    return torch.ops.aten._flash_attention_backward(
        grad_out, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, False, rng_state, unused,
        scale=scale, window_size_left=window, window_size_right=0)

@flash_varlen_backward.register_fake
def _(grad_out, q, k, v, out, lse, rng_state, cu_seqlens, max_seqlen, window_table, window_row):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

def _flash_varlen_setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, window_table, window_row = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens, window_table, *output)
    ctx.max_seqlen, ctx.window_row = max_seqlen, window_row

def _flash_varlen_backward_rule(ctx, grad_out, *_):
    q, k, v, cu_seqlens, window_table, out, lse, rng_state = ctx.saved_tensors
    dq, dk, dv = torch.ops.speedrun.flash_varlen_backward(grad_out.contiguous(), q, k, v, out, lse, rng_state,
                                                          cu_seqlens, ctx.max_seqlen, window_table, ctx.window_row)
    return dq, dk, dv, None, None, None, None

flash_varlen.register_autograd(_flash_varlen_backward_rule, setup_context=_flash_varlen_setup_context)

def attention_varlen(q, k, v, cu_seqlens, max_seqlen, window_table, window_row):
    return torch.ops.speedrun.flash_varlen(q, k, v, cu_seqlens, max_seqlen, window_table, window_row)[0]

def flash_attention(q, k, v, cu_seqlens, max_seqlen, window_table, window_row):
    """PyTorch's FlashAttention-2 kernels on a GPU (the closest to the record's FA3), the reference elsewhere."""
    attend = attention_varlen if q.is_cuda else attention_reference
    return attend(q, k, v, cu_seqlens, max_seqlen, window_table, window_row)

def attention(qkv: Tensor, ve: Tensor | None, gate: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor,
              max_seqlen: int, window_table: Tensor, window_row: int) -> Tensor:
    """The plain attention from the raw projections qkv (T, 3·heads, head_dim): RMS norm and rotary on q and k, the
    value embedding ve (T, heads, head_dim) added to v, FlashAttention, each head's output scaled by the sigmoid of
    its gate logit (gate: (T, heads)). Returns (T, heads, head_dim)."""
    q, k, v = qkv.chunk(3, dim=1)
    q, k = rotary(norm(q), cos, sin), rotary(norm(k), cos, sin)
    if ve is not None:
        v = v + ve
    return flash_attention(q, k, v, cu_seqlens, max_seqlen, window_table, window_row) * torch.sigmoid(gate)[..., None]

def attention_output(residual: Tensor, y: Tensor, w: Tensor) -> Tensor:
    """The attention's output projection added to the residual stream: residual + y wᵀ."""
    return residual + F.linear(y, w)

# --- the plain MLP and attention output, and their fused twins (quack-kernels GEMMs, Tri Dao et al.) -----------

def mlp(x: Tensor, w_fc: Tensor, w_proj: Tensor) -> Tensor:
    """The ReLU² MLP: relu(x w_fcᵀ)² w_proj, with w_fc and w_proj both stored (4d, d)."""
    return F.relu(F.linear(x, w_fc)).square() @ w_proj

# --- the plain head: softcapped logits and PyTorch's cross-entropy, as the record computes them ------------------
SOFTCAP = 30.0        # every logit is squashed into (0, SOFTCAP) ...
SOFTCAP_WIDTH = 7.5   # ... by z = SOFTCAP · sigmoid(logit / SOFTCAP_WIDTH)

def softcap(logits: Tensor) -> Tensor:
    return SOFTCAP * torch.sigmoid(logits / SOFTCAP_WIDTH)

def lm_head_loss(x: Tensor, w: Tensor, targets: Tensor, fp8: bool) -> Tensor:
    """Sum over tokens of the cross-entropy of the softcapped logits x wᵀ (FP8 operands in training on Hopper)."""
    logits = lm_head_fp8(x, w) if fp8 else F.linear(x, w)
    return F.cross_entropy(softcap(logits.float()), targets, reduction="sum")

# --- FP8 lm_head matmul ---------------------------------------------------------------
# Scales chosen so the e4m3/e5m2 casts never saturate: an RMS-normalised row has |x| <= sqrt(768),
# so x / (sqrt(768)/448) fits e4m3's max of 448; lm_head weights stay far below 448 * 2^-9.
FP8_X_SCALE = math.sqrt(768) / 448
FP8_W_SCALE = 2.0 ** -9
FP8_GRAD_SCALE = 1.0 / 448

_SCALE_TENSORS = {}

def _scale_tensor(value: float, like: Tensor) -> Tensor:
    """The scale as a device scalar, made once per (value, device): torch.tensor(value, device="cuda") is a blocking
    copy, and six of them per micro-batch would stall the host until the GPU had drained its queue."""
    key = (value, like.device)
    if key not in _SCALE_TENSORS:
        _SCALE_TENSORS[key] = torch.tensor(value, dtype=torch.float32, device=like.device)
    return _SCALE_TENSORS[key]

# A custom op whose outputs change shape, dtype or layout gets a new name: Inductor's on-disk caches key a
# compiled graph by its code, which names the op but not what its fake implementation returns, so an old
# compiled graph would be reused and fail its output checks.
@torch.library.custom_op("speedrun::fp8_matmul", mutates_args=())
def fp8_matmul(x: Tensor, w: Tensor, x_s: float, w_s: float, grad_s: float) -> tuple[Tensor, Tensor, Tensor]:
    """out = x @ w.T with both operands in e4m3; returns (out bf16, x_f8_t, w_f8_t): the quantised operands
    transposed (contiguous), the layouts the backward's two GEMMs read."""
    x_f8, x_f8_t = quantize_e4m3(x, x_s)
    w_f8, w_f8_t = quantize_e4m3(w, w_s)
    out = torch._scaled_mm(x_f8, w_f8.T, out_dtype=torch.bfloat16, scale_a=_scale_tensor(x_s, x),
                           scale_b=_scale_tensor(w_s, x), use_fast_accum=True)
    return out, x_f8_t, w_f8_t

@fp8_matmul.register_fake
def _(x, w, x_s, w_s, grad_s):
    return (x.new_empty(x.size(0), w.size(0), dtype=torch.bfloat16),
            x.new_empty((x.size(1), x.size(0)), dtype=torch.float8_e4m3fn),
            w.new_empty((w.size(1), w.size(0)), dtype=torch.float8_e4m3fn))

def quantize_e4m3(x: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """e4m3(x / scale) rounded as the record's compiled quantiser does (fp32 product, one rounding), in the (M, N)
    layout and its contiguous transpose, from one Triton pass over x (PyTorch: a division, a cast, a strided copy)."""
    assert x.dim() == 2
    if not _kernels_usable(x):
        return quantize_e4m3_reference(x, scale)
    M, N = x.shape
    x = x.contiguous()
    q = torch.empty((M, N), dtype=torch.float8_e4m3fn, device=x.device)
    q_t = torch.empty((N, M), dtype=torch.float8_e4m3fn, device=x.device)
    block = 128  # 128-byte rows of the 1-byte outputs: full memory transactions in both layouts
    _quantize_transpose_kernel[(triton.cdiv(M, block), triton.cdiv(N, block))](
        x, q, q_t, M, N, float(np.float32(1) / np.float32(scale)), BLOCK=block, num_warps=8)
    return q, q_t

def quantize_e4m3_reference(x: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """quantize_e4m3 in PyTorch ops (the CPU path)."""
    q = (x.float() * (np.float32(1) / np.float32(scale)).item()).to(torch.float8_e4m3fn)
    return q, q.t().contiguous()

@torch.library.custom_op("speedrun::fp8_matmul_backward", mutates_args=())
def fp8_matmul_backward(g_f8: Tensor, x_f8_t: Tensor, w_f8_t: Tensor, x_s: float, w_s: float, grad_s: float,
                        g_f8_t: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """dX and dW from quantised operands (`*_t`: contiguous transposes). dW needs the (T, vocab) gradient transposed
    (_scaled_mm's layouts): g_f8_t where the caller has it (the fused head writes both layouts), else made here."""
    g_f8_t = transpose_bytes(g_f8) if g_f8_t is None else g_f8_t
    grad_x = torch._scaled_mm(g_f8, w_f8_t.T, out_dtype=torch.bfloat16, scale_a=_scale_tensor(grad_s, g_f8),
                              scale_b=_scale_tensor(w_s, g_f8), use_fast_accum=False)
    # dW in the weight's own layout and dtype, (vocab, 768) bf16. The record computes (768, vocab) in fp32 and
    # returns its transpose, which autograd then casts to bf16 and adds into the gradient with strided passes
    # over 38.6M elements. The GEMM alone is a little slower this way round, far less than the passes it saves cost.
    grad_w = torch._scaled_mm(g_f8_t, x_f8_t.T, out_dtype=torch.bfloat16, scale_a=_scale_tensor(grad_s, g_f8),
                              scale_b=_scale_tensor(x_s, g_f8), use_fast_accum=False)
    return grad_x, grad_w

@fp8_matmul_backward.register_fake
def _(g_f8, x_f8_t, w_f8_t, x_s, w_s, grad_s, g_f8_t=None):
    return (g_f8.new_empty((g_f8.size(0), w_f8_t.size(0)), dtype=torch.bfloat16),
            g_f8.new_empty((g_f8.size(1), x_f8_t.size(0)), dtype=torch.bfloat16))

def _fp8_matmul_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*output[1:])  # x_f8_t, w_f8_t
    ctx.scales = tuple(inputs[2:])      # x_s, w_s, grad_s
    ctx.set_materialize_grads(False)

def _fp8_matmul_backward_rule(ctx, grad_out, *_):
    x_f8_t, w_f8_t = ctx.saved_tensors
    x_s, w_s, grad_s = ctx.scales
    # Quantised here, outside the opaque op: this rule is traced into the compiled backward graph, so Inductor fuses
    # the e5m2 cast into the kernel that produces grad_out instead of spending extra passes over (T, 50304).
    g_f8 = quantize_e5m2(grad_out, grad_s)
    grad_x, grad_w = torch.ops.speedrun.fp8_matmul_backward(g_f8, x_f8_t, w_f8_t, x_s, w_s, grad_s)
    return grad_x, grad_w, None, None, None

fp8_matmul.register_autograd(_fp8_matmul_backward_rule, setup_context=_fp8_matmul_setup_context)

def lm_head_fp8(x: Tensor, w: Tensor) -> Tensor:
    return torch.ops.speedrun.fp8_matmul(x, w, FP8_X_SCALE, FP8_W_SCALE, FP8_GRAD_SCALE)[0]

def quantize_e5m2(g: Tensor, grad_s: float) -> Tensor:
    """The FP8 backward's gradient operand: e5m2(g / grad_s), one rounding from fp32."""
    return (g.float() / grad_s).to(torch.float8_e5m2)

# How the optimizers treat a parameter, declared where it is made (set_optimizer_label): the label names its group.
TREATMENTS = {
    "matrix": "NorMuon, orthogonalised: one second moment per row (per column where the matrix is wider than tall)",
    "qkvo": "NorMuon, a (4d, d) stack of Q, K, V and O, each orthogonalised on its own: one second moment per row",
    "gate": "NorMuon, a gate's few rows: one second moment per row whatever its shape",
    "adam": "DistAdam: Adam, its rows sharded over the ranks",
}

def set_optimizer_label(p: nn.Parameter, label: str, treatment: str, lr_mul: float = 1.0) -> nn.Parameter:
    """p joins the optimizer group `label`, treated as TREATMENTS[treatment] says, at lr x lr_mul."""
    if treatment not in TREATMENTS:
        raise ConfigError(f"set_optimizer_label(..., {label!r}, {treatment!r}): the treatment is one of "
                          + "; ".join(f"{k} ({v})" for k, v in TREATMENTS.items()))
    p.label, p.treatment, p.lr_mul = label, treatment, lr_mul
    return p

GATE_INPUTS = 12  # a gate reads the first 12 channels of its input
def gate_input(x: Tensor) -> Tensor:
    return x[..., :GATE_INPUTS]

def uniform_bound(dim: int) -> float:
    """The half-width of the record's uniform initialisation of a (·, dim) matrix: sqrt(3)/2 / sqrt(dim)."""
    return math.sqrt(3) * 0.5 * dim ** -0.5

@dataclass(frozen=True)
class LayerMap:
    """Which block has attention, an MLP, the long window or a value embedding, and where the U-net skip and the
    backout read and join: layer_map() derives it from the layer count, check() refuses one that cannot work."""
    num_layers: int
    no_attention: tuple     # blocks without attention (block 0 is empty: the trunk starts at block 1)
    no_mlp: tuple
    long_window: tuple      # blocks on the long attention window; the rest use the short one
    value_embeds: tuple     # (block, table): the value-embedding table (of 3) block's attention adds
    skip_from: int          # the U-net skip: block skip_from's output joins before block skip_to
    skip_to: int
    backout_from: int       # block whose output is backed out of the final hidden state
    skip_weight: int = 1    # which skip weight that skip reads: the record's reads scalars[1], whatever skip_from

    @property
    def num_scalars(self) -> int:
        """skip weights, block lambdas (x, x0) and attention lambdas (qkv, o) per block, then smear and backout."""
        return 5 * self.num_layers + 2

    def check(self) -> "LayerMap":
        L, attention = self.num_layers, set(range(1, self.num_layers)) - set(self.no_attention)
        problems = [f"{name} names block {b}, not one of 0..{L - 1}" for name in ("no_attention", "no_mlp",
                    "long_window") for b in getattr(self, name) if not 0 <= b < L]
        problems += [f"value_embeds gives block {b} table {t}, but block {b} has no attention or table {t} is not "
                     "one of 0, 1, 2" for b, t in self.value_embeds if b not in attention or t not in (0, 1, 2)]
        problems += [f"long_window names block {b}, which has no attention" for b in self.long_window
                     if b not in attention and 0 <= b < L]
        if not 1 <= self.skip_from < self.skip_to < L or not 1 <= self.backout_from < L:
            problems.append(f"the skip {self.skip_from} -> {self.skip_to} and the backout from {self.backout_from} "
                            f"must be blocks 1..{L - 1}, the skip forward")
        if problems:
            more = f" and {len(problems) - 1} more" if len(problems) > 1 else ""
            raise ConfigError(f"--num-layers {L}: the layer map cannot work ({problems[0]}{more}): edit layer_map() "
                              f"(its rule covers 9 layers or more), or pick another --num-layers")
        return self

    def line(self) -> str:  # for the log
        return (f"layers: {self.num_layers} blocks; no attention in {list(self.no_attention)}, no MLP in "
                f"{list(self.no_mlp)}; long window in {list(self.long_window)}; value embeddings "
                f"{', '.join(f'{b}<-{t}' for b, t in self.value_embeds)}; skip {self.skip_from} -> {self.skip_to}; "
                f"backout from {self.backout_from}; {self.num_scalars} scalars")

def layer_map(num_layers: int) -> LayerMap:
    """The record's map (12 layers: skip 4 -> 7, backout 8, long windows 4 and 11, value embeddings in the first two
    and last three blocks, block 7 MLP-only) as one rule of the layer count L."""
    L = num_layers
    skip_from, skip_to = L // 3, L // 2 + 1
    return LayerMap(L, no_attention=(0, skip_to), no_mlp=(0,), long_window=(skip_from, L - 1),
                    value_embeds=((1, 1), (2, 2), (L - 3, 0), (L - 2, 1), (L - 1, 2)), skip_from=skip_from,
                    skip_to=skip_to, backout_from=2 * L // 3).check()

class Yarn(nn.Module):
    """The rotary tables (cos, sin) of the half-truncated rotary embedding, whose low frequencies are stretched (YaRN,
    Bowen Peng et al.) when the attention window grows."""

    def __init__(self, head_dim: int, max_seq_len: int):
        super().__init__()
        self.head_dim, self.max_seq_len = head_dim, max_seq_len
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2, dtype=torch.bfloat16), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2, dtype=torch.bfloat16), persistent=False)
        self.reset()

    def reset(self):
        n = self.head_dim // 4  # half the (x1, x2) pairs rotate, from 1 down to 1/1024 rad/token; the rest pass through
        rotating = (1 / 1024) ** torch.linspace(0, 1, steps=n, dtype=torch.float32)
        self.freqs = torch.cat([rotating, rotating.new_zeros(n)])
        self.attn_scale = 0.1
        self.window = None  # the long window the tables are stretched for; set by the first set_window()
        self._write_tables()

    def _write_tables(self):
        theta = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float32), self.freqs)
        with torch.no_grad():  # copy in place so compiled graphs keep pointing at the same buffers
            self.cos.copy_(theta.cos())
            self.sin.copy_(theta.sin())

    def set_window(self, window: int):
        """Stretch the tables for a new long attention window (the first call only records it)."""
        if self.window is not None and window != self.window:
            self.stretch(self.window, window)
        self.window = window

    def stretch(self, old_window: int, new_window: int, alpha: float = 1.0, beta: float = 32.0):
        """Stretch the slow frequencies by old/new window (fast ones kept) and raise the softmax scale."""
        turns = 128 * old_window * self.freqs / (2 * math.pi)
        gamma = ((turns - alpha) / (beta - alpha)).clamp(0, 1)
        ratio = old_window / new_window
        self.freqs = self.freqs * (ratio + gamma * (1 - ratio))
        self.attn_scale *= 1 + 0.2 * math.log(new_window / old_window)
        self.window = new_window  # what set_window compares against, also after a direct call
        self._write_tables()

class Documents(typing.NamedTuple):
    """What attention needs to know of a packed micro-batch: where its documents start (cu_seqlens), the longest
    one, the windows' table (GPT.window_table) and the rotary tables."""
    cu_seqlens: Tensor
    max_seqlen: int
    window_table: Tensor
    cos: Tensor
    sin: Tensor

class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, head_dim: int):
        super().__init__()
        self.dim, self.num_heads, self.head_dim = dim, num_heads, head_dim
        # One stacked fp32 matrix: rows [0, 3d) are Wq, Wk, Wv and rows [3d, 4d) are Wo, all (out, in).
        self.qkvo_w = set_optimizer_label(nn.Parameter(torch.empty(4 * dim, dim)), "attn", "qkvo")
        bound = uniform_bound(dim)
        with torch.no_grad():
            self.qkvo_w[:3 * dim].uniform_(-bound, bound)
            self.qkvo_w[3 * dim:].zero_()
        # Sparse gate: one sigmoid per head and token, read off the first channels of the block input.
        self.attn_gate = nn.Linear(GATE_INPUTS, num_heads, bias=False)
        nn.init.zeros_(self.attn_gate.weight)
        set_optimizer_label(self.attn_gate.weight, "attn_gate", "gate")

    def forward(self, x: Tensor, residual: Tensor, ve: Tensor | None, sa_lambdas: Tensor, docs: "Documents",
                window_row: int, kernels: dict) -> Tensor:
        """residual + attention(x): x is the normed block input, residual the block input, window_row which of
        docs' windows (0: short, 1: long)."""
        T, d = x.shape
        w = self.qkvo_w.type_as(x)
        # sa_lambdas are folded into the weights (a 768x2304 multiply is cheaper than a T x 2304 one).
        qkv = F.linear(x, sa_lambdas[0] * w[:3 * d]).view(T, 3 * self.num_heads, self.head_dim)
        ve = None if ve is None else ve.view(T, self.num_heads, self.head_dim)
        gate = F.linear(gate_input(x), self.attn_gate.weight)
        y = kernels["attention"](qkv, ve, gate, docs.cos, docs.sin, docs.cu_seqlens, docs.max_seqlen, docs.window_table,
                                 window_row)
        return kernels["attention_output"](residual, y.reshape(T, d), sa_lambdas[1] * w[3 * d:])

class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        # Both stored (4d, d): h = x @ c_fc.T, out = h @ c_proj (same function as the untransposed record).
        self.c_fc = set_optimizer_label(nn.Parameter(torch.empty(4 * dim, dim)), "mlp", "matrix", lr_mul=1.0)
        self.c_proj = set_optimizer_label(nn.Parameter(torch.zeros(4 * dim, dim)), "mlp", "matrix", lr_mul=2.0)
        bound = uniform_bound(dim)
        nn.init.uniform_(self.c_fc, -bound, bound)

    def forward(self, x, kernels):
        return kernels["mlp"](x, self.c_fc.type_as(x), self.c_proj.type_as(x))

class Block(nn.Module):
    def __init__(self, layer: int, layers: LayerMap, dim: int, num_heads: int, head_dim: int):
        super().__init__()
        self.attn = CausalSelfAttention(dim, num_heads, head_dim) if layer not in layers.no_attention else None
        self.mlp = MLP(dim) if layer not in layers.no_mlp else None

# Evaluation runs the head over this many tokens at a time: a (262144, 50304) bf16 logits tensor would take 25 GiB.
EVAL_HEAD_CHUNK = 32768

class LMHead(nn.Module):
    """The loss of the final hidden states, summed over tokens: `loss_fn` (lm_head_loss or its fused twin) in
    training, the plain bf16 lm_head_loss in evaluation."""

    def __init__(self, dim: int, vocab_size: int, loss_fn=lm_head_loss, fp8: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(vocab_size, dim, dtype=torch.bfloat16))  # zero init: loss ln(V)
        self.loss_fn, self.fp8 = loss_fn, fp8

    def forward(self, x: Tensor, targets: Tensor) -> Tensor:
        if self.training:
            return self.loss_fn(x, self.weight, targets, self.fp8)
        return lm_head_loss(x, self.weight, targets, fp8=False)

class GPT(nn.Module):
    def __init__(self, args: Hyperparameters, max_seq_len: int, kernels: dict = None, fp8: bool = False):
        """max_seq_len: longest packed micro-batch (rotary tables); kernels: {name: function} from resolve_kernels
        (default: every plain function); fp8: FP8 lm_head in training."""
        super().__init__()
        d, L = args.model_dim, args.num_layers
        self.layers = layer_map(L)
        self.kernels = kernels or {name: k.plain for name, k in FUSED_KERNELS.items()}
        self.vocab_size, self.block_size = next_multiple_of(args.vocab_size, 128), args.block_size
        self.embed = nn.Embedding(self.vocab_size, d)
        self.smear_gate = nn.Linear(GATE_INPUTS, 1, bias=False)
        nn.init.zeros_(self.smear_gate.weight)
        self.value_embeds = nn.ModuleList([nn.Embedding(self.vocab_size, d) for _ in range(3)])
        self.blocks = nn.ModuleList([Block(i, self.layers, d, args.num_heads, args.head_dim) for i in range(L)])
        self.yarn = Yarn(args.head_dim, max_seq_len)
        self.lm_head = LMHead(d, self.vocab_size, self.kernels["lm_head_loss"], fp8)
        for m in self.modules():  # embeddings, gates and lm_head live in bf16; the big matrices stay fp32
            if isinstance(m, (nn.Embedding, nn.Linear)):
                m.bfloat16()
        self.scalars = nn.Parameter(torch.cat([         # layers.num_scalars of them
            torch.full((L,), -1.5),                     # skip weights (sigmoid(-1.5) ~ 0.18)
            torch.tensor([1.1, 0.0]).repeat(L),         # block lambdas (x, x0)
            torch.tensor([0.5, 1.0]).repeat(L),         # SA lambdas (qkv, o)
            torch.tensor([0.0, 0.5])]))                 # smear lambda, backout lambda
        set_optimizer_label(self.embed.weight, "embed", "adam", 75.0)
        set_optimizer_label(self.smear_gate.weight, "smear_gate", "gate")
        for ve in self.value_embeds:
            set_optimizer_label(ve.weight, "value_embed", "adam", 75.0)
        set_optimizer_label(self.lm_head.weight, "lm_head", "adam", 1.0)
        set_optimizer_label(self.scalars, "scalars", "adam", 5.0)
        self._trunk, self._head, self.is_compiled = self.trunk, self.head, False  # see compile_regions()

    def compile_regions(self, **options):
        """torch.compile the trunk and the head as two regions: the head's backward finishes first, so lm_head's
        gradient hook (DistAdam's biggest reduce-scatter) fires while the trunk's backward still computes."""
        self._trunk, self._head = torch.compile(self.trunk, **options), torch.compile(self.head, **options)
        self.is_compiled = True

    # CUDA graphs: a training micro-batch is recorded once and replayed, so a Python number read here (an attribute,
    # a global, a schedule value) is frozen at its value at capture. A value that changes during training reaches the
    # replays only as a tensor the graph reads (as the window table and the loss's divisor do) or as an entry of
    # MicroBatchGraphs.key(), which then captures one graph per value.
    def forward(self, input_seq: Tensor, target_seq: Tensor, cu_seqlens: Tensor, ws_short: int, ws_long: int,
                max_seqlen: int) -> Tensor:
        """The loss: summed over tokens in training, the mean in evaluation."""
        for t in (input_seq, target_seq, cu_seqlens):  # one graph for every micro-batch length (and cu_seqlens length)
            self.dynamic(t)
        x = self._trunk(input_seq, cu_seqlens, self.window_table(ws_short, ws_long), max_seqlen)
        if self.training:
            return self._head(self.dynamic(x), target_seq)
        chunks = zip(x.split(EVAL_HEAD_CHUNK), target_seq.split(EVAL_HEAD_CHUNK))
        return sum(self._head(self.dynamic(xc), self.dynamic(tc)) for xc, tc in chunks) / target_seq.numel()

    def dynamic(self, t: Tensor) -> Tensor:
        if self.is_compiled:
            torch._dynamo.mark_dynamic(t, 0)
        return t

    def window_table(self, ws_short: int, ws_long: int) -> Tensor:
        """Rows [softmax scale, window in tokens] of the short and the long window: a fresh CPU tensor per call (data
        to the compiled graph, saved as is for the backward)."""
        scale, bs = self.yarn.attn_scale, self.block_size
        return torch.tensor(((scale, ws_short * bs), (scale, ws_long * bs)), dtype=torch.float64)

    def trunk(self, input_seq: Tensor, cu_seqlens: Tensor, window_table: Tensor, max_seqlen: int) -> Tensor:
        """Embeddings and blocks: the normalised final hidden state (T, d)."""
        L, layers = len(self.blocks), self.layers
        skip_w = self.scalars[:L]           # one per layer; only the U-net skip's (layers.skip_weight) is read
        lambdas = self.scalars[L:3 * L].view(L, 2)
        sa_lambdas = self.scalars[3 * L:5 * L].view(L, 2)
        smear_lambda, backout_lambda = self.scalars[5 * L], self.scalars[5 * L + 1]

        ve = tuple(emb(input_seq) for emb in self.value_embeds)
        x = self.embed(input_seq)
        # Smear: mix a gated copy of the previous token's embedding into each position (1-token look-back).
        gate = smear_lambda * torch.sigmoid(F.linear(gate_input(x[1:]), self.smear_gate.weight))
        x = x0 = norm(torch.cat([x[:1], x[1:] + gate * x[:-1]]))
        docs = Documents(cu_seqlens, max_seqlen, window_table, self.yarn.cos, self.yarn.sin)
        skip = backout = None
        for i in range(1, L):  # block 0 is empty
            block = self.blocks[i]
            if i == layers.skip_to:
                x = x + torch.sigmoid(skip_w[layers.skip_weight]) * skip
            x = lambdas[i, 0] * x + lambdas[i, 1] * x0
            if block.attn is not None:
                window_row = 1 if i in layers.long_window else 0
                v = ve[dict(layers.value_embeds)[i]] if i in dict(layers.value_embeds) else None
                x = block.attn(norm(x), x, v, sa_lambdas[i], docs, window_row, self.kernels)
            if block.mlp is not None:
                x = x + block.mlp(norm(x), self.kernels)
            if i == layers.skip_from:
                skip = x
            if i == layers.backout_from:
                backout = x
        return norm(x - backout_lambda * backout)

    def head(self, x: Tensor, target_seq: Tensor) -> Tensor:
        return self.lm_head(x, target_seq)

def next_multiple_of(x: int, n: int) -> int:
    return -(-x // n) * n


# =====================================================================================
# Optimizers: Polar Express and Turbo-Muon, NorMuon, DistAdam, and the labels that choose
# =====================================================================================

# Muon (Keller Jordan) orthogonalizes each update. Polar Express (Amsel, Persson, Musco and Gower) replaces
# Newton-Schulz with per-iteration minimax-optimal coefficients; its symmetric Triton kernels come from Byron
# Xu's speedrun contribution. Turbo-Muon (Thibaut Boissin and co-authors) preconditions with AOL row scaling
# (Prach and Lampert), which makes the first iteration unnecessary.
#
# polar_express(G) maps each matrix of a batch G (..., rows, cols) to an approximation of its polar factor U Vᵀ
# (G = U Σ Vᵀ) with a fixed odd-polynomial iteration.  On CUDA it runs in bf16 through Triton kernels that exploit
# symmetry (ns_line_1 and ns_line_2 share one kernel, _sym_gram_kernel); everywhere else (CPU, tiny matrices,
# no triton) the same loop runs on torch matmuls.
#
#   iteration:   A = X Xᵀ            ns_line_1  xxt          (symmetric: lower tiles only, mirrored)
#                B = b·A + c·A·A     ns_line_2  ba_plus_cAA  (A symmetric, so A·A = A·Aᵀ: same scheme)
#                X ← a·X + B·X       ns_line_3  ax_plus_bx   (accumulator starts at a·X; no baddbmm copy)
#
# kernel_config() picks the tiles: autotuning them, as the record does, costs minutes of cold start.

POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# Turbo-Muon's coefficients are derived here, from Polar Express's: AOL preconditioning does the work of the first
# iteration, so Turbo-Muon runs the remaining ones. Editing POLAR_EXPRESS_COEFFS changes both; --help counts both.
TURBO_SKIPPED_ITERATIONS = 1
TURBO_MUON_COEFFS = POLAR_EXPRESS_COEFFS[TURBO_SKIPPED_ITERATIONS:]
POLAR_NORM_SAFETY = 1.02     # X / (‖X‖_F·1.02 + 1e-6): spectral norm < 1 with a 2 % margin
POLAR_NORM_EPS = 1e-6
TURBO_AOL_SAFETY = 1.02      # s = rsqrt(rowsum|XXᵀ|·1.02 + 1e-6), the 2 % margin kept
TURBO_AOL_EPS = 1e-6

def _torch_gram(X, out=None):
    return X @ X.mT

def _torch_poly(A, b, c, out=None):
    return b * A + c * (A @ A)

def _torch_update(X, B, a, out=None):
    return a * X + B @ X

_TORCH_OPS = (_torch_gram, _torch_poly, _torch_update)

def _polar_loop(G: Tensor, turbo: bool, dtype, ops, buffers: bool) -> Tensor:
    """The body of polar_express and its reference: G (..., rows, cols) -> same shape in `dtype`. ops = (gram, poly,
    update); buffers=True: A, B, C are allocated once and X/C swap roles (the Triton ops write into `out`)."""
    gram, poly, update = ops
    transposed = G.size(-2) > G.size(-1)
    X = (G.mT if transposed else G).to(dtype).contiguous()  # wide orientation: rows <= cols, A is the small Gram
    acc = torch.promote_types(dtype, torch.float32)   # scalings in fp32 (fp64 for a float64 reference)
    A = X.new_empty(*X.shape[:-1], X.size(-2)) if buffers else None
    B = torch.empty_like(A) if buffers else None
    if turbo:
        # AOL preconditioning fused into iteration 1: one Gram of the raw X serves both the row scaling
        # s = rsqrt(rowsum|A|·1.02 + eps) (‖diag(s)X‖₂ <= 1 by Gershgorin) and A₁ = diag(s) A diag(s).
        A = gram(X, A)
        s = torch.rsqrt(A.to(acc).abs().sum(dim=-1, keepdim=True) * TURBO_AOL_SAFETY + TURBO_AOL_EPS)
        X = (X.to(acc) * s).to(dtype)
        A = (A.to(acc) * s * s.mT).to(dtype)
        coeffs = TURBO_MUON_COEFFS
    else:
        norm = torch.linalg.vector_norm(X.to(acc), dim=(-2, -1), keepdim=True)
        X = (X.to(acc) / (norm * POLAR_NORM_SAFETY + POLAR_NORM_EPS)).to(dtype)
        coeffs = POLAR_EXPRESS_COEFFS
    C = torch.empty_like(X) if buffers else None
    for i, (a, b, c) in enumerate(coeffs):
        if i > 0 or not turbo:                        # turbo's first Gram was computed above
            A = gram(X, A)
        B = poly(A, b, c, B)
        C = update(X, B, a, C)
        X, C = C, X
    return X.mT if transposed else X

def polar_express_reference(G: Tensor, turbo: bool = False) -> Tensor:
    """Pure-PyTorch Polar Express / Turbo-Muon in float32 (the CPU path, the gates), or float64 for a float64 G."""
    return _polar_loop(G, turbo, torch.float64 if G.dtype == torch.float64 else torch.float32, _TORCH_OPS,
                       buffers=False)

def polar_express(G: Tensor, turbo: bool = False) -> Tensor:
    """Approximate polar factor of every matrix in G (..., rows, cols): bf16 on CUDA (Triton kernels where the
    matrices are large enough), float32 on the CPU; turbo=True: Turbo-Muon (AOL row scaling, one iteration less)."""
    if not G.is_cuda:
        return polar_express_reference(G, turbo)
    if min(G.shape[-2:]) < KERNEL_MIN_DIM:
        # gates (6x12, 1x12): launch-bound, so fp32 costs nothing and avoids bf16 rounding of A and B (the torch
        # ops round each product to bf16, unlike the kernels' fp32 epilogues: ~8 % vs ~1 % deviation from fp32)
        return polar_express_reference(G, turbo).bfloat16()
    use_kernels = _kernels_usable(G) and G.dim() in (2, 3)
    return _polar_loop(G, turbo, torch.bfloat16, _TRITON_OPS if use_kernels else _TORCH_OPS, buffers=use_kernels)

# NorMuon (Zichong Li et al.) adds Adam-like per-row second moments to Muon's orthogonalized update; the weight decay
# is cautious (Lizhang Chen et al.): it only acts where the update already shrinks the weight.
#
# Two optimizers, both sharded over the ranks of the default process group (or local when there is none):
#   NorMuon   for the 43 hidden matrices and gates: reduce-scatter grads -> per-shard update -> all-gather params
#   DistAdam  for embeddings, lm_head and scalars: ZeRO-1 over dim 0, grads reduce-scattered from a grad hook
#
# What each parameter carries (set_optimizer_label, where the model makes it):
#   p.label      its group: the record's are smear_gate, attn_gate, attn, mlp (NorMuon) and lm_head, scalars,
#                value_embed, embed (DistAdam)
#   p.treatment  TREATMENTS: matrix | qkvo | gate (NorMuon) or adam (DistAdam)
#   p.lr_mul     its learning-rate multiplier (p.wd_mul, optional: its weight-decay multiplier)

# The record's NorMuon labels, in its group order, with their counts: its 8-GPU group sizing is kept for them.
NORMUON_RECORD_COUNTS = {"smear_gate": 1, "attn_gate": 10, "attn": 10, "mlp": 22}
NORMUON_RECORD_GROUP_SIZES = (1, 10, 16, 16)   # 8 GPUs: G3 = 10 attn + 6 mlp, G4 = 16 mlp
DISTADAM_RECORD_ORDER = ("lm_head", "scalars", "value_embed", "embed")  # the record's step order; new labels after

# One-tensor collectives: torch 2.13 renamed them (the old names warn there); torch 2.11 has only the old names.
reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)

def _dist_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0

# ---- NorMuon per-shard math: small pure functions the trainer may torch.compile (dynamic=False) ----

def normuon_second_moment(v: Tensor, second_moment: Tensor, beta2: float, dim: int) -> Tensor:
    """Per-row (dim=-1) or per-column (dim=-2) RMS normalisation of v (..., rows, cols) by the running mean of v²
    kept in second_moment (updated in place); each matrix keeps its Frobenius norm."""
    vf = v.float()
    # fp32 arithmetic, one rounding into the buffer's dtype. Eagerly the update then reads the stored (rounded)
    # value; compiled, Inductor may use the unrounded one, as it does with the record's compiled lines.
    second_moment.copy_(second_moment.float().lerp(vf.square().mean(dim=dim, keepdim=True), 1.0 - beta2))
    vn = vf * second_moment.float().clamp_min(1e-10).rsqrt()
    scale = vf.norm(dim=(-2, -1), keepdim=True) / vn.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10)
    return (vn * scale).to(v.dtype)

def cautious_update(p: Tensor, v: Tensor, lr_eff: Tensor, wd_eff: Tensor) -> None:
    """In place, in fp32: p <- p - lr_eff·(v + wd_eff·[v·p >= 0]·p): the decay acts only where the update already
    shrinks |p|. lr_eff, wd_eff: 0-D CPU float32 tensors (a new value never recompiles)."""
    pf, vf = p.float(), v.float()
    mask = (vf * pf >= 0).to(torch.float32)
    p.copy_(pf - lr_eff * (vf + wd_eff * mask * pf))

def normuon_lr_factor(p: Tensor) -> float:
    """sqrt(max(1, rows/cols)) * lr_mul from the parameter's own stored 2-D shape (attn 2, c_fc 2, c_proj 4)."""
    return math.sqrt(max(1.0, p.shape[-2] / p.shape[-1])) * float(getattr(p, "lr_mul", 1.0))

def normuon_reduce_dim(treatment: str, shape) -> int:
    """Axis of the NorMuon second moment, from the stored (un-reshaped) shape: gates and tall/square matrices
    get one statistic per row (-1); wide matrices one per column (-2)."""
    return -1 if treatment == "gate" or shape[-2] >= shape[-1] else -2

def normuon_groups(params, world_size: int) -> tuple[list, str]:
    """([(name, params)], note): the record's 8-GPU sizing [1, 10, 16, 16] where the matrices are the record's, else
    one group per (label, shape, dtype); the note, for the log, says how a model unlike the record's is grouped."""
    labels = [getattr(p, "label", None) for p in params]
    counts = collections.Counter(labels)
    if world_size == 8 and counts == NORMUON_RECORD_COUNTS:
        ordered = sorted(params, key=lambda p: list(NORMUON_RECORD_COUNTS).index(p.label))  # stable
        groups, start = [], 0
        for name, size in zip(("smear_gate", "attn_gate", "attn+mlp", "mlp"), NORMUON_RECORD_GROUP_SIZES):
            groups.append((name, ordered[start:start + size]))
            start += size
        return groups, ""
    keyed = {}
    for p, lab in zip(params, labels):
        keyed.setdefault((lab, tuple(p.shape), p.dtype), []).append(p)
    names = [str(lab) for (lab, _, _) in keyed]
    groups = []
    for (key, ps), name in zip(keyed.items(), names):
        if names.count(name) > 1:  # same label with several shapes/dtypes: disambiguate the name
            name = f"{name}:{'x'.join(map(str, key[1]))}:{str(key[2]).replace('torch.', '')}"
        groups.append((name, ps))
    if counts == NORMUON_RECORD_COUNTS:
        return groups, ""
    shown = lambda c: ", ".join(f"{k} {c[k]}" for k in sorted(c, key=str))
    return groups, (f"NorMuon: the matrices differ from the record's ({shown(counts)} here, "
                    f"{shown(NORMUON_RECORD_COUNTS)} there), so they are grouped by label and shape"
                    f"{' instead of the record sizing ' + str(NORMUON_RECORD_GROUP_SIZES) if world_size == 8 else ''}: "
                    + ", ".join(f"{name} ({len(ps)})" for name, ps in groups))

class NorMuon(torch.optim.Optimizer):
    """Muon with Polar Express orthogonalization, NorMuon row normalisation and cautious weight decay, as in the
    December 2025 record. Params are grouped (normuon_groups), and each group is split into W chunks of ceil(size/W)
    params: rank r updates chunk r. A group's params are the rows of one stack of chunk*W matrices (zero padding
    last), its gradients the rows of another (grad_buffers: the CUDA graphs accumulate there). step():
    reduce-scatter(AVG) each gradient stack into the rank's shard, update the rank's rows, all-gather the stack."""

    def __init__(self, params, lr=0.023, weight_decay=1.2, momentum=0.95, beta2=0.95, orthogonalizer="polar"):
        if orthogonalizer not in ("polar", "turbo"):
            raise ValueError(f"orthogonalizer must be 'polar' or 'turbo', got {orthogonalizer!r}")
        params = [p for p in params]
        if not params:
            raise ValueError("NorMuon got an empty parameter list")
        self.world_size, self.rank = _dist_world()
        self.turbo = orthogonalizer == "turbo"
        grouped, self.grouping_note = normuon_groups(params, self.world_size)
        super().__init__([dict(params=ps, label=name) for name, ps in grouped],
                         dict(lr=lr, weight_decay=weight_decay, momentum=momentum, beta2=beta2))
        self._orthogonalize_fn = polar_express
        self._second_moment_fn = normuon_second_moment
        self._cautious_update_fn = cautious_update
        # Static sharding layout, parallel to self.param_groups (param lists never change, also not on reload).
        W, r = self.world_size, self.rank
        self._layout = []
        self.grad_buffers = {}  # param -> its row of its group's gradient stack
        for group in self.param_groups:
            ps = group["params"]
            shape, dtype = ps[0].shape, ps[0].dtype
            for p in ps:
                assert p.shape == shape and p.dtype == dtype, \
                    f"NorMuon group {group['label']!r} mixes {tuple(p.shape)} {p.dtype} with {tuple(shape)} {dtype}"
            size = len(ps)
            chunk = -(-size // W)
            lo, hi = min(size, r * chunk), min(size, r * chunk + chunk)
            treatments = {getattr(p, "treatment", "matrix") for p in ps[lo:hi] or ps[:1]}  # unlabelled: matrices
            assert len(treatments) == 1 or "qkvo" not in treatments, \
                f"NorMuon rank {r} would stack qkvo matrices with others ({group['label']!r})"
            treatment = treatments.pop() if len(treatments) == 1 else "matrix"
            params_stack = torch.zeros((chunk * W, *shape), dtype=dtype, device=ps[0].device)
            grads_stack = torch.zeros_like(params_stack)
            for p, row, grad_row in zip(ps, params_stack, grads_stack):
                row.copy_(p.detach())
                p.data = row
                self.grad_buffers[p] = grad_row
            # the rank's rows of the averaged gradients (one rank: the gradient stack itself)
            shard = grads_stack[:chunk] if W == 1 else torch.empty_like(grads_stack[:chunk])
            self._layout.append(dict(chunk=chunk, lo=lo, hi=hi, is_attn=treatment == "qkvo",
                                     reduce_dim=normuon_reduce_dim(treatment, shape),
                                     params=params_stack, grads=grads_stack, shard=shard))

    def compile_helpers(self):
        """Route the per-shard math through torch.compile(dynamic=False) (CUDA); compilation happens on first use."""
        self._orthogonalize_fn = torch.compile(polar_express, dynamic=False, fullgraph=True)
        self._second_moment_fn = torch.compile(normuon_second_moment, dynamic=False, fullgraph=True)
        self._cautious_update_fn = torch.compile(cautious_update, dynamic=False, fullgraph=True)
        return self

    @torch.no_grad()
    def reset(self):
        """Zero all momentum and second-moment buffers (after the kernel warm-up)."""
        for group in self.param_groups:
            for key in ("momentum_buffer", "second_momentum_buffer"):
                if key in group:
                    group[key].zero_()

    def _update_shard(self, group, layout, grads: Tensor):
        """Update the rank's params group["params"][lo:hi] in place from their averaged grads (n, rows, cols)."""
        local = group["params"][layout["lo"]:layout["hi"]]
        n = len(local)
        rows, cols = grads.shape[-2:]
        beta = group["momentum"]
        if "momentum_buffer" not in group:
            group["momentum_buffer"] = torch.zeros_like(grads)
        buf = group["momentum_buffer"]
        buf.lerp_(grads, 1.0 - beta)
        u = grads.lerp(buf, beta)                        # (1-beta) g + beta M  (Nesterov-style)
        if layout["is_attn"]:
            u = u.view(4 * n, rows // 4, cols)           # Wq, Wk, Wv, Wo separately
        v = self._orthogonalize_fn(u, turbo=self.turbo)
        dim = layout["reduce_dim"]
        if "second_momentum_buffer" not in group:
            stat_shape = list(v.shape)
            stat_shape[dim] = 1
            # The param's dtype, as in the record: bf16 for the gates, fp32 for the attention and MLP matrices.
            group["second_momentum_buffer"] = torch.zeros(stat_shape, dtype=grads.dtype, device=v.device)
        v = self._second_moment_fn(v, group["second_momentum_buffer"], group["beta2"], dim)
        v = v.view(n, rows, cols)
        if "lr_eff" not in group:
            group["lr_eff"] = [torch.zeros((), dtype=torch.float32) for _ in range(n)]
            group["wd_eff"] = [torch.zeros((), dtype=torch.float32) for _ in range(n)]
        lr, wd = group["lr"], group["weight_decay"]
        for i, p in enumerate(local):
            group["lr_eff"][i].fill_(lr * normuon_lr_factor(p))
            group["wd_eff"][i].fill_(lr * wd * float(getattr(p, "wd_mul", 1.0)))
            self._cautious_update_fn(p, v[i], group["lr_eff"][i], group["wd_eff"][i])

    @torch.no_grad()
    def step(self):
        W, r = self.world_size, self.rank
        # (1) every group's reduce-scatter, gate groups first, from its gradient stack (where a gradient made
        # outside it, by an eager backward or by hand, is copied first)
        scatters = []
        for group, layout in zip(self.param_groups, self._layout):
            for p, row in zip(group["params"], layout["grads"]):
                if p.grad is None:
                    row.zero_()
                elif p.grad.data_ptr() != row.data_ptr():
                    row.copy_(p.grad)
            scatters.append(None if W == 1 else reduce_scatter(layout["shard"], layout["grads"],
                                                               op=dist.ReduceOp.AVG, async_op=True))
        # (2) per group: wait, update the rank's rows of the stack, all-gather the stack in place
        gathers = []
        for group, layout, work in zip(self.param_groups, self._layout, scatters):
            if work is not None:
                work.wait()
            n = layout["hi"] - layout["lo"]
            if n > 0:
                self._update_shard(group, layout, layout["shard"][:n])
            if W > 1:
                stack, chunk = layout["params"], layout["chunk"]
                gathers.append(all_gather(stack, stack[r * chunk:(r + 1) * chunk], async_op=True))
        for work in gathers:
            work.wait()

def adam_update(p: Tensor, g: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, step_size: Tensor,
                beta1: float, beta2: float, eps: float) -> None:
    """One bias-corrected Adam step on a param slice, in place (compiled: one kernel, not seven passes); step_size =
    lr*sqrt(1-b2^t)/(1-b1^t) comes as a 0-D CPU tensor, so a new value does not recompile."""
    exp_avg.mul_(beta1).add_(g, alpha=1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    # fp32 arithmetic and one rounding into p's dtype (what addcdiv_ does eagerly)
    p.copy_(p.float() - step_size * (exp_avg.float() / (exp_avg_sq.float().sqrt() + eps)))

def rows_per_rank(p: Tensor, world_size: int) -> int:
    """DistAdam's shard of a parameter: ceil(rows / W) rows per rank (a 0-D parameter is one row)."""
    return -(-max(p.shape[0] if p.dim() else 1, 1) // world_size)

def as_rows(t: Tensor) -> Tensor:
    return t if t.dim() else t.view(1)

class DistAdam(torch.optim.Optimizer):
    """ZeRO-1 Adam without weight decay (the record's): rank r keeps the state of, and updates, rows [r*k, (r+1)*k)
    of each param (k = rows_per_rank; a param whose rows do not divide by W is padded with zero rows in DistAdam's
    own buffers, as the record padded its scalars), then all-gathers it. While `should_sync` is set (the last backward
    before a step()), a post-accumulate-grad hook reduce-scatters (AVG) each gradient into a buffer as long-lived as
    the optimizer, so a CUDA graph that captured it writes the same addresses at every replay. step() updates the
    params with a pending reduce-scatter (one process: those with a p.grad)."""

    def __init__(self, params, lr=0.008, betas=(0.65, 0.95), eps=1e-8):
        params = [p for p in params]
        if not params:
            raise ValueError("DistAdam got an empty parameter list")
        self.world_size, self.rank = _dist_world()
        buckets = {}
        for p in params:
            buckets.setdefault(getattr(p, "label", None), []).append(p)
        order = [lab for lab in DISTADAM_RECORD_ORDER if lab in buckets] + \
            [lab for lab in buckets if lab not in DISTADAM_RECORD_ORDER]
        super().__init__([dict(params=buckets[lab], label=lab or "other") for lab in order],
                         dict(lr=lr, betas=tuple(betas), eps=eps))
        self.should_sync = False
        self._pending = {}      # param -> its reduce-scatter's async work, or None once the stream waits for it
        self._grad_slices = {}  # param -> this rank's slice of its averaged gradient
        self._padded = {}       # param whose rows do not divide by W -> (its gradient, its value) padded to k*W rows
        self._update_fn = adam_update
        self._step_size = torch.zeros((), dtype=torch.float32)  # CPU scalar fed to the (compiled) update
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_hook) for p in params]

    def compile_helpers(self):
        """Route the per-param update through torch.compile(dynamic=False) (CUDA), as the record does."""
        self._update_fn = torch.compile(adam_update, dynamic=False, fullgraph=True)
        return self

    def _rows(self, p: Tensor) -> Tensor:
        """p as the rows DistAdam shards: p itself, or its padded copy."""
        return self._padded[p][1] if p in self._padded else as_rows(p)

    def _slice_rows(self, p: Tensor) -> tuple[int, int]:
        rows = rows_per_rank(p, self.world_size)
        return self.rank * rows, (self.rank + 1) * rows

    @torch.no_grad()
    def _grad_hook(self, p: Tensor):
        if not self.should_sync or self.world_size == 1 or p.grad is None:
            return
        grad = as_rows(p.grad)
        if p not in self._grad_slices:
            lo, hi = self._slice_rows(p)
            self._grad_slices[p] = grad.new_empty((hi - lo, *grad.shape[1:]))
            if (hi - lo) * self.world_size != grad.shape[0]:
                padded = grad.new_zeros(((hi - lo) * self.world_size, *grad.shape[1:]))
                self._padded[p] = (padded, torch.zeros_like(padded, dtype=p.dtype))
        if p in self._padded:
            self._padded[p][0][:grad.shape[0]].copy_(grad)
            grad = self._padded[p][0]
        self._pending[p] = reduce_scatter(self._grad_slices[p], grad, op=dist.ReduceOp.AVG, async_op=True)

    def join_reduce_scatters(self) -> list:
        """Make the current stream wait for every pending reduce-scatter (inside a CUDA graph's capture this joins
        NCCL's stream back into the graph); returns their params."""
        for p, work in self._pending.items():
            if work is not None:
                work.wait()
                self._pending[p] = None
        return list(self._pending)

    def reduce_scatters_replayed(self, params: list) -> None:
        """A replayed CUDA graph ran these params' reduce-scatters on the current stream: step() may use them."""
        self._pending.update(dict.fromkeys(params))

    @torch.no_grad()
    def step(self):
        distributed = self.world_size > 1
        gathers, stepped = [], []
        for group in self.param_groups:
            lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
            for p in group["params"]:
                if distributed:
                    if p not in self._pending:
                        continue
                    work = self._pending.pop(p)
                    if work is not None:
                        work.wait()
                    g = self._grad_slices[p]
                elif p.grad is None:
                    continue
                else:
                    g = as_rows(p.grad)
                rows = self._rows(p)
                if p in self._padded:  # the padded copy: the param's current value first
                    rows[:as_rows(p).shape[0]].copy_(as_rows(p))
                    stepped.append(p)
                lo, hi = self._slice_rows(p)
                p_slice = rows[lo:hi]
                lr_p = lr * float(getattr(p, "lr_mul", 1.0))
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p_slice), exp_avg_sq=torch.zeros_like(p_slice))
                state["step"] += 1
                t = state["step"]
                self._step_size.fill_(lr_p * math.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t))
                self._update_fn(p_slice, g, state["exp_avg"], state["exp_avg_sq"], self._step_size, beta1, beta2, eps)
                if distributed:
                    gathers.append(all_gather(rows, p_slice, async_op=True))
        for work in gathers:
            work.wait()
        for p in stepped:  # their gathered rows back, without the padding
            as_rows(p).copy_(self._padded[p][1][:as_rows(p).shape[0]])
        self._pending.clear()

def check_optimizer_labels(model: nn.Module, world_sizes=(1, 2, 4, 8)) -> None:
    """Every parameter's label and treatment (set_optimizer_label) can work, at each world size: one ConfigError
    naming the parameter otherwise."""
    names = {id(p): n for n, p in model.named_parameters()}
    seen = {}  # label -> (treatment, the first parameter with it)
    for name, p in model.named_parameters():
        label, treatment = getattr(p, "label", None), getattr(p, "treatment", None)
        if label is None or treatment not in TREATMENTS:
            missing = "no optimizer label" if label is None else f"label {label!r} but no treatment"
            raise ConfigError(f"parameter {name} has {missing}: give it both where it is made, "
                              "set_optimizer_label(p, LABEL, TREATMENT), LABEL naming its group and TREATMENT one of "
                              + "; ".join(f"{k} ({v})" for k, v in TREATMENTS.items()))
        if seen.setdefault(label, (treatment, name))[0] != treatment:
            raise ConfigError(f"parameter {name} has label {label!r} as {treatment}, but {seen[label][1]} has it "
                              f"as {seen[label][0]}: a label is one group with one treatment; give one of them another "
                              "label")
        if treatment != "adam" and p.dim() != 2:
            raise ConfigError(f"parameter {name} of shape {tuple(p.shape)} is treated as {treatment}, but NorMuon "
                              "takes 2-D matrices: make it one, or treat it as adam")
        if treatment == "qkvo" and p.shape[0] != 4 * p.shape[1]:
            raise ConfigError(f"parameter {name} is treated as qkvo, but its shape {tuple(p.shape)} is not (4d, d), "
                              "Q, K, V and O stacked")
    matrices = [p for p in model.parameters() if p.treatment != "adam"]
    for world_size in world_sizes:
        for group, ps in normuon_groups(matrices, world_size)[0]:
            chunk = -(-len(ps) // world_size)
            for r in range(world_size):
                shard = ps[r * chunk:(r + 1) * chunk]
                if len({p.treatment for p in shard}) > 1 and any(p.treatment == "qkvo" for p in shard):
                    qkvo = next(p for p in shard if p.treatment == "qkvo")
                    raise ConfigError(f"on {world_size} processes, NorMuon's rank {r} would stack parameter "
                                      f"{names[id(qkvo)]} (qkvo) with matrices of another treatment in group "
                                      f"{group}: give them labels of their own")

def build_optimizers(model: GPT, args: Hyperparameters):
    """NorMuon for the matrices and gates, DistAdam for the rest, by each parameter's label (set_optimizer_label)."""
    check_optimizer_labels(model, world_sizes=(_dist_world()[0],))
    names = {id(p): n for n, p in model.named_parameters()}
    muon_params = [p for p in model.parameters() if p.treatment != "adam"]
    muon_params.sort(key=lambda p: p.treatment == "gate")  # matrices first, then the gates
    adam_params = [p for p in model.parameters() if p.treatment == "adam"]
    adam = DistAdam(adam_params, lr=args.adam_lr, betas=args.adam_betas, eps=args.adam_eps)
    muon = NorMuon(muon_params, lr=args.muon_lr, weight_decay=args.muon_weight_decay,
                   momentum=args.muon_momentum_warmup[0], beta2=args.muon_beta2, orthogonalizer=args.orthogonalizer)
    muon.names = [names[id(p)] for p in muon_params]
    for opt in (adam, muon):
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"]
    return adam, muon


# =====================================================================================
# Data
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
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):  # a FIFO would block the read below for ever
            raise ShardError(f"shard {path} is not a regular file (a folder, FIFO or device): move it out of the data "
                             "folder or narrow --train-files/--val-files")
        size = info.st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_INTS * 4)
    except OSError as e:
        raise ShardError(f"cannot read shard {path}: {e.strerror}") from None
    if len(raw) < HEADER_INTS * 4:
        raise ShardError(f"shard {path} is shorter than its 1024-byte header ({size} bytes): re-download or rebuild it")
    header = np.frombuffer(raw, dtype="<i4")
    if header[0] != SHARD_MAGIC or header[1] != SHARD_VERSION:
        raise ShardError(f"shard {path} has magic {header[0]} version {header[1]}, expected {SHARD_MAGIC} "
                         f"version {SHARD_VERSION}: not a speedrun token shard")
    num_tokens = int(header[2])
    expected = HEADER_INTS * 4 + 2 * num_tokens
    if size != expected:
        raise ShardError(f"shard {path} is {size} bytes but its header promises {num_tokens} tokens "
                         f"({expected} bytes): truncated or corrupt, re-download or rebuild it")
    return num_tokens

SCAN_CHUNK_TOKENS = 1 << 24

def scan_shard(path, vocab_size: int) -> tuple[int, np.ndarray]:
    """What a shard's header cannot show, in one vectorised pass: every token id below vocab_size, 16-bit tokens (not
    32-bit ones under a header that counts twice as many: every other id would be 0) and the <|endoftext|> token
    that starts every document. Returns (its token count, where its documents start)."""
    num_tokens = read_shard_header(path)
    tokens = np.memmap(path, dtype="<u2", mode="r", offset=HEADER_INTS * 4, shape=(num_tokens,)) if num_tokens else None
    starts, odd_ids_nonzero = [], False
    for start in range(0, num_tokens, SCAN_CHUNK_TOKENS):
        chunk = tokens[start:start + SCAN_CHUNK_TOKENS]
        if int(chunk.max()) >= vocab_size:
            where = start + int(np.argmax(chunk >= vocab_size))
            raise ShardError(f"shard {path} holds token id {int(tokens[where])} at position {where}, not below "
                             f"--vocab-size {vocab_size}: rebuild it with this tokenizer, or raise --vocab-size")
        starts.append(np.flatnonzero(chunk == BOS_ID) + start)
        odd_ids_nonzero = odd_ids_nonzero or bool(chunk[1::2].any())  # chunks start at even positions
    if num_tokens >= 2 * HEADER_INTS and not odd_ids_nonzero:
        raise ShardError(f"shard {path}: every other token id is 0 (32-bit tokens read as 16-bit ones, or no text at "
                         "all): the format holds uint16 GPT-2 tokens, as data/fineweb.py writes them")
    if not any(len(s) for s in starts):
        raise ShardError(f"shard {path} holds no <|endoftext|> ({BOS_ID}), which starts every document: rebuild it "
                         "with data/fineweb.py")
    return num_tokens, np.concatenate(starts)

FEED_CHECK_LIMIT = 2_000_000  # micro-batches the data check follows at most (a longer schedule: tokens only)

def data_runs_out_at(args: Hyperparameters, runtime: "Runtime", shards: list) -> int | None:
    """The step at which the training shards ((token count, document starts) each), cycled --train-epochs times, run
    out as the loader takes them, or None if they last the schedule. Each rank's micro-batch takes whole documents,
    each cut at --train-max-seq-len, the last one cut where the micro-batch is full and its rest dropped; a step's
    micro-batches that no longer fit in a shard move to the next one."""
    capped = [np.concatenate([[0], np.cumsum(np.minimum(np.diff(starts, append=n), args.train_max_seq_len))])
              for n, starts in shards]  # tokens the first k documents give
    shard, doc, followed = 0, 0, 0
    table = stages(args)
    ends = [s.first_step for s in table[1:]] + [args.num_iterations]
    for stage, end in zip(table, ends):
        # a rank's micro-batch, plus its last target
        need = tokens_per_micro_batch(stage.batch_size, runtime.grad_accum_steps, runtime.world_size) + 1
        for step in range(stage.first_step, min(end, args.num_iterations)):
            for _ in range(runtime.grad_accum_steps):  # the ranks' micro-batches come from one shard together
                while True:
                    given, d = capped[shard % len(shards)], doc
                    for _ in range(runtime.world_size):
                        d = int(np.searchsorted(given, given[d] + need))
                        if d >= len(given):
                            break
                    else:
                        doc = d
                        break
                    shard, doc = shard + 1, 0
                    if shard >= len(shards) * args.train_epochs:
                        return step
            followed += runtime.grad_accum_steps
            if followed > FEED_CHECK_LIMIT:
                return None
    return None

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

def in_background(fn, *args) -> concurrent.futures.Future:
    """fn(*args) on a thread of its own (shard reads, BOS scans); .result() waits and re-raises its error."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="speedrun-data")
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)  # the thread ends with its one task
    return future

def find_bos(tokens: Tensor) -> np.ndarray:
    return np.flatnonzero(tokens.numpy() == BOS_ID)

class DataExhausted(RuntimeError):
    """The training files ran out before the schedule ended."""

class BOSFinder:
    """BOS-aligned per-rank batches of one shard (documents cut at max_seq_len, a rank's last where it has L+1 tokens),
    all ranks' from one shared cursor in rank order, so every process sees the same cut."""
    QUICK_SCAN_TOKENS, QUICK_SCAN_BATCHES = 4_000_000, 5

    def __init__(self, tokens: Tensor, world_size: int, quickload: bool = False):
        self.tokens, self.world_size, self.i = tokens, world_size, 0
        if quickload and len(tokens) > self.QUICK_SCAN_TOKENS:
            # Start training from a partial index at once; the full scan runs in a background thread.
            self.bos_idx = find_bos(tokens[:self.QUICK_SCAN_TOKENS])
            self._partial_end = self.QUICK_SCAN_TOKENS
            self._full_index = in_background(find_bos, tokens)
            self._batches_left_on_partial = self.QUICK_SCAN_BATCHES
        else:
            self.bos_idx = find_bos(tokens)
            self._partial_end = None

    def _switch_to_full_index(self):
        self.bos_idx, self._partial_end = self._full_index.result(), None

    def next_batch(self, num_tokens: int, max_seq_len: int) -> list:
        """Per rank, a list of (start, end) token ranges totalling num_tokens + 1. Raises StopIteration
        when the shard has too few documents left (the partial batch is dropped)."""
        if self._partial_end is not None:
            if self._batches_left_on_partial == 0:
                self._switch_to_full_index()
            else:
                self._batches_left_on_partial -= 1
        ranks = []
        i, bos, n = self.i, self.bos_idx, len(self.tokens)
        for _ in range(self.world_size):
            ranges, filled = [], 0
            while filled < num_tokens + 1:
                if i >= len(bos) or (self._partial_end is not None and i + 1 >= len(bos)):
                    if self._partial_end is not None:  # ran off the partial index: finish the scan, retry
                        self._switch_to_full_index()
                        return self.next_batch(num_tokens, max_seq_len)
                    raise StopIteration
                start = int(bos[i])
                next_bos = int(bos[i + 1]) if i + 1 < len(bos) else n
                end = min(next_bos, start + max_seq_len, start + num_tokens + 1 - filled)
                ranges.append((start, end))
                filled += end - start
                i += 1
            ranks.append(ranges)
        self.i = i
        return ranks

def max_num_docs_for(num_tokens: int) -> int:
    """Fixed cu_seqlens length (keeps compiled shapes static); the median document is ~400 tokens."""
    return next_multiple_of(max(num_tokens // 300, 1), 128)

def pack_cu_seqlens(lengths: list, num_tokens: int, max_num_docs: int) -> Tensor:
    if len(lengths) + 1 > max_num_docs:
        raise DataExhausted(f"a batch of {num_tokens} tokens holds {len(lengths)} documents, more than the "
                            f"{max_num_docs - 1} that cu_seqlens has room for")
    cu = np.full(max_num_docs, num_tokens, dtype=np.int32)
    cu[0] = 0
    cu[1:len(lengths) + 1] = np.cumsum(lengths)
    return torch.from_numpy(cu)

class ShardLoader:
    """Iterates over shard files (cycled `epochs` times); reads the next shard and indexes its BOS tokens
    in a background thread while the current one is in use."""

    def __init__(self, files: list, world_size: int, epochs: int = 1, pin_memory: bool = False):
        self.files, self.passes = files, len(files) * epochs  # shard k of the run is files[k % len(files)]
        self.world_size, self.pin_memory = world_size, pin_memory
        self.next_file = 0
        self._next = None  # the next shard's (tokens, BOSFinder), loading in the background

    def _load(self, path, quickload):
        tokens = load_data_shard(path, self.pin_memory)
        return tokens, BOSFinder(tokens, self.world_size, quickload=quickload)

    def _start_preload(self):
        if self.next_file < self.passes:
            self._next = in_background(self._load, self.files[self.next_file % len(self.files)], False)
            self.next_file += 1
        else:
            self._next = None

    def first(self):
        if not self.passes:
            raise DataExhausted("no training files")
        self.next_file = 1
        current = self._load(self.files[0], quickload=True)
        self._start_preload()
        return current

    def advance(self):
        if self._next is None:
            raise DataExhausted(f"the training data ran out after {self.passes} shard(s): use more shards or "
                                "--train-epochs N to cycle over them, or shorten the schedule")
        current = self._next.result()  # a loading error is raised here, in the training thread
        self._start_preload()
        return current

def to_device(batch: tuple, device: str) -> tuple:
    """Asynchronous copies of a micro-batch from pinned memory: a plain DMA queued behind the running kernels (from
    pageable memory the driver stages the copy and may wait on the stream)."""
    return tuple(t.pin_memory().to(device, non_blocking=True) if device == "cuda" else t.to(device) for t in batch)

def tokens_per_micro_batch(batch_size: int, grad_accum_steps: int, world_size: int) -> int:
    """A rank's tokens per micro-batch: the global batch split over every micro-batch of every rank."""
    if batch_size % (grad_accum_steps * world_size):
        raise ConfigError(f"batch size {batch_size} is not divisible by grad_accum_steps x world_size "
                          f"({grad_accum_steps} x {world_size})")
    return batch_size // (grad_accum_steps * world_size)

def distributed_data_generator(files: list, batch_size: int, max_seq_len: int, grad_accum_steps: int,
                               rank: int, world_size: int, epochs: int = 1, device: str = "cpu"):
    """Yields (inputs int32, targets int64, cu_seqlens int32) for this rank's next micro-batch. .send(None) keeps the
    settings, .send((batch_size, max_seq_len, grad_accum_steps)) changes them for the batch it returns."""
    loader = ShardLoader(files, world_size, epochs, pin_memory=(device == "cuda"))
    tokens, finder = loader.first()
    while True:
        num_tokens = tokens_per_micro_batch(batch_size, grad_accum_steps, world_size)
        while True:
            try:
                ranges = finder.next_batch(num_tokens, max_seq_len)[rank]
                break
            except StopIteration:
                tokens, finder = loader.advance()
        buf = torch.cat([tokens[s:e] for s, e in ranges])
        lengths = [e - s for s, e in ranges]
        lengths[-1] -= 1  # the last token is only a target
        cu = pack_cu_seqlens(lengths, num_tokens, max_num_docs_for(num_tokens))
        new = yield to_device((buf[:-1].to(torch.int32), buf[1:].to(torch.int64), cu), device)
        if new is not None:
            batch_size, max_seq_len, grad_accum_steps = new

def validation_batches(path, val_batch_size: int, val_tokens: int, grad_accum_steps: int, rank: int,
                       world_size: int, device: str = "cpu"):
    """The first val_tokens of the validation shard, contiguous (not BOS-aligned), G micro-batches per step."""
    tokens = load_data_shard(path)
    num_tokens = tokens_per_micro_batch(val_batch_size, grad_accum_steps, world_size)
    max_docs = max_num_docs_for(num_tokens)
    for step in range(grad_accum_steps * val_tokens // val_batch_size):
        start = step * num_tokens * world_size + rank * num_tokens
        buf = tokens[start:start + num_tokens + 1]
        inputs = buf[:-1]
        starts = np.flatnonzero(inputs.numpy() == BOS_ID)
        lengths = np.diff(np.concatenate([[0], starts[starts > 0], [num_tokens]])).tolist()
        cu = pack_cu_seqlens(lengths, num_tokens, max_docs)
        yield to_device((inputs.to(torch.int32), buf[1:].to(torch.int64), cu), device)

def tokens_needed(args: Hyperparameters) -> int:
    """Training tokens the whole schedule consumes: each stage's batch size times its steps."""
    table, total = stages(args), args.num_iterations
    ends = [s.first_step for s in table[1:]] + [total]
    return sum(s.batch_size * max(0, min(end, total) - s.first_step) for s, end in zip(table, ends))

def find_data(args: Hyperparameters, runtime: "Runtime", scan: bool = True):
    """Check the data before any process group exists or any file is written. Every rank reads the same shards, so a
    problem is a ConfigError (reported once, by rank 0). scan: every token of every shard too (not where ./run.sh
    launch has run --check before the workers, or once more when build_trainer looks the shards up again)."""
    folder = Path(args.data_path)
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"--data-path {folder} is a file: give the folder that holds the shards")
    if not folder.is_dir():
        raise ConfigError(f"data folder {folder} does not exist: run `python data/cached_fineweb10B.py 9` "
                          "(FineWeb) or `./run.sh proxy` and pass --data-path data/proxy")
    # The folder is taken literally (its '[', '*' or '?' are no pattern); the file patterns are globs inside it.
    train_files = sorted(glob.glob(os.path.join(glob.escape(str(folder)), args.train_files)))
    val_files = sorted(glob.glob(os.path.join(glob.escape(str(folder)), args.val_files)))
    if not train_files or not val_files:
        raise ConfigError(f"no {'training' if not train_files else 'validation'} shards matching "
                          f"{folder / (args.train_files if not train_files else args.val_files)}: "
                          "download or build them first (see README)")
    real_val = {os.path.realpath(f): f for f in val_files}
    both = [f for f in train_files if os.path.realpath(f) in real_val]
    if both:
        raise ConfigError(f"{both[0]} matches both --train-files {args.train_files!r} and --val-files "
                          f"{args.val_files!r}: training on the validation data would void the metric; narrow them")
    try:
        if scan:
            shards = [scan_shard(f, args.vocab_size) for f in train_files]
            train_tokens = sum(n for n, _ in shards)
            val_tokens = scan_shard(val_files[0], args.vocab_size)[0]
        else:
            train_tokens = sum(read_shard_header(f) for f in train_files)
            val_tokens = read_shard_header(val_files[0])
    except ShardError as e:
        raise ConfigError(str(e)) from None
    needed = tokens_needed(args)
    if train_tokens * args.train_epochs < needed:
        raise ConfigError(f"too little training data: the schedule consumes {needed:,} tokens but "
                          f"{len(train_files)} shard(s) x {args.train_epochs} epoch(s) hold "
                          f"{train_tokens * args.train_epochs:,}; add shards or raise --train-epochs")
    if val_tokens < args.val_tokens + 1:
        raise ConfigError(f"validation shard {val_files[0]} holds {val_tokens:,} tokens, fewer than "
                          f"--val-tokens {args.val_tokens:,} + 1: lower --val-tokens (and --val-batch-size)")
    for bs in (*args.train_bs_schedule, args.train_bs_extension, args.val_batch_size):
        tokens_per_micro_batch(bs, runtime.grad_accum_steps, runtime.world_size)
    if scan and (out_at := data_runs_out_at(args, runtime, shards)) is not None:
        raise ConfigError(f"too little training data: taking whole documents for each micro-batch (cut at "
                          f"--train-max-seq-len {args.train_max_seq_len}), the loader runs out at step {out_at} of "
                          f"{args.num_iterations} with {len(train_files)} shard(s) x {args.train_epochs} epoch(s); add "
                          "shards or raise --train-epochs")
    return train_files, val_files[0]


# =====================================================================================
# Schedules
# =====================================================================================

# The record's formulas, written so that every schedule length gives what the record's script would give:
# the same float expressions (x = step / N, int(len * x)), the same comparisons, the same precedence.

@dataclass(frozen=True)
class Stage:
    """One batch-size/window stage: the scheduled stages, then the extension."""
    name: str          # "stage 1".."stage K" or "extension"
    first_step: int
    batch_size: int    # global tokens per step
    ws_short: int      # attention windows in blocks of block_size: the short window is half the long one
    ws_long: int

def stage_index(step: int, args: Hyperparameters) -> int:
    """Index into stages(args): int(K * step / N) for the scheduled steps, K for the extension."""
    N, k = args.num_scheduled_iterations, len(args.train_bs_schedule)
    return k if step >= N else int(k * (step / N))

def make_stage(i: int, args: Hyperparameters) -> Stage:
    """Stage i of stages(args), without building the others."""
    N, k = args.num_scheduled_iterations, len(args.train_bs_schedule)
    if i == k:
        return Stage("extension", N, args.train_bs_extension, args.ws_final // 2, args.ws_final)
    first = -(-i * N // k)  # about where int(k * step / N) reaches i; the float rounding decides the exact step
    while first > 0 and stage_index(first - 1, args) >= i:
        first -= 1
    while stage_index(first, args) < i:
        first += 1
    long = args.ws_schedule[i]
    return Stage(f"stage {i + 1}", first, args.train_bs_schedule[i], long // 2, long)

def stages(args: Hyperparameters) -> list:
    """The stage table used by the schedules, the kernel warm-up and the benchmark."""
    return [make_stage(i, args) for i in range(len(args.train_bs_schedule) + 1)]

def eval_windows(args: Hyperparameters) -> list:
    """(short, long) window pairs validation runs with: each stage's, then the final one (long window widened
    without another YaRN update)."""
    table = stages(args)
    return [(s.ws_short, s.ws_long) for s in table] + [(table[-1].ws_short, args.ws_validate_post_yarn_ext)]

def stage_at(step: int, args: Hyperparameters) -> Stage:
    return make_stage(stage_index(step, args), args)

def get_lr(step: int, args: Hyperparameters) -> float:
    """Multiplier on every group's initial lr: a plateau that rises with the batch size, then a linear
    cooldown to lr_floor over the last cooldown_frac of the scheduled steps; lr_floor in the extension."""
    if step > args.num_scheduled_iterations:
        return args.lr_floor
    x = step / args.num_scheduled_iterations
    plateau = args.lr_plateaus[0]
    for start, value in zip(args.lr_plateau_starts[1:], args.lr_plateaus[1:]):
        if x > start:
            plateau = value
    if x >= 1 - args.cooldown_frac:
        w = (1 - x) / args.cooldown_frac
        return plateau * w + (1 - w) * args.lr_floor
    return plateau

def get_muon_momentum(step: int, args: Hyperparameters) -> float:
    """Warm-up ramp over the first steps, then flat, then a cool-down over the last steps of the run. The
    warm-up wins where the two overlap, so a run of at most warm-up length never leaves the ramp."""
    w_from, w_to, w_steps = args.muon_momentum_warmup
    c_from, c_to, c_steps = args.muon_momentum_cooldown
    cooldown_start = args.num_iterations - c_steps
    if step < w_steps:
        return w_from + (step / w_steps) * (w_to - w_from)
    if step > cooldown_start:
        return c_from - ((step - cooldown_start) / c_steps) * (c_from - c_to)
    return w_to

def schedule_line(step: int, args: Hyperparameters) -> str:
    """What the schedules say at a step: logged at each stage switch."""
    s = stage_at(step, args)
    return (f"schedule: step {step} {s.name}: batch {s.batch_size} windows ({s.ws_short}, {s.ws_long}) "
            f"lr x{get_lr(step, args):.4f} muon momentum {get_muon_momentum(step, args):.4f}")


# =====================================================================================
# The training step and loop
# =====================================================================================

@dataclass(frozen=True)
class RunResult:
    steps: int
    val_loss: float           # the final validation's
    train_time_ms: float      # the timed loop's clock at the final validation

TARGET_VAL_LOSS = 3.28

def summary_line(args: Hyperparameters, runtime: "Runtime", result: RunResult) -> str:
    """The log's last line: what a reader (or records/compare.py) wants first."""
    allocated, reserved, pool = peak_memory(runtime.device)
    memory = (f"peak_memory {allocated} MiB allocated, {reserved} MiB reserved ({pool} MiB graphs' pool)"
              if runtime.device == "cuda" else "peak_memory n/a (cpu)")
    return (f"summary: val_loss {result.val_loss:.4f} at step {result.steps}, train_time "
            f"{result.train_time_ms / 1000:.3f}s, step_avg {result.train_time_ms / max(result.steps, 1):.2f}ms, "
            f"{memory}, target {TARGET_VAL_LOSS} {'reached' if result.val_loss <= TARGET_VAL_LOSS else 'not reached'}")

class RunStopped(BaseException):
    """The run ends early with a message for the log's last line and an exit status (no traceback). Not an Exception,
    as KeyboardInterrupt is not: raised from a signal handler, it must pass through library code that catches those
    (a lazy import of Dynamo does)."""
    status = 1

    def last_line(self, where: str) -> str:
        return str(self)

class TrainingDiverged(RunStopped):
    status = 3

class Interrupted(RunStopped):
    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.status = 128 + signum

    def last_line(self, where: str) -> str:
        return f"{self} {where}"

class GraphsDiffer(RunStopped):
    """--cuda-graphs check: a CUDA graph's loss differs from the same micro-batch's eager loss."""
    status = 2

class PeerGone(RunStopped):
    """A collective failed because another rank ended: that rank's own output (or the launcher) says why."""
    status = 5

    def last_line(self, where: str) -> str:
        return f"stopped {where}: another rank has ended (a collective failed)"

class LauncherDied(RunStopped):
    """The process that started this worker died (LAUNCHER_DIED, the parent-death signal)."""
    status = 128 + LAUNCHER_DIED

    def last_line(self, where: str) -> str:
        return f"stopped {where}: the launcher died"

class BatchStream:
    """The data generator, primed on first use."""
    def __init__(self, generator):
        self.generator, self.started = generator, False

    def get(self, settings=None):
        if not self.started:
            self.started = True
            return next(self.generator)  # the generator was created with the first settings
        return self.generator.send(settings)

@dataclass
class Trainer:
    args: Hyperparameters
    runtime: "Runtime"
    model: GPT                 # compiled per region (GPT.compile_regions) or plain
    adam: object
    muon: object
    train_files: list
    val_file: str
    log: "Logger"
    graphs: "MicroBatchGraphs" = None   # --cuda-graphs: the training micro-batches as CUDA graphs

    def console(self, text: str):
        if self.log.master:
            print(text, flush=True)

    def new_batches(self, batch_size: int) -> BatchStream:
        a, r = self.args, self.runtime
        return BatchStream(distributed_data_generator(self.train_files, batch_size, a.train_max_seq_len,
                                                      r.grad_accum_steps, r.rank, r.world_size, a.train_epochs,
                                                      r.device))

    def train_step(self, step: int, batches: BatchStream, settings, ws_short: int, ws_long: int,
                   micro_batches: int) -> Tensor:
        """One training step: every micro-batch's forward and backward, the gradients summed in .grad, then the
        optimizers. NorMuon steps every step; DistAdam every other step, on the gradients summed over two steps (on
        those steps the last backward's gradient hooks start its reduce-scatters). settings: the data generator's
        new (batch size, ...) at a stage switch, else None. Returns the last micro-batch's loss."""
        adam_steps = step % 2 == 1
        for micro in range(micro_batches):
            batch = batches.get(settings if micro == 0 else None)
            self.adam.should_sync = adam_steps and micro == micro_batches - 1
            loss = self.micro_batch(batch, ws_short, ws_long, micro_batches)
        self.adam.should_sync = False
        if adam_steps:
            self.adam.step()
        self.muon.step()
        (self.model if adam_steps else self.muon).zero_grad(set_to_none=True)
        return loss

    def graphs_against_eager(self, step: int, stage: "Stage") -> None:
        """--cuda-graphs check, at a stage's first step: one of its micro-batches replayed as its CUDA graph and run
        eagerly, from the same weights. A value the forward reads that has changed since the capture (a Python
        number is frozen into the graph) makes their losses differ: the run stops, saying so. The gradients and
        the data stream are left as they were."""
        batch = self.new_batches(stage.batch_size).get()
        params = list(self.model.parameters())
        before = [None if p.grad is None else p.grad.clone() for p in params]
        n = self.runtime.grad_accum_steps
        graphed = self.graphs.run(batch, stage.ws_short, stage.ws_long, n, self.forward_backward).clone()
        eager = self.forward_backward(*batch, stage.ws_short, stage.ws_long, n)
        for p, g in zip(params, before):  # in place where both exist: the graphs hold the gradient buffers
            p.grad = g if g is None or p.grad is None else p.grad.copy_(g)
        if not torch.equal(graphed, eager):
            raise GraphsDiffer(f"stopped at step {step}: {stage.name}'s CUDA graph gives loss {graphed.item():.6f} "
                               f"and eager {eager.item():.6f}: the forward reads a value that changed since the graphs "
                               f"were captured (README: Changing the model)")
        self.log(f"cuda graphs check: {stage.name} at step {step}: graph and eager loss {eager.item():.6f}",
                 console=False)

    def micro_batch(self, batch: tuple, ws_short: int, ws_long: int, micro_batches: int) -> Tensor:
        """One micro-batch's forward and backward: its CUDA graph replayed, or run eagerly. Returns its loss."""
        if self.graphs is not None:
            return self.graphs.run(batch, ws_short, ws_long, micro_batches, self.forward_backward)
        return self.forward_backward(*batch, ws_short, ws_long, micro_batches)

    def forward_backward(self, inputs, targets, cu_seqlens, ws_short: int, ws_long: int, divisor) -> Tensor:
        """One micro-batch's loss / divisor (micro-batches per step, a number or a 0-D tensor) backward."""
        with self.cpu_gemms():
            loss = self.model(inputs, targets, cu_seqlens, ws_short, ws_long, self.args.train_max_seq_len)
            (loss / divisor).backward()
        return loss.detach()

    def cpu_gemms(self):
        """Where the model's GEMMs run in fp32 (a CPU without native bf16 GEMMs), else nothing."""
        return bf16_gemms_in_fp32() if self.runtime.bf16_gemms_in_fp32 else contextlib.nullcontext()

    def set_schedules(self, step: int):
        lr = get_lr(step, self.args)
        for opt in (self.adam, self.muon):
            for group in opt.param_groups:
                group["lr"] = group["initial_lr"] * lr
        for group in self.muon.param_groups:
            group["momentum"] = get_muon_momentum(step, self.args)

    @torch.no_grad()
    def evaluate(self, ws_short: int, ws_long: int, max_steps: int = None) -> float:
        a, r = self.args, self.runtime
        self.model.eval()
        num_tokens = tokens_per_micro_batch(a.val_batch_size, r.grad_accum_steps, r.world_size)
        total, steps = torch.zeros((), device=r.device), 0
        for inputs, targets, cu_seqlens in validation_batches(self.val_file, a.val_batch_size, a.val_tokens,
                                                              r.grad_accum_steps, r.rank, r.world_size, r.device):
            with self.cpu_gemms():
                total += self.model(inputs, targets, cu_seqlens, ws_short, ws_long, num_tokens)
            steps += 1
            if max_steps is not None and steps >= max_steps:
                break
        total /= steps
        if dist.is_initialized():
            dist.all_reduce(total)  # SUM then divide: gloo has no AVG all-reduce
            total /= r.world_size
        self.model.train()
        return total.item()

    def warm_up_kernels(self):
        """Untimed: each stage eagerly (it compiles and makes every lazily made state), then with CUDA graphs each
        stage again, captured into the graphs' pool after the eager blocks are released (so they never hold memory
        at the same time), then every validation window; last, the initial weights and optimizer states return."""
        a = self.args
        self.warm_up_times = []  # (label, seconds): where the cold start goes
        initial = copy.deepcopy(dict(model=self.model.state_dict(),
                                     opts=[opt.state_dict() for opt in (self.adam, self.muon)]))
        graphs, self.graphs = self.graphs, None
        for kind, steps in [("eager", 2)] + ([("graphs", a.warmup_steps_per_stage)] if graphs is not None else []):
            self.graphs = graphs if kind == "graphs" else None
            batches = self.new_batches(stages(a)[0].batch_size)
            for stage in stages(a):
                t = time.time()
                self.model.yarn.set_window(stage.ws_long)
                for k in range(steps):
                    self.train_step(k, batches, (stage.batch_size, a.train_max_seq_len, self.runtime.grad_accum_steps),
                                    stage.ws_short, stage.ws_long, micro_batches=1)
                synchronize(self.runtime.device)
                seconds = time.time() - t
                self.warm_up_times.append((f"train {kind} batch {stage.batch_size} window {stage.ws_long}", seconds))
                self.console(f"warm-up: {kind} train steps for batch {stage.batch_size}, window {stage.ws_long}: "
                             f"{seconds:.1f}s ({compiled_graph_count()} graphs compiled so far)")
            self.model.zero_grad(set_to_none=True)
            self.model.yarn.reset()
            if self.runtime.device == "cuda":
                torch.cuda.empty_cache()  # this pass's cached blocks: the next pass allocates elsewhere
        if graphs is not None:
            self.log(f"CUDA graphs: {graphs.captures} training micro-batches captured, memory pool "
                     f"{CudaGraph.pool_bytes() / 2**30:.2f} GiB")
        windows = eval_windows(a)
        for i, (short, long) in enumerate(windows):
            if i < len(windows) - 1:  # the final validation widens the window without a YaRN update
                self.model.yarn.set_window(long)
            t = time.time()
            self.evaluate(short, long, max_steps=1)
            seconds = time.time() - t
            self.warm_up_times.append((f"eval windows {short},{long}", seconds))
            self.console(f"warm-up: eval for windows ({short}, {long}): {seconds:.1f}s "
                         f"({compiled_graph_count()} graphs compiled so far)")
        self.model.yarn.reset()  # evaluate() has put the model back in training mode
        self.muon.reset()
        self.model.load_state_dict(initial["model"])
        for opt, state in zip((self.adam, self.muon), initial["opts"]):
            opt.load_state_dict(state)

    def train(self) -> "RunResult":
        """The timed run: per step the stage's batch size and windows, a validation where due (off the clock), the
        schedules, then train_step. Nothing may compile in here: the warm-up compiled every graph."""
        a, log = self.args, self.log
        total = a.num_iterations
        table = stages(a)
        batches = self.new_batches(table[0].batch_size)
        previous_bs = table[0].batch_size
        switch_steps = {s.first_step for s in table if s.first_step < total}
        watch = NonFiniteLossWatch(self.runtime.device, self.runtime.master)
        training_time_ms = 0.0
        gc.collect()  # no stop-the-world gen-2 collection in the timed region
        synchronize(self.runtime.device)
        t0 = time.perf_counter()
        with no_compiles_allowed(a.fail_on_recompile):
            for step in range(total + 1):
                log.where = f"at step {step}"
                last = step == total
                stage = table[stage_index(step, a)]
                ws_short, ws_long = stage.ws_short, stage.ws_long
                if step in switch_steps:
                    log(schedule_line(step, a))
                self.model.yarn.set_window(ws_long)
                validate = last or (a.val_loss_every > 0 and step % a.val_loss_every == 0)
                check_graphs = self.runtime.check_graphs and step in switch_steps
                if validate or check_graphs:  # off the clock
                    synchronize(self.runtime.device)
                    if step > 0:  # before step 0 nothing has trained: a slow log write is not training time
                        training_time_ms += 1000 * (time.perf_counter() - t0)
                    if validate:
                        eval_long = a.ws_validate_post_yarn_ext if last else ws_long  # the final: no YaRN update
                        val_loss = self.evaluate(ws_short, eval_long)
                        if not math.isfinite(val_loss):
                            raise TrainingDiverged(f"stopped at step {step}: the validation loss is {val_loss}")
                        log(f"step:{step}/{total} val_loss:{val_loss:.4f} train_time:{training_time_ms:.0f}ms "
                            f"step_avg:{training_time_ms / max(step, 1):.2f}ms")
                    if check_graphs and not last:
                        self.set_schedules(step)
                        self.graphs_against_eager(step, stage)
                    synchronize(self.runtime.device)
                    t0 = time.perf_counter()
                if last:
                    break
                bs = stage.batch_size
                settings = (bs, a.train_max_seq_len, self.runtime.grad_accum_steps) if bs != previous_bs else None
                previous_bs = bs
                self.set_schedules(step)
                loss = self.train_step(step, batches, settings, ws_short, ws_long, self.runtime.grad_accum_steps)
                watch.after_step(step, loss)
                approx_ms = training_time_ms + 1000 * (time.perf_counter() - t0)
                log(f"step:{step + 1}/{total} train_time:{approx_ms:.0f}ms step_avg:{approx_ms / (step + 1):.2f}ms")
        log.where = "after the last step"
        return RunResult(steps=total, val_loss=val_loss, train_time_ms=training_time_ms)

RECOMPILE_LIMIT = 64  # graphs per code object (a train and an eval graph each; a few more for tests)

def build_model_and_optimizers(args: Hyperparameters, runtime: "Runtime"):
    """The model on this process's device (compiled per region) and its two optimizers."""
    max_seq_len = max(tokens_per_micro_batch(bs, runtime.grad_accum_steps, runtime.world_size)
                      for bs in (args.val_batch_size, *args.train_bs_schedule, args.train_bs_extension))
    model = GPT(args, max_seq_len=max_seq_len, kernels=runtime.kernels, fp8=runtime.fp8).to(runtime.device)
    torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    if runtime.compile:
        model.compile_regions(dynamic=False, fullgraph=True)
    if dist.is_initialized():
        for p in model.parameters():  # every rank starts from rank 0's initialisation
            dist.broadcast(p.detach(), 0)
    adam, muon = build_optimizers(model, args)
    if runtime.compile:
        muon.compile_helpers()
        adam.compile_helpers()
    return model, adam, muon

def build_trainer(args: Hyperparameters, runtime: "Runtime", log_file: Path, replace_log: bool = False) -> "Trainer":
    """Everything a run needs, in one place (run() and bench/bench.py both call this): data and output paths checked
    first, then the process group, the model and optimizers, and last the log with its header."""
    train_files, val_file = find_data(args, runtime, scan=False)
    check_writable(log_file.parent, "--log-dir")
    lock = RunLock.acquire(log_file) if runtime.master else None  # the run id is this run's from here to the end
    setup_process_group(runtime)
    if args.seed >= 0:
        torch.manual_seed(args.seed)
    model, adam, muon = build_model_and_optimizers(args, runtime)
    log = Logger(log_file, runtime.master, replace=replace_log, lock=lock)
    if runtime.master:
        print(log.path, flush=True)
    for line in (Path(__file__).read_text(), SEPARATOR, f"Running Python {sys.version}",
                 f"Running PyTorch {torch.__version__} compiled for CUDA {torch.version.cuda}",
                 f"Running Triton version {triton.__version__ if triton else 'not installed'}",
                 runtime.config_line(args), model.layers.line()):
        log(line, console=False)
    for note in (*runtime.kernel_notes, muon.grouping_note):
        if note:
            log(note)
    if args.train_epochs > 1:
        log(f"note: the loader cycles over the training shards {args.train_epochs} times (--train-epochs)")
    log(nvidia_smi(), console=False)
    log(SEPARATOR, console=False)
    graphs = MicroBatchGraphs(model, adam, muon.grad_buffers, writes_first=runtime.grad_accum_steps == 1) \
        if runtime.cuda_graphs else None
    return Trainer(args, runtime, model, adam, muon, train_files, val_file, log, graphs)


# =====================================================================================
# Engine room: the fused kernels, each beside the fingerprint of the plain code it computes
# =====================================================================================

# --- which function the model calls: the plain one, or its fused twin ---------------------------------------------
# A speedrunner edits the plain functions. Each fused kernel computes what its plain function computed when the
# kernel was written, recorded as a fingerprint of that function's code (and of the plain helpers it follows): an
# edit changes the fingerprint, and the fused kernel then refuses to run instead of silently ignoring the edit.
# Constants the kernels take as arguments (SOFTCAP up to 60, SOFTCAP_WIDTH, the Yarn tables) may change freely.

def code_fingerprint(*functions) -> str:
    """A short hash of the functions' code without docstrings and comments (ast.unparse normalises the layout)."""
    parts = []
    for fn in functions:
        tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(fn)))
        body = tree.body[0].body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            tree.body[0].body = body[1:] or [ast.Pass()]
        parts.append(ast.unparse(tree))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]

@dataclass(frozen=True)
class FusedKernel:
    plain: object          # the function a speedrunner edits
    fused: object          # its drop-in replacement
    follows: tuple         # the plain functions whose code the fused kernel computes
    fingerprint: str       # code_fingerprint(*follows) when the fused kernel was last checked against it
    check_here: object     # check_here(fp8) raises where the fused kernel cannot run (no GPU, library missing)
    note_here: object = None  # note_here() -> a line for the log where the kernel runs in a lesser way, or None

FUSED_KERNELS = {}  # name -> FusedKernel, each registered beside its fused kernel

def parse_kernels(text: str) -> set | None:
    """The fused kernels --kernels asks for (fused: all, plain: none), or None where it names something else."""
    if text in ("fused", "plain"):
        return set(FUSED_KERNELS) if text == "fused" else set()
    names = {n.strip() for n in text.split(",") if n.strip()}
    return names if names and names <= set(FUSED_KERNELS) else None

def resolve_kernels(requested: str, device: str, fp8: bool) -> tuple[dict, list]:
    """({name: function the model calls}, notes for the log): `fused` takes each fused kernel that runs here, a listed
    one must run. A fused kernel that would run but whose plain functions were edited is an error (it would compute
    the old ones); one that cannot run here is no reason to refuse an edit."""
    chosen, notes = {}, []
    for name, kernel in FUSED_KERNELS.items():
        chosen[name] = kernel.plain
        if name not in parse_kernels(requested):
            continue
        try:
            if device != "cuda":
                raise RuntimeError("it needs a CUDA GPU")
            kernel.check_here(fp8)
        except Exception as e:
            if requested != "fused":
                raise ConfigError(f"--kernels: the fused {name} kernel cannot run here ({type(e).__name__}: {e}); "
                                  f"leave it out of --kernels, use --kernels plain, or ./run.sh setup-gpu for "
                                  f"FlashAttention-4 and quack") from None
            if device == "cuda":
                notes.append(f"kernels: plain {name} ({e})")
            continue
        if code_fingerprint(*kernel.follows) != kernel.fingerprint:
            edited = ", ".join(fn.__name__ for fn in kernel.follows)
            raise ConfigError(f"the fused {name} kernel computes {edited} as written when it was made, and that code "
                              f"has changed: run with --kernels plain (or leave {name} out of --kernels), or update "
                              f"the fused kernel and FUSED_KERNELS['{name}'].fingerprint")
        chosen[name] = kernel.fused
        if kernel.note_here is not None and (note := kernel.note_here()):
            notes.append(f"kernels: {name}: {note}")
    if requested == "fused" and device != "cuda":
        notes.append(f"kernels: no fused kernel runs on the {device}: the plain functions, as --kernels plain")
    return chosen, notes

# --- the fused twin of `attention`: FlashAttention-4 with the q/k norm and rotary in one Triton pass -------------
# FlashAttention-4 (PyPI `flash-attn-4`, CuTe DSL kernels; its sm90 path ports FA3's Hopper kernels): window and
# scale are runtime arguments of its kernels (only whether a window exists is in its compile key), so one compiled
# kernel pair serves every stage. Imported on first use (Python keeps the module).

def fa4_interface():
    # Keep FA4's JIT-compiled kernels on disk, as Inductor keeps its graphs: a restart loads them instead of
    # compiling again. Read at its import; FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=0 opts out.
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    import flash_attn.cute.interface as fa4
    return fa4

def fa4_forward(q, k, v, cu_seqlens, max_seqlen: int, window_table, window_row: int) -> tuple[Tensor, Tensor]:
    scale, window = scale_and_window(window_table, window_row)
    out, lse, *_ = fa4_interface()._flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
        softmax_scale=scale, causal=True, window_size_left=window, window_size_right=0, return_lse=True)
    return out, lse

def fa4_backward(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen: int, window_table, window_row: int,
                 dq, dk, dv, fill_grad_out=None) -> None:
    """Writes the gradients into dq, dk, dv (views of the caller's gradient buffers). fill_grad_out(dpsum, lse_log2,
    dq_accum) writes grad_out first: where FA4 is the version whose buffers it knows, it gets them and does FA4's
    preprocess's work too (the row sums of grad_out·out, lse in log2 units and the zeroed dQ accumulator, in FA4's
    padded layout); elsewhere it gets None for all three and FA4's preprocess runs after it."""
    scale, window = scale_and_window(window_table, window_row)
    fa4 = fa4_interface()
    if fill_grad_out is not None and not fa4_preprocess_replaceable():
        fill_grad_out(None, None, None)
        fill_grad_out = None
    preprocess, ran = (fa4._bwd_preprocess if fill_grad_out else None), []

    def our_preprocess(*args, **kwargs):
        a = inspect.signature(preprocess).bind(*args, **kwargs).arguments
        known = (a.get("m_block_size") == 64 and a.get("head_dim") == a.get("head_dim_v") == 128
                 and a.get("use_padded_offsets", True) and not a.get("pack_gqa", False)
                 and a.get("dlse") is None and a.get("seqused_q") is None and a.get("row_max") is None)
        ran.append(known)
        if known:
            fill_grad_out(a["dpsum"], a["lse_log2"], a["dq_accum"])
        else:
            fill_grad_out(None, None, None)
            preprocess(*args, **kwargs)
    if fill_grad_out:  # FA4 looks its preprocess up as a module global at each call
        fa4._bwd_preprocess = our_preprocess
    try:
        fa4._flash_attn_bwd(
            q, k, v, out, grad_out, lse, scale, True, 0.0, window_size_left=window, window_size_right=0,
            cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen,
            dq=dq, dk=dk, dv=dv)
    finally:
        if fill_grad_out:
            fa4._bwd_preprocess = preprocess
    if fill_grad_out and len(ran) != 1:
        raise RuntimeError(f"FlashAttention-4 {FA4_PREPROCESS_VERSION} called its preprocess {len(ran)} times, not "
                           f"once: its backward is not the one fa4_backward was written for")

# FA4's backward starts with a pass of its own over out and grad_out (the row sums of their product), which the
# attention gate's backward, reading the same two to write grad_out, can do on the way; that pass also puts lse in
# log2 units and zeroes FA4's fp32 dQ accumulator, all in FA4's padded layout of 4.0.0b36 (bench/notes/
# fa4_backward_sm90.md). Another version keeps its own preprocess, and the log says so.
FA4_PREPROCESS_VERSION = "4.0.0b36"

def fa4_installed_version() -> str | None:
    """flash-attn-4's installed version, None where it is not installed under that name."""
    import importlib.metadata
    try:
        return importlib.metadata.version("flash-attn-4")
    except importlib.metadata.PackageNotFoundError:
        return None

@functools.cache
def fa4_preprocess_replaceable() -> bool:
    return fa4_installed_version() == FA4_PREPROCESS_VERSION and torch.cuda.get_device_capability()[0] == 9

def fa4_preprocess_note() -> str | None:
    if fa4_preprocess_replaceable():
        return None
    version = fa4_installed_version() or "not installed as flash-attn-4"
    return (f"FlashAttention-4 runs its own backward preprocess (the attention gate's backward does its work for "
            f"{FA4_PREPROCESS_VERSION} on Hopper only; this is {version}, compute capability "
            f"{'.'.join(map(str, torch.cuda.get_device_capability()))})")

# q/k RMS norm and rotary in one Triton pass inside the FlashAttention-4 op (Inductor parks the rotated rows in fp32
# scratch and copies dv into the qkv gradient in one more pass): the forward reads each raw q/k row once, the
# backward lets FlashAttention-4 write dv into its slot of the qkv gradient and fills the q and k slots in one pass.
# The math is norm() and rotary()'s, in fp32 with one rounding at the store (tests pin it against them). The gate
# rides in the op too, so that its backward, which reads FA4's output and writes FA4's dout, does the work of FA4's
# backward preprocess on the way (fa4_backward).

if triton is not None:

    @triton.jit
    def _qk_norm_rope_forward_kernel(qkv, cos, sin, qk_out, rstd_out, rows_total, HEADS2: tl.constexpr,
                                     D: tl.constexpr, ROW_STRIDE: tl.constexpr, EPS: tl.constexpr,
                                     BLOCK_R: tl.constexpr):
        # Row r = token·HEADS2 + j: head j of q (j < HEADS2/2) or of k, at qkv[token, j]; qk_out is (T, HEADS2, D).
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (rows < rows_total)[:, None]
        token = (rows // HEADS2).to(tl.int64)
        half = tl.arange(0, D // 2)[None, :]
        src = qkv + token[:, None] * ROW_STRIDE + (rows % HEADS2)[:, None] * D + half
        x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(src + D // 2, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / D + EPS)
        table = token[:, None] * (D // 2) + half
        c = tl.load(cos + table, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin + table, mask=mask, other=0.0).to(tl.float32)
        x1 = x1 * r[:, None]
        x2 = x2 * r[:, None]
        dst = qk_out + rows.to(tl.int64)[:, None] * D + half
        tl.store(dst, (x1 * c + x2 * s).to(qk_out.dtype.element_ty), mask=mask)
        tl.store(dst + D // 2, (x2 * c - x1 * s).to(qk_out.dtype.element_ty), mask=mask)
        tl.store(rstd_out + rows, r, mask=rows < rows_total)

    @triton.jit
    def _add_value_embedding_kernel(qkv, ve, v_out, T, WIDTH: tl.constexpr, ROW_STRIDE: tl.constexpr,
                                    V_OFFSET: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr):
        # v_out[t] = qkv[t, V_OFFSET : V_OFFSET + WIDTH] + ve[t], BLOCK_T whole rows per program.
        tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
        cols = tl.arange(0, BLOCK_W)[None, :]
        mask = (tokens < T) & (cols < WIDTH)
        a = tl.load(qkv + tokens * ROW_STRIDE + V_OFFSET + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(ve + tokens * WIDTH + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(v_out + tokens * WIDTH + cols, (a + b).to(v_out.dtype.element_ty), mask=mask)

    @triton.jit
    def _qk_norm_rope_backward_kernel(d_qk, qkv, rstd, cos, sin, d_qkv, rows_total, HEADS2: tl.constexpr,
                                      D: tl.constexpr, ROW_STRIDE: tl.constexpr, BLOCK_R: tl.constexpr):
        # d_qk (T, HEADS2, D): gradient of the rotated rows; writes the raw rows' gradient into d_qkv[token, j].
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (rows < rows_total)[:, None]
        token = (rows // HEADS2).to(tl.int64)
        half = tl.arange(0, D // 2)[None, :]
        grad = d_qk + rows.to(tl.int64)[:, None] * D + half
        g1 = tl.load(grad, mask=mask, other=0.0).to(tl.float32)
        g2 = tl.load(grad + D // 2, mask=mask, other=0.0).to(tl.float32)
        table = token[:, None] * (D // 2) + half
        c = tl.load(cos + table, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(sin + table, mask=mask, other=0.0).to(tl.float32)
        g1, g2 = g1 * c - g2 * s, g1 * s + g2 * c  # through the rotation (its transpose)
        offset = token[:, None] * ROW_STRIDE + (rows % HEADS2)[:, None] * D + half
        r = tl.load(rstd + rows, mask=rows < rows_total, other=0.0)[:, None]
        x1 = tl.load(qkv + offset, mask=mask, other=0.0).to(tl.float32) * r
        x2 = tl.load(qkv + offset + D // 2, mask=mask, other=0.0).to(tl.float32) * r
        dot = (tl.sum(x1 * g1, 1) + tl.sum(x2 * g2, 1))[:, None] / D
        tl.store(d_qkv + offset, ((g1 - x1 * dot) * r).to(d_qkv.dtype.element_ty), mask=mask)
        tl.store(d_qkv + offset + D // 2, ((g2 - x2 * dot) * r).to(d_qkv.dtype.element_ty), mask=mask)

if triton is not None:

    @triton.jit
    def _attention_gate_kernel(out, gate, y, rows_total, D: tl.constexpr, BLOCK_R: tl.constexpr):
        # y = out · sigmoid(gate), row r = token·heads + head of out (T, heads, D) and of gate (T, heads); in fp32,
        # rounded once, as Inductor compiles the plain attention's product.
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        mask = (rows < rows_total)[:, None]
        at = rows.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :]
        o = tl.load(out + at, mask=mask, other=0.0).to(tl.float32)
        g = tl.sigmoid(tl.load(gate + rows, mask=rows < rows_total, other=0.0).to(tl.float32))
        tl.store(y + at, (o * g[:, None]).to(y.dtype.element_ty), mask=mask)

    @triton.jit
    def _attention_gate_backward_kernel(grad_y, out, gate, lse, cu_seqlens, documents, d_out, d_gate, dpsum,
                                        lse_log2, dq_accum, T, padded_rows, HEADS: tl.constexpr, D: tl.constexpr,
                                        DOCUMENTS: tl.constexpr, FA4: tl.constexpr):
        # The gate's backward for 64 rows of one head: d_out = grad_y·σ (bf16, FA4's dout), d_gate =
        # Σ grad_y·out·σ(1-σ). The rows are FA4's padded tile: document b's rows start at the padded row
        # cu[b] + 64·b - cu[b] % 64 and fill whole tiles. FA4: also FA4's preprocess for the tile, in its buffers:
        # dpsum = Σ d_out·out (0 past the document), lse_log2 = lse·log2(e) (0 for -inf; +inf past the document,
        # which keeps those rows out of dK and dV), and the tile's 64 x D floats of the dQ accumulator zeroed.
        row0 = tl.program_id(0) * 64
        head = tl.program_id(1)
        b = tl.arange(0, DOCUMENTS)
        start = tl.load(cu_seqlens + b, mask=b < documents, other=0)
        length = tl.load(cu_seqlens + b + 1, mask=b < documents, other=0) - start
        padded = start + 64 * b - start % 64
        here = (b < documents) & (padded <= row0) & (row0 < padded + (length + 63) // 64 * 64)
        doc = tl.max(tl.where(here, b, -1), axis=0)
        if doc >= 0:
            in_doc = row0 - tl.sum(tl.where(b == doc, padded, 0), axis=0)
            rows = tl.sum(tl.where(b == doc, length, 0), axis=0) - in_doc  # rows of this tile that are tokens
            m = tl.arange(0, 64)
            valid = m < rows
            token = (tl.sum(tl.where(b == doc, start, 0), axis=0) + in_doc + m).to(tl.int64)
            at = (token * HEADS + head)[:, None] * D + tl.arange(0, D)[None, :]
            g = tl.load(grad_y + at, mask=valid[:, None], other=0.0).to(tl.float32)
            o = tl.load(out + at, mask=valid[:, None], other=0.0).to(tl.float32)
            s = tl.sigmoid(tl.load(gate + token * HEADS + head, mask=valid, other=0.0).to(tl.float32))
            do = (g * s[:, None]).to(d_out.dtype.element_ty)
            tl.store(d_out + at, do, mask=valid[:, None])
            tl.store(d_gate + token * HEADS + head, (tl.sum(g * o, 1) * s * (1.0 - s)).to(d_gate.dtype.element_ty),
                     mask=valid)
            if FA4:
                row_sum = tl.sum(do.to(tl.float32) * o, 1)
                row_lse = tl.load(lse + head * T + token, mask=valid, other=0.0)
                row_lse = tl.where(row_lse == float("-inf"), 0.0, row_lse * 1.4426950408889634)
                at_padded = head.to(tl.int64) * padded_rows + row0 + m
                tl.store(dpsum + at_padded, tl.where(valid, row_sum, 0.0))
                tl.store(lse_log2 + at_padded, tl.where(valid, row_lse, float("inf")))
                accum = dq_accum + (head.to(tl.int64) * padded_rows + row0) * D
                tl.store(accum + tl.arange(0, 64 * D), tl.zeros([64 * D], dtype=tl.float32))

ATTENTION_GATE_ROWS = 32  # head rows per program of _attention_gate_kernel

def attention_gate(out: Tensor, gate: Tensor) -> Tensor:
    """out (T, heads, D) · sigmoid(gate (T, heads)), in out's dtype."""
    T, heads, D = out.shape
    assert out.is_contiguous() and gate.is_contiguous() and gate.shape == (T, heads)
    y = torch.empty_like(out)
    _attention_gate_kernel[(triton.cdiv(T * heads, ATTENTION_GATE_ROWS),)](
        out, gate, y, T * heads, D=D, BLOCK_R=ATTENTION_GATE_ROWS, num_warps=4)
    return y

def attention_gate_backward(grad_y: Tensor, out: Tensor, gate: Tensor, lse: Tensor, cu_seqlens: Tensor,
                            d_out: Tensor, d_gate: Tensor, dpsum: Tensor = None, lse_log2: Tensor = None,
                            dq_accum: Tensor = None) -> None:
    """Writes d_out (FA4's dout) and d_gate; given FA4's preprocess buffers (dpsum, lse_log2 (heads, padded rows),
    dq_accum (heads, padded rows · D)), also what FA4's preprocess writes there."""
    T, heads, D = out.shape
    assert grad_y.is_contiguous() and out.is_contiguous() and gate.is_contiguous() and lse.is_contiguous()
    documents = cu_seqlens.numel() - 1
    fa4 = dpsum is not None
    padded_rows = dpsum.size(1) if fa4 else triton.cdiv(T + 64 * documents, 64) * 64
    if fa4:
        assert dpsum.shape == lse_log2.shape == (heads, padded_rows) and dq_accum.shape == (heads, padded_rows * D)
        assert dpsum.is_contiguous() and lse_log2.is_contiguous() and dq_accum.is_contiguous()
        assert padded_rows >= T + 64 * documents  # every document's tiles fit
    _attention_gate_backward_kernel[(triton.cdiv(T + 64 * documents, 64), heads)](
        grad_y, out, gate, lse, cu_seqlens, documents, d_out, d_gate, dpsum if fa4 else d_gate,
        lse_log2 if fa4 else d_gate, dq_accum if fa4 else d_gate, T, padded_rows, HEADS=heads, D=D,
        DOCUMENTS=triton.next_power_of_2(documents), FA4=fa4, num_warps=4)

QK_NORM_ROPE_ROWS = 32  # head rows per program: 32 x 128 elements in flight each way

def qk_norm_rope(qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """(rotated, normalised q and k heads (T, 2H, D) in qkv's dtype, 1/rms per row (T, 2H) fp32) of qkv (T, 3H, D)."""
    T, heads3, D = qkv.shape
    assert qkv.is_contiguous() and cos.is_contiguous() and sin.is_contiguous() and cos.size(1) == D // 2
    heads2 = 2 * heads3 // 3
    qk, rstd = qkv.new_empty((T, heads2, D)), qkv.new_empty((T, heads2), dtype=torch.float32)
    rows = T * heads2
    _qk_norm_rope_forward_kernel[(triton.cdiv(rows, QK_NORM_ROPE_ROWS),)](
        qkv, cos, sin, qk, rstd, rows, HEADS2=heads2, D=D, ROW_STRIDE=heads3 * D,
        EPS=torch.finfo(torch.float32).eps, BLOCK_R=QK_NORM_ROPE_ROWS, num_warps=4)
    return qk, rstd

VALUE_EMBEDDING_ROWS = 8  # tokens per program of _add_value_embedding_kernel

def add_value_embedding(qkv: Tensor, ve: Tensor) -> Tensor:
    """qkv's v heads + ve, contiguous (T, H, D). PyTorch adds a strided operand with an unvectorised kernel that
    computes every element's address; this pass reads whole rows (same bf16 rounding: fp32 sum, one rounding)."""
    T, heads3, D = qkv.shape
    heads = heads3 // 3
    assert qkv.is_contiguous() and ve.is_contiguous() and ve.shape == (T, heads, D)
    v = torch.empty_like(ve)
    width = heads * D
    _add_value_embedding_kernel[(triton.cdiv(T, VALUE_EMBEDDING_ROWS),)](
        qkv, ve, v, T, WIDTH=width, ROW_STRIDE=heads3 * D, V_OFFSET=2 * width, BLOCK_T=VALUE_EMBEDDING_ROWS,
        BLOCK_W=triton.next_power_of_2(width), num_warps=8)
    return v

def qk_norm_rope_backward(d_qk: Tensor, qkv: Tensor, rstd: Tensor, cos: Tensor, sin: Tensor, d_qkv: Tensor) -> None:
    """Writes the gradient of qkv's q and k heads, given d_qk (T, 2H, D) of qk_norm_rope's output, into
    d_qkv[:, :2H] (d_qkv has qkv's layout; its v heads are left alone)."""
    T, heads3, D = qkv.shape
    heads2 = 2 * heads3 // 3
    assert d_qk.is_contiguous() and d_qkv.is_contiguous() and qkv.is_contiguous()
    rows = T * heads2
    _qk_norm_rope_backward_kernel[(triton.cdiv(rows, QK_NORM_ROPE_ROWS),)](
        d_qk, qkv, rstd, cos, sin, d_qkv, rows, HEADS2=heads2, D=D, ROW_STRIDE=heads3 * D,
        BLOCK_R=QK_NORM_ROPE_ROWS, num_warps=4)

@torch.library.custom_op("speedrun::fa4_gated_qkv", mutates_args=())
def fa4_gated_qkv(qkv: Tensor, ve: Tensor | None, gate: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor,
                  max_seqlen: int, window_table: Tensor, window_row: int
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """attention() with FlashAttention-4: (the gated output, and for the backward FA4's out and lse, the rotated
    q|k, the v it read when ve is given (else empty: v is a view of qkv), the norm's 1/rms)."""
    heads = qkv.size(1) // 3
    qk, rstd = qk_norm_rope(qkv, cos, sin)
    v = qkv[:, 2 * heads:] if ve is None else add_value_embedding(qkv, ve)
    out, lse = fa4_forward(qk[:, :heads], qk[:, heads:], v, cu_seqlens, max_seqlen, window_table, window_row)
    out = out.contiguous()  # FA4's is (a stand-in's may not be)
    return attention_gate(out, gate), out, lse, qk, (v if ve is not None else qkv.new_empty(0)), rstd

@fa4_gated_qkv.register_fake
def _(qkv, ve, gate, cos, sin, cu_seqlens, max_seqlen, window_table, window_row):
    T, heads3, D = qkv.shape
    heads = heads3 // 3
    return (qkv.new_empty((T, heads, D)), qkv.new_empty((T, heads, D)),
            qkv.new_empty((heads, T), dtype=torch.float32), qkv.new_empty((T, 2 * heads, D)),
            qkv.new_empty((T, heads, D) if ve is not None else (0,)),
            qkv.new_empty((T, 2 * heads), dtype=torch.float32))

@torch.library.custom_op("speedrun::fa4_gated_qkv_backward", mutates_args=())
def fa4_gated_qkv_backward(grad_y: Tensor, qkv: Tensor, gate: Tensor, cos: Tensor, sin: Tensor, out: Tensor,
                           lse: Tensor, qk: Tensor, v_used: Tensor, rstd: Tensor, cu_seqlens: Tensor,
                           max_seqlen: int, window_table: Tensor, window_row: int) -> tuple[Tensor, Tensor]:
    """(the gradient of qkv, written in place by FlashAttention-4's backward (dv) and the norm + rotary backward;
    the gradient of gate, from the gate's backward, which also writes FA4's dout and does its preprocess's work)."""
    heads = qkv.size(1) // 3
    v = v_used if v_used.numel() else qkv[:, 2 * heads:]
    d_qkv, d_qk, d_out, d_gate = (torch.empty_like(t) for t in (qkv, qk, out, gate))

    def fill_d_out(dpsum, lse_log2, dq_accum):
        attention_gate_backward(grad_y, out, gate, lse, cu_seqlens, d_out, d_gate, dpsum, lse_log2, dq_accum)
    fa4_backward(d_out, qk[:, :heads], qk[:, heads:], v, out, lse, cu_seqlens, max_seqlen, window_table, window_row,
                 dq=d_qk[:, :heads], dk=d_qk[:, heads:], dv=d_qkv[:, 2 * heads:], fill_grad_out=fill_d_out)
    qk_norm_rope_backward(d_qk, qkv, rstd, cos, sin, d_qkv)
    return d_qkv, d_gate

@fa4_gated_qkv_backward.register_fake
def _(grad_y, qkv, gate, cos, sin, out, lse, qk, v_used, rstd, cu_seqlens, max_seqlen, window_table, window_row):
    return torch.empty_like(qkv), torch.empty_like(gate)

def _fa4_gated_qkv_setup_context(ctx, inputs, output):
    qkv, ve, gate, cos, sin, cu_seqlens, max_seqlen, window_table, window_row = inputs
    ctx.save_for_backward(qkv, gate, cos, sin, *output[1:], cu_seqlens, window_table)  # out, lse, qk, v_used, rstd
    ctx.max_seqlen, ctx.window_row, ctx.has_ve = max_seqlen, window_row, ve is not None

def _fa4_gated_qkv_backward(ctx, grad_y, *_):
    qkv, gate, cos, sin, out, lse, qk, v_used, rstd, cu_seqlens, window_table = ctx.saved_tensors
    d_qkv, d_gate = torch.ops.speedrun.fa4_gated_qkv_backward(
        grad_y.contiguous(), qkv, gate, cos, sin, out, lse, qk, v_used, rstd, cu_seqlens, ctx.max_seqlen,
        window_table, ctx.window_row)
    d_ve = d_qkv[:, 2 * (qkv.size(1) // 3):] if ctx.has_ve else None  # v = qkv's v heads + ve: the same gradient
    return d_qkv, d_ve, d_gate, None, None, None, None, None, None

fa4_gated_qkv.register_autograd(_fa4_gated_qkv_backward, setup_context=_fa4_gated_qkv_setup_context)

def fused_attention(qkv, ve, gate, cos, sin, cu_seqlens, max_seqlen, window_table, window_row):
    return torch.ops.speedrun.fa4_gated_qkv(qkv, ve, gate.contiguous(), cos, sin, cu_seqlens, max_seqlen,
                                            window_table, window_row)[0]

def fa4_on_this_gpu():
    if torch.cuda.get_device_capability()[0] < 9:
        raise RuntimeError("its kernels need compute capability 9.0 or newer (Hopper, Blackwell)")
    return fa4_interface()

FUSED_KERNELS["attention"] = FusedKernel(attention, fused_attention, (attention, rotary, norm, flash_attention,
                                         scale_and_window), "3ae62c9b8f28", lambda fp8: fa4_on_this_gpu(),
                                         fa4_preprocess_note)

@functools.cache
def quack_gemm():
    """quack.gemm_interface (PyPI quack-kernels), imported on first use."""
    import quack.gemm_interface as gemm_interface
    return gemm_interface

# quack's untuned Hopper default clusters two CTAs along M; the same 128x192 pingpong tile clustered along N is faster
# for both fused MLP GEMMs on the trainer's shapes and bit-identical (same tile, same K order). Pinned, because
# autotuning at start-up costs minutes of compiles. Other GPUs keep quack's default.
QUACK_MLP_CONFIG_SM90 = dict(tile_m=128, tile_n=192, cluster_m=1, cluster_n=2, pingpong=True,
                             is_dynamic_persistent=False)

@functools.cache
def quack_mlp_config(device_type: str, index: int | None):
    """quack's GemmConfig for the MLP's fused GEMMs on this device, or None for quack's own default."""
    if device_type != "cuda" or torch.cuda.get_device_capability(index)[0] != 9:
        return None
    from quack.gemm_config import GemmConfig
    return GemmConfig(**QUACK_MLP_CONFIG_SM90, device_capacity=9)

def quack_on_this_gpu():
    if torch.cuda.get_device_capability()[0] not in (9, 10):
        raise RuntimeError("its GEMM kernels need compute capability 9.x or 10.x (Hopper, Blackwell)")
    return quack_gemm()

# mlp's twin: the activation rides in the GEMM epilogues. The forward GEMM writes the pre-activation and ReLU² in
# one pass; the backward's first GEMM multiplies by the derivative and recomputes ReLU² for the weight gradient in
# the same pass (Inductor's version runs each as a separate pass over the (T, 4d) activation). The weight-gradient
# GEMMs stay on cuBLAS.
@torch.library.custom_op("speedrun::relu2_mlp", mutates_args=())
def relu2_mlp(x: Tensor, w_fc: Tensor, w_proj: Tensor) -> tuple[Tensor, Tensor]:
    """(mlp(x, w_fc, w_proj), the pre-activation x w_fcᵀ) for x (T, d) and w_fc, w_proj (4d, d), all bf16."""
    pre, h = quack_gemm().gemm_act(x, w_fc.mT, activation="relu_sq", tuned=False,
                                   config=quack_mlp_config(x.device.type, x.device.index))
    return h @ w_proj, pre

@relu2_mlp.register_fake
def _(x, w_fc, w_proj):
    return x.new_empty(x.size(0), w_proj.size(1)), x.new_empty(x.size(0), w_fc.size(0))

@torch.library.custom_op("speedrun::relu2_mlp_backward", mutates_args=())
def relu2_mlp_backward(grad: Tensor, x: Tensor, w_fc: Tensor, w_proj: Tensor,
                       pre: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dx, dw_fc, dw_proj). One fused GEMM gives d(pre) = (grad w_projᵀ)·2relu(pre) and h = relu(pre)²."""
    grad = grad.contiguous()
    dpre, h = quack_gemm().gemm_dact(grad, w_proj.mT, pre, activation="relu_sq", tuned=False,
                                     config=quack_mlp_config(grad.device.type, grad.device.index))
    return dpre @ w_fc, dpre.mT @ x, h.mT @ grad

@relu2_mlp_backward.register_fake
def _(grad, x, w_fc, w_proj, pre):
    return torch.empty_like(x), torch.empty_like(w_fc), torch.empty_like(w_proj)

def _relu2_mlp_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output[1])  # x, w_fc, w_proj, pre

def _relu2_mlp_backward_rule(ctx, grad_out, _grad_pre):
    return torch.ops.speedrun.relu2_mlp_backward(grad_out, *ctx.saved_tensors)

relu2_mlp.register_autograd(_relu2_mlp_backward_rule, setup_context=_relu2_mlp_setup_context)

def fused_mlp(x: Tensor, w_fc: Tensor, w_proj: Tensor) -> Tensor:
    return torch.ops.speedrun.relu2_mlp(x, w_fc, w_proj)[0]

FUSED_KERNELS["mlp"] = FusedKernel(mlp, fused_mlp, (mlp,), "20ac2a6cca4e", lambda fp8: quack_on_this_gpu())

# attention_output's twin: Inductor turns it into an addmm, for which ATen first copies the residual into the output
# and has cuBLAS read it back; quack's gemm_add reads the residual in its epilogue instead.
@torch.library.custom_op("speedrun::residual_linear", mutates_args=())
def residual_linear(residual: Tensor, y: Tensor, w: Tensor) -> Tensor:
    return quack_gemm().gemm_add(y, w.mT, residual, tuned=False)

@residual_linear.register_fake
def _(residual, y, w):
    return torch.empty_like(residual)

def _residual_linear_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[1:])  # y, w

def _residual_linear_backward(ctx, grad):
    y, w = ctx.saved_tensors
    return grad, grad @ w, grad.t() @ y

residual_linear.register_autograd(_residual_linear_backward, setup_context=_residual_linear_setup_context)

def fused_attention_output(residual: Tensor, y: Tensor, w: Tensor) -> Tensor:
    return torch.ops.speedrun.residual_linear(residual, y, w)

FUSED_KERNELS["attention_output"] = FusedKernel(attention_output, fused_attention_output, (attention_output,),
                                                "996f8d18f3cd", lambda fp8: quack_on_this_gpu())

# --- its fused twin: FP8 matmul, then one Triton pass forward and one backward -----------------------------------
# The softcap bounds every logit below SOFTCAP, so the log-sum-exp needs no max pass (50304·e^30 ≈ 5e17, far below
# fp32's 3e38), and the softcapped logits are never stored: the backward recomputes them. Both passes take the
# sigmoid from the GPU's tanh.approx, which moves far fewer e5m2 gradient bytes than their own rounding does.

CE_FORWARD_TILE = (4, 1024, 8)    # BLOCK_T, BLOCK_V, num_warps of _softcap_ce_forward_kernel
CE_BACKWARD_TILE = (64, 128, 8)   # the same of _softcap_ce_backward_kernel (bench/kernels/ce_kernel_bench.py)

@torch.library.custom_op("speedrun::softcap_ce_forward", mutates_args=())
def fused_softcap_ce_forward(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """(summed cross-entropy of softcap(logits), per-token log-sum-exp), both fp32, in one pass over the logits."""
    lse = logits.new_empty(logits.size(0), dtype=torch.float32)
    per_token = torch.empty_like(lse)
    launch_softcap_ce_forward(logits, targets, lse, per_token)
    return per_token.sum(), lse

@fused_softcap_ce_forward.register_fake
def _(logits, targets):
    return logits.new_empty((), dtype=torch.float32), logits.new_empty((logits.size(0),), dtype=torch.float32)

@torch.library.custom_op("speedrun::softcap_ce_backward", mutates_args=())
def fused_softcap_ce_backward(logits: Tensor, lse: Tensor, targets: Tensor, grad: Tensor,
                              grad_s: float) -> tuple[Tensor, Tensor]:
    """The e5m2 operand of the FP8 backward, e5m2(bf16(grad · d loss / d logits) / grad_s), in the (T, V) and the
    (V, T) layout its two GEMMs read."""
    T, V = logits.shape
    g, g_t = logits.new_empty((T, V), dtype=torch.uint8), logits.new_empty((V, T), dtype=torch.uint8)
    launch_softcap_ce_backward(logits, lse, targets, grad, g, g_t, grad_s)
    return g.view(torch.float8_e5m2), g_t.view(torch.float8_e5m2)

@fused_softcap_ce_backward.register_fake
def _(logits, lse, targets, grad, grad_s):
    T, V = logits.shape
    return (logits.new_empty((T, V), dtype=torch.float8_e5m2), logits.new_empty((V, T), dtype=torch.float8_e5m2))

def launch_softcap_ce_forward(logits, targets, lse, per_token):
    """_softcap_ce_forward_kernel: lse (T,) and per_token (T,) = lse - z_target, fp32 buffers."""
    T, V = logits.shape
    assert logits.is_contiguous()
    block_t, block_v, warps = CE_FORWARD_TILE
    assert block_t * V < 2 ** 31, "in-tile offsets are int32"
    _softcap_ce_forward_kernel[(triton.cdiv(T, block_t),)](
        logits, targets, lse, per_token, T, V, CAP=SOFTCAP, WIDTH=SOFTCAP_WIDTH, BLOCK_T=block_t, BLOCK_V=block_v,
        PTX_TANH=not _TRITON_INTERPRET, num_warps=warps)

def launch_softcap_ce_backward(logits, lse, targets, grad, out, out_t, grad_s: float):
    """_softcap_ce_backward_kernel into out (T, V) and out_t (V, T), uint8 buffers of e5m2 bytes."""
    T, V = logits.shape
    block_t, block_v, warps = CE_BACKWARD_TILE
    assert block_t * V < 2 ** 31 and block_v * T < 2 ** 31, "in-tile offsets are int32"
    _softcap_ce_backward_kernel[(triton.cdiv(T, block_t), triton.cdiv(V, block_v))](
        logits, lse, targets, grad, out, out_t, T, V, grad_s, CAP=SOFTCAP, WIDTH=SOFTCAP_WIDTH, BLOCK_T=block_t,
        BLOCK_V=block_v, PTX_TANH=not _TRITON_INTERPRET, num_warps=warps)

class FusedLMHeadLoss(torch.autograd.Function):
    """lm_head_loss in fewer passes: the FP8 matmul, one Triton pass for the log-sum-exp, and in the backward one that
    writes the e5m2 gradient in both layouts the FP8 GEMMs read (no bf16 gradient tensor, cast or transpose)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, targets: Tensor) -> Tensor:
        logits, x_f8_t, w_f8_t = torch.ops.speedrun.fp8_matmul(x, w, FP8_X_SCALE, FP8_W_SCALE, FP8_GRAD_SCALE)
        loss, lse = torch.ops.speedrun.softcap_ce_forward(logits, targets)
        ctx.save_for_backward(logits, targets, lse, x_f8_t, w_f8_t)
        return loss

    @staticmethod
    def backward(ctx, grad: Tensor):
        logits, targets, lse, x_f8_t, w_f8_t = ctx.saved_tensors
        g_f8, g_f8_t = torch.ops.speedrun.softcap_ce_backward(logits, lse, targets, grad, FP8_GRAD_SCALE)
        grad_x, grad_w = torch.ops.speedrun.fp8_matmul_backward(
            g_f8, x_f8_t, w_f8_t, FP8_X_SCALE, FP8_W_SCALE, FP8_GRAD_SCALE, g_f8_t)
        return grad_x, grad_w, None

def fused_lm_head_loss(x: Tensor, w: Tensor, targets: Tensor, fp8: bool) -> Tensor:
    assert fp8, "the fused head is the FP8 one"
    return FusedLMHeadLoss.apply(x, w, targets)

def transpose_bytes(x: Tensor) -> Tensor:
    """Contiguous transpose of a 2-D tensor of 1-byte elements (the FP8 gradient) by a tiled kernel at close to
    memory bandwidth; Inductor, left to itself, fuses it into the producer with scattered 1-byte stores."""
    assert x.dim() == 2 and x.element_size() == 1 and x.is_contiguous()
    if not _kernels_usable(x):
        return x.t().contiguous()
    M, N = x.shape
    y = torch.empty((N, M), dtype=torch.uint8, device=x.device)
    block = 128  # 128-byte rows: full memory transactions on both sides
    _transpose_kernel[(triton.cdiv(M, block), triton.cdiv(N, block))](x.view(torch.uint8), y, M, N, BLOCK=block,
                                                                      num_warps=8)
    return y.view(x.dtype)

if triton is not None:

    @triton.jit
    def _transpose_kernel(X, Y, M, N, BLOCK: tl.constexpr):
        # Y (N, M) = X (M, N)ᵀ, both contiguous: a BLOCK x BLOCK tile is read along X's rows and written along
        # Y's rows, so loads and stores are both coalesced (Triton reshuffles the tile through shared memory).
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = (pid_m * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        cols = (pid_n * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        tile = tl.load(X + rows[:, None] * N + cols[None, :], mask=mask)
        tl.store(Y + cols[:, None] * M + rows[None, :], tl.trans(tile), mask=tl.trans(mask))

    @triton.jit
    def _quantize_transpose_kernel(X, Q, QT, M, N, inv_scale, BLOCK: tl.constexpr):
        # Q (M, N) = e4m3(x · inv_scale) and QT (N, M) its transpose, from one read of a BLOCK x BLOCK tile of X.
        # The fp32 product is rounded once, to e4m3, as Inductor's compile of x.div(scale).to(e4m3) rounds it.
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = (pid_m * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        cols = (pid_n * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
        mask = (rows[:, None] < M) & (cols[None, :] < N)
        x = tl.load(X + rows[:, None] * N + cols[None, :], mask=mask, other=0.0)
        q = (x.to(tl.float32) * inv_scale).to(Q.dtype.element_ty)
        tl.store(Q + rows[:, None] * N + cols[None, :], q, mask=mask)
        tl.store(QT + cols[:, None] * M + rows[None, :], tl.trans(q), mask=tl.trans(mask))

    @triton.jit
    def _tanh_approx(y, PTX: tl.constexpr):
        # One special-function instruction on NVIDIA GPUs (relative error about 2^-11); the interpreter runs no
        # PTX, so there the same value comes from the exact identity tanh(y) = 2·sigmoid(2y) - 1.
        if PTX:
            return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [y], dtype=tl.float32,
                                             is_pure=True, pack=1)
        else:
            return 2.0 * tl.sigmoid(2.0 * y) - 1.0

    @triton.jit
    def _softcap_sigmoid(x, WIDTH: tl.constexpr, FAST: tl.constexpr, PTX_TANH: tl.constexpr):
        # s = sigmoid(logit/WIDTH), softcap's z = CAP·s. FAST: (1 + tanh(logit/(2·WIDTH)))/2 with tanh.approx,
        # one special-function instruction instead of an exponential and a full-precision division.
        if FAST:
            return 0.5 + 0.5 * _tanh_approx(x * (0.5 / WIDTH), PTX_TANH)
        else:
            return tl.sigmoid(x / WIDTH)

    @triton.jit
    def _softcap_ce_backward_kernel(logits, lse, targets, grad, out, out_t, T, V, grad_s,
                                    CAP: tl.constexpr, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr,
                                    BLOCK_V: tl.constexpr, PTX_TANH: tl.constexpr):
        # One (BLOCK_T x BLOCK_V) tile of grad·d/dlogits sum_t CE(softcap(logits_t), target_t):
        #   g = grad·(softmax(z) - onehot)·(CAP/WIDTH)·s·(1-s),  z = CAP·s, s = sigmoid(logit/WIDTH)
        # rounded to bf16 (the record's gradient dtype), divided by grad_s, cast to e5m2 and stored as (T, V) for dX
        # and as (V, T) for dW (FP8 GEMMs need the reduction dim contiguous), both stores coalesced. Fast math:
        # tanh.approx for the sigmoid and a multiplication by 1/grad_s.
        row0 = tl.program_id(0) * BLOCK_T
        col0 = tl.program_id(1) * BLOCK_V
        r = tl.arange(0, BLOCK_T)   # in-tile offsets stay int32; only the tile bases are 64-bit
        c = tl.arange(0, BLOCK_V)
        rows = row0 + r
        cols = col0 + c
        rmask = rows < T
        mask = rmask[:, None] & (cols[None, :] < V)
        tile = row0.to(tl.int64) * V + col0             # (row0, col0) in the (T, V) layout
        tile_t = col0.to(tl.int64) * T + row0           # (col0, row0) in the (V, T) layout
        x = tl.load(logits + tile + (r[:, None] * V + c[None, :]), mask=mask, other=0.0).to(tl.float32)
        row_lse = tl.load(lse + rows, mask=rmask, other=0.0)
        row_target = tl.load(targets + rows, mask=rmask, other=-1)
        scale = tl.load(grad).to(tl.float32)
        s = _softcap_sigmoid(x, WIDTH, True, PTX_TANH)
        p = tl.exp(CAP * s - row_lse[:, None])
        onehot = (cols[None, :] == row_target[:, None]).to(tl.float32)
        g = scale * (p - onehot) * (CAP / WIDTH) * s * (1.0 - s)
        g = g.to(tl.bfloat16).to(tl.float32) * (1.0 / grad_s)
        q = g.to(tl.float8e5).to(tl.uint8, bitcast=True)
        tl.store(out + tile + (r[:, None] * V + c[None, :]), q, mask=mask)
        tl.store(out_t + tile_t + (c[:, None] * T + r[None, :]), tl.trans(q), mask=tl.trans(mask))

    @triton.jit
    def _softcap_ce_forward_kernel(logits, targets, lse, per_token, T, V, CAP: tl.constexpr, WIDTH: tl.constexpr,
                                   BLOCK_T: tl.constexpr, BLOCK_V: tl.constexpr, PTX_TANH: tl.constexpr):
        # BLOCK_T rows of the (T, V) logits, swept in BLOCK_V-wide chunks: lse = log sum_v exp(CAP·s) with no max
        # pass (the softcap bounds z below CAP), then per_token = lse - z_target. exp(CAP·s) is one exp2 with
        # the constant folded; the sigmoid comes from tanh.approx, as in the fused backward. The
        # target's term keeps the exact sigmoid.
        row0 = tl.program_id(0) * BLOCK_T
        r = tl.arange(0, BLOCK_T)
        rows = row0 + r
        rmask = rows < T
        base = row0.to(tl.int64) * V
        acc = tl.zeros([BLOCK_T], dtype=tl.float32)
        for col0 in range(0, V, BLOCK_V):
            cols = col0 + tl.arange(0, BLOCK_V)
            mask = rmask[:, None] & (cols[None, :] < V)
            x = tl.load(logits + base + (r[:, None] * V + cols[None, :]), mask=mask, other=0.0).to(tl.float32)
            s = _softcap_sigmoid(x, WIDTH, True, PTX_TANH)
            e = tl.exp2(s * (CAP * 1.4426950408889634))
            acc += tl.sum(tl.where(mask, e, 0.0), axis=1)
        row_lse = tl.log(acc)
        target = tl.load(targets + rows, mask=rmask, other=0)
        x_t = tl.load(logits + rows.to(tl.int64) * V + target, mask=rmask, other=0.0).to(tl.float32)
        z_t = CAP * _softcap_sigmoid(x_t, WIDTH, False, PTX_TANH)
        tl.store(lse + rows, row_lse, mask=rmask)
        tl.store(per_token + rows, row_lse - z_t, mask=rmask)

def needs_cuda_triton(fp8: bool = True):
    if triton is None or not torch.cuda.is_available() or not fp8:
        raise RuntimeError("it is the FP8 head's Triton kernels: it needs a CUDA GPU and FP8 on (--fp8)")
    if not 0 < SOFTCAP <= 60:  # its log-sum-exp skips the max pass: 50304·e^SOFTCAP must fit fp32
        raise RuntimeError(f"its log-sum-exp has no max pass and overflows fp32 past SOFTCAP 60 (it is {SOFTCAP})")

FUSED_KERNELS["lm_head_loss"] = FusedKernel(lm_head_loss, fused_lm_head_loss, (lm_head_loss, softcap, lm_head_fp8),
                                            "711468e47622", needs_cuda_triton)

KERNEL_MIN_DIM = 64          # matrices with fewer rows (wide orientation) use torch matmuls: the gates
                             # (6x12, 1x12) are pure launch latency, cuBLAS/inductor handle them as well
_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

_SMEM_BUDGET = 160 * 1024    # H100/H200 have 227 KB per block; keep room for the epilogue's layout conversion

def _pow2_at_least(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()

def kernel_config(kind: str, n: int, m: int, k: int, dtype) -> dict:
    """Tiles and launch config of xxt ((n, m, k) -> (n, m, m)), ba_plus_cAA or ax_plus_bx ((n, m, m) x (n, m, k)):
    128x128 tiles, BLOCK_K 64, 8 warps, 4 stages (3 for ax_plus_bx), smaller where a matrix or _SMEM_BUDGET is."""
    elsize = torch.empty((), dtype=dtype).element_size()
    sym = kind in ("xxt", "ba_plus_cAA")
    if kind == "ba_plus_cAA":
        k = m
    out_rows, out_cols, red = (m, m, k) if sym else (m, k, m)
    if min(out_rows, out_cols) >= 128:
        bm = bn = 128
    elif min(out_rows, out_cols) >= 64:
        bm = bn = 64
    else:
        bm = min(64, max(16, _pow2_at_least(out_rows)))
        bn = bm if sym else min(64, max(16, _pow2_at_least(out_cols)))
    bk = min(64, max(16, _pow2_at_least(red)))
    warps = 8 if bm * bn >= 128 * 128 else 4
    stages = 4 if sym else 3
    while stages > 1 and stages * (bm + bn) * bk * elsize > _SMEM_BUDGET:
        stages -= 1
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)

if triton is not None:

    @triton.jit
    def _dot_acc(a, b, acc):
        # acc += a·b; fp32 operands are multiplied exactly (IEEE), not in TF32
        if a.dtype == tl.float32:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _sym_gram_kernel(X, C, M, K, alpha, beta,
                         s_xb, s_xm, s_xk, s_cb, s_cm, s_cn,
                         BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN: tl.constexpr, ADD_X: tl.constexpr):
        # ns_line_1 (ADD_X=False): C[b] = X[b] X[b]ᵀ.
        # ns_line_2 (ADD_X=True):  C[b] = alpha·X[b]X[b]ᵀ + beta·X[b] for square symmetric X (= c·A·A + b·A,
        # since A·A = A·Aᵀ). Either way C is symmetric: program (pid, b) owns output tile (i, j) = divmod(pid, T),
        # only j <= i is computed, stored at (i, j) and transposed at (j, i).  fp32 accumulation.
        pid = tl.program_id(0)
        bid = tl.program_id(1).to(tl.int64)
        T = tl.cdiv(M, BLOCK_M)
        ti = pid // T
        tj = pid % T
        if tj > ti:
            return
        X += bid * s_xb
        C += bid * s_cb
        rows = ti * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tj * BLOCK_M + tl.arange(0, BLOCK_M)
        offk = tl.arange(0, BLOCK_K)
        a_ptr = X + rows[:, None] * s_xm + offk[None, :] * s_xk        # (BM, BK) rows of tile i
        b_ptr = X + cols[None, :] * s_xm + offk[:, None] * s_xk        # (BK, BM) rows of tile j, transposed
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN:
                a = tl.load(a_ptr)
                b = tl.load(b_ptr)
            else:
                kk = k0 + offk
                a = tl.load(a_ptr, mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
                b = tl.load(b_ptr, mask=(cols[None, :] < M) & (kk[:, None] < K), other=0.0)
            acc = _dot_acc(a, b, acc)
            a_ptr += BLOCK_K * s_xk
            b_ptr += BLOCK_K * s_xk
        mask = (rows[:, None] < M) & (cols[None, :] < M)
        if ADD_X:
            x_tile = tl.load(X + rows[:, None] * s_xm + cols[None, :] * s_xk, mask=mask, other=0.0)
            # (the casts: Inductor passes Python floats as fp64)
            acc = tl.cast(alpha, tl.float32) * acc + tl.cast(beta, tl.float32) * x_tile.to(tl.float32)
        out = acc.to(C.dtype.element_ty)
        tl.store(C + rows[:, None] * s_cm + cols[None, :] * s_cn, out, mask=mask)
        if tj < ti:
            tl.store(C + cols[:, None] * s_cm + rows[None, :] * s_cn, tl.trans(out),
                     mask=(cols[:, None] < M) & (rows[None, :] < M))

    @triton.jit
    def _ax_plus_bx_kernel(X, B, C, M, K, alpha,
                           s_xb, s_xm, s_xk, s_bb, s_bm, s_bn, s_cb, s_cm, s_ck,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           EVEN: tl.constexpr):
        # C[b] = alpha·X[b] + B[b] X[b] with X (M, K), B (M, M) (s_bb == 0 broadcasts one B over the batch).
        # ns_line_3: the fp32 accumulator starts at alpha·X and B·X accumulates into it.  Every load is masked on
        # its rows/cols AND its reduction index (an unmasked row once read out of bounds) unless EVEN says all
        # blocks are in bounds.
        pid = tl.program_id(0)
        bid = tl.program_id(1).to(tl.int64)
        tn = tl.cdiv(K, BLOCK_N)
        ti = pid // tn
        tj = pid % tn
        X += bid * s_xb
        B += bid * s_bb
        C += bid * s_cb
        rows = ti * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tj * BLOCK_N + tl.arange(0, BLOCK_N)
        offk = tl.arange(0, BLOCK_K)
        out_mask = (rows[:, None] < M) & (cols[None, :] < K)
        if EVEN:
            x0 = tl.load(X + rows[:, None] * s_xm + cols[None, :] * s_xk)
        else:
            x0 = tl.load(X + rows[:, None] * s_xm + cols[None, :] * s_xk, mask=out_mask, other=0.0)
        acc = x0.to(tl.float32) * tl.cast(alpha, tl.float32)   # inductor passes Python floats as fp64
        b_ptr = B + rows[:, None] * s_bm + offk[None, :] * s_bn        # (BM, BK)
        x_ptr = X + offk[:, None] * s_xm + cols[None, :] * s_xk        # (BK, BN)
        for k0 in range(0, M, BLOCK_K):
            if EVEN:
                b = tl.load(b_ptr)
                x = tl.load(x_ptr)
            else:
                kk = k0 + offk
                b = tl.load(b_ptr, mask=(rows[:, None] < M) & (kk[None, :] < M), other=0.0)
                x = tl.load(x_ptr, mask=(kk[:, None] < M) & (cols[None, :] < K), other=0.0)
            acc = _dot_acc(b, x, acc)
            b_ptr += BLOCK_K * s_bn
            x_ptr += BLOCK_K * s_xm
        tl.store(C + rows[:, None] * s_cm + cols[None, :] * s_ck, acc.to(C.dtype.element_ty), mask=out_mask)

def _as_batched(t: Tensor) -> Tensor:
    return t if t.dim() == 3 else t.unsqueeze(0)

def xxt(X: Tensor, out: Tensor = None) -> Tensor:
    """out = X Xᵀ for X (m, k) or (n, m, k) -> (m, m) / (n, m, m), in X's dtype (fp32 accumulation)."""
    out = X.new_empty(*X.shape[:-1], X.size(-2)) if out is None else out
    if not _kernels_usable(X):
        return torch.matmul(X, X.mT, out=out)
    return _launch_sym_gram("xxt", X, out, 1.0, 0.0, add_x=False)

def ba_plus_cAA(A: Tensor, b: float, c: float, out: Tensor = None) -> Tensor:
    """out = b·A + c·A·A for symmetric A (m, m) or (n, m, m) (symmetry is assumed, not checked)."""
    out = torch.empty_like(A) if out is None else out
    if not _kernels_usable(A):
        return torch.add(torch.mul(A, b), torch.matmul(A, A), alpha=c, out=out)
    return _launch_sym_gram("ba_plus_cAA", A, out, float(c), float(b), add_x=True)

def _launch_sym_gram(kind: str, X: Tensor, out: Tensor, alpha: float, beta: float, add_x: bool) -> Tensor:
    X3, C3 = _as_batched(X), _as_batched(out)
    n, m, k = X3.shape
    cfg = kernel_config(kind, n, m, k, X.dtype)
    bm, bk = cfg["BLOCK_M"], cfg["BLOCK_K"]
    t = triton.cdiv(m, bm)
    _sym_gram_kernel[(t * t, n)](
        X3, C3, m, k, alpha, beta, *X3.stride(), *C3.stride(), BLOCK_M=bm, BLOCK_K=bk,
        EVEN=(m % bm == 0 and k % bk == 0), ADD_X=add_x, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out

def ax_plus_bx(X: Tensor, B: Tensor, a: float, out: Tensor = None) -> Tensor:
    """out = a·X + B X for X (m, k) / (n, m, k) and B (m, m) / (n or 1, m, m); out must not alias X."""
    out = torch.empty_like(X) if out is None else out
    if not _kernels_usable(X):
        if X.dim() == 3 and B.shape == (X.size(0), X.size(1), X.size(1)):
            return torch.baddbmm(X, B, X, beta=a, out=out)
        return torch.add(torch.matmul(B, X), X, alpha=a, out=out)
    X3, B3, C3 = _as_batched(X), _as_batched(B), _as_batched(out)
    n, m, k = X3.shape
    cfg = kernel_config("ax_plus_bx", n, m, k, X.dtype)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    s_bb = 0 if B3.size(0) == 1 else B3.stride(0)
    _ax_plus_bx_kernel[(triton.cdiv(m, bm) * triton.cdiv(k, bn), n)](
        X3, B3, C3, m, k, float(a), *X3.stride(), s_bb, B3.stride(1), B3.stride(2), *C3.stride(),
        EVEN=(m % bm == 0 and k % bn == 0 and m % bk == 0), **cfg)
    return out
_TRITON_OPS = (xxt, ba_plus_cAA, ax_plus_bx)


# =====================================================================================
# Engine room: the runtime (devices, processes, CUDA graphs, diagnostics)
# =====================================================================================

@dataclass(frozen=True)
class Runtime:
    """How this process runs, resolved once from the settings, the launcher's environment and the machine."""
    device: str               # cuda | cpu
    rank: int
    local_rank: int
    world_size: int
    launched: bool            # started by torchrun (RANK, MASTER_ADDR set): a process group even for one process
    grad_accum_steps: int     # micro-batches per step: 8 // world_size, so the global batch never changes
    compile: bool
    fp8: bool
    kernels: dict = field(default_factory=dict)      # {name: the function the model calls} (resolve_kernels)
    kernel_notes: tuple = ()                          # fused kernels that cannot run here, and why
    cuda_graphs: bool = False         # training micro-batches replayed as CUDA graphs (MicroBatchGraphs)
    check_graphs: bool = False        # --cuda-graphs check: each stage's first step graphed and eager, compared
    bf16_gemms_in_fp32: bool = False  # a CPU without native bf16 GEMMs: they run in fp32 (bf16_gemms_in_fp32)

    @property
    def master(self) -> bool:
        return self.rank == 0

    @property
    def fused(self) -> str:
        """The fused kernels in use, comma-separated ("none": the plain model)."""
        return ",".join(n for n, fn in self.kernels.items() if fn is not FUSED_KERNELS[n].plain) or "none"

    def config_line(self, args: Hyperparameters) -> str:
        """The log's `Run config:` line (records/compare.py reads it)."""
        gpu_name = torch.cuda.get_device_name() if self.device == "cuda" else "cpu"
        return (f'Run config: world_size={self.world_size} grad_accum_steps={self.grad_accum_steps} '
                f'device={self.device} kernels={args.kernels} fused={self.fused} '
                f'orthogonalizer={args.orthogonalizer} fp8={int(self.fp8)} compile={int(self.compile)} '
                f'cuda_graphs={int(self.cuda_graphs)} bf16_gemms_in_fp32={int(self.bf16_gemms_in_fp32)} '
                f'data_path={args.data_path} train_epochs={args.train_epochs} smoke={int(args.smoke)} '
                f'num_iterations={args.num_iterations} seed={args.seed} gpu_name="{gpu_name}"')

def grad_accum_steps_for(world_size: int) -> int:
    if world_size in (1, 2, 4, 8):
        return 8 // world_size
    if world_size > 8 and world_size % 8 == 0:
        return 1  # multi-node: one micro-batch per rank, same global batch
    raise ConfigError(f"world size {world_size} is not supported: launch 1, 2, 4 or 8 processes per node "
                      "(or a multiple of 8 across nodes), e.g. torchrun --nproc_per_node=8")

def pick_device(args: Hyperparameters) -> str:
    if args.device != "cpu" and torch.cuda.is_available():
        return "cuda"
    if args.device == "cuda":
        raise ConfigError("no CUDA device found: run on NVIDIA GPUs, or add --device cpu (slow; try --smoke)")
    if args.device == "cpu" or args.smoke:
        return "cpu"
    raise ConfigError("no CUDA device found: run on NVIDIA GPUs, or add --device cpu --smoke for a CPU smoke run")

def launcher_variables(env, check: bool = False) -> tuple[int, int, int]:
    """(WORLD_SIZE, RANK, LOCAL_RANK) as torchrun sets them (1, 0, 0 without it), checked; `check` (--check for
    WORLD_SIZE processes, which it does not start) needs no rendezvous."""
    values = {}
    for name, default in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        text = env.get(name, default)
        if not re.fullmatch(r"\d{1,9}", text.strip()):
            raise ConfigError(f"{name}={text!r} is not a process count or rank: torchrun sets it; unset it to run one "
                              "process, or launch with torchrun")
        values[name] = int(text)
    world, rank, local = values["WORLD_SIZE"], values["RANK"], values["LOCAL_RANK"]
    if world < 1 or rank >= world or local > rank:
        raise ConfigError(f"WORLD_SIZE={world}, RANK={rank}, LOCAL_RANK={local} do not describe a process of a run "
                          "(a rank is below the world size): unset them to run one process, or launch with torchrun")
    grad_accum_steps_for(world)  # a world size that is not supported is said first
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if world > 1 and missing and not check:
        raise ConfigError(f"WORLD_SIZE={world} but {', '.join(missing)} not set: start the processes with torchrun "
                          "(./run.sh launch N), or unset WORLD_SIZE to run one process")
    return world, rank, local

def resolve_runtime(args: Hyperparameters) -> Runtime:
    """Every derived setting, once: what the model, the optimizers, the log and the benchmark all read."""
    world_size, rank, local_rank = launcher_variables(os.environ, check=args.check or args.check_flags)
    device = pick_device(args)
    if device != args.device and device == "cpu" and rank == 0:
        print("note: no CUDA device found, so the smoke run trains on the CPU (--device cpu says so and silences "
              "this)", file=sys.stderr, flush=True)
    use_compile = args.compile == "on" or (args.compile == "auto" and device == "cuda")
    if use_compile and device != "cuda":
        raise ConfigError("--compile on needs a CUDA GPU (the CPU's reference attention cannot be compiled)")
    if args.fp8 == "on" and device != "cuda":
        raise ConfigError("--fp8 on needs a CUDA GPU (FP8 matmuls); use --fp8 auto or off on the CPU")
    if args.cuda_graphs in ("on", "check") and device != "cuda":
        raise ConfigError(f"--cuda-graphs {args.cuda_graphs} needs a CUDA GPU: use --cuda-graphs auto or off")
    fp8 = args.fp8 == "on" or (args.fp8 == "auto" and device == "cuda")
    kernels, notes = resolve_kernels(args.kernels, device, fp8)
    graphs = args.cuda_graphs in ("on", "check") or (args.cuda_graphs == "auto" and device == "cuda" and use_compile)
    return Runtime(device=device, rank=rank, local_rank=local_rank, world_size=world_size,
                   launched=bool(os.environ.get("MASTER_ADDR")) and "RANK" in os.environ,
                   grad_accum_steps=grad_accum_steps_for(world_size), compile=use_compile, fp8=fp8, kernels=kernels,
                   kernel_notes=tuple(notes), cuda_graphs=graphs, check_graphs=args.cuda_graphs == "check",
                   bf16_gemms_in_fp32=device == "cpu" and not use_compile and not native_bf16_gemms())

def setup_process_group(runtime: Runtime):
    if runtime.device == "cuda":
        torch.cuda.set_device(runtime.local_rank)
        # Works around a first-backward bug seen on some systems (the record does the same).
        torch.zeros(1, device="cuda", requires_grad=True).sum().backward()
    else:  # glibc hands freed blocks of 32 MiB or more (fp32 logits) back and page-faults them in again: 1/3 of a step
        libc = ctypes.CDLL(None)
        if hasattr(libc, "mallopt"):  # M_MMAP_MAX 0: no block mapped alone; M_TRIM_THRESHOLD: keep up to 1 GiB free
            libc.mallopt(-4, 0), libc.mallopt(-1, 1 << 30)
    if (runtime.world_size > 1 or runtime.launched) and not dist.is_initialized():  # bench.py may have made one
        device_id = torch.device("cuda", runtime.local_rank) if runtime.device == "cuda" else None
        dist.init_process_group("gloo" if device_id is None else "nccl", device_id=device_id)
        dist.barrier()

# --- CUDA graphs of the training micro-batch ---
# At stage 1 the host needs about as long to launch a micro-batch's few hundred kernels as the GPU needs to run
# them. A CUDA graph records one micro-batch's forward and backward launches, every kernel library's included, and
# replays them with one call, reading and writing the addresses it was captured with: the graphs keep their own
# batch tensors and one set of gradients, and share one memory pool for their temporaries. Host values are frozen
# at capture (see GPT.forward). With several processes, the micro-batch that ends an Adam step launches DistAdam's
# reduce-scatters from its gradient hooks: NCCL collectives can be captured (NCCL 2.9+) when every rank captures and
# replays the same graphs in the same order, which the keys guarantee. Such a capture ends by joining NCCL's
# stream, so a replay leaves the averaged gradients where DistAdam's step reads them.

class CudaGraph:
    """torch.cuda.CUDAGraph captured on a side stream. The first capture runs the micro-batch there eagerly first (state
    made lazily per stream, cuBLAS's workspace, must not be made in a capture); later ones only record."""
    stream = pool = None  # shared by every capture

    def capture(self, fn) -> bool:
        """Record fn. True where fn also ran (the micro-batch's work is done), False where a replay must do it."""
        first = CudaGraph.stream is None
        if first:
            CudaGraph.stream, CudaGraph.pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
        side = CudaGraph.stream
        side.wait_stream(torch.cuda.current_stream())
        if first:
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: NCCL's watchdog thread may query its events while this thread captures
        with torch.cuda.graph(self.graph, pool=CudaGraph.pool, stream=side, capture_error_mode="thread_local"):
            fn()
        return first

    def replay(self):
        self.graph.replay()

    @staticmethod
    def pool_bytes() -> int:
        """Memory the graphs' pool holds (reserved for their temporaries; not in the allocator's allocated count)."""
        if CudaGraph.pool is None:
            return 0
        pool = tuple(CudaGraph.pool)
        return sum(seg["total_size"] for seg in torch.cuda.memory_snapshot()
                   if tuple(seg.get("segment_pool_id", ())) == pool)

class MicroBatchGraphs:
    """Training micro-batches as graphs, one per key (shapes, windows, softmax scale, whether it launches DistAdam's
    reduce-scatters, which gradients it starts): a key's first micro-batch is captured, later ones replay.
    writes_first (one micro-batch a step, 8 GPUs): a gradient set to None is handed over by autograd and copied into
    its buffer, as the record's backward does, instead of added to a zeroed buffer."""

    def __init__(self, model: nn.Module, adam: "DistAdam", grad_buffers: dict = None, writes_first: bool = False):
        self.model, self.adam, self.writes_first = model, adam, writes_first
        self.params = [p for p in model.parameters() if p.requires_grad]
        grad_buffers = grad_buffers or {}  # param -> where an optimizer wants its gradient (NorMuon's stacks)
        # the gradients every graph accumulates into, made here, outside the graphs' memory pool
        self.grads = [grad_buffers[p] if p in grad_buffers else torch.zeros_like(p) for p in self.params]
        device = self.params[0].device
        self.divisor = torch.zeros((), dtype=torch.float32, device=device)  # micro-batches per step
        self.loss = torch.zeros((), dtype=torch.float32, device=device)     # the last replayed micro-batch's loss
        self.divisor_value = None
        self.graphs = {}         # key -> (graph, static copies of the batch tensors, params it reduce-scatters)
        self.captures = self.replays = 0

    def key(self, batch, ws_short: int, ws_long: int) -> tuple:
        """The last entry: the indices of the params whose gradient this micro-batch starts (writes_first only)."""
        reduces = self.adam.should_sync and self.adam.world_size > 1
        grads_started = tuple(i for i, p in enumerate(self.params) if p.grad is None) if self.writes_first else ()
        return (tuple((t.shape, t.dtype) for t in batch), ws_short, ws_long, self.model.yarn.attn_scale, reduces,
                grads_started)

    def attach_grads(self, grads_started: tuple = ()):
        """Point every .grad at the graphs' buffers: None becomes the zeroed buffer, a gradient made elsewhere is copied
        into it; the params in grads_started stay None (the graph writes their buffers)."""
        zero = []
        for i, (p, g) in enumerate(zip(self.params, self.grads)):
            if p.grad is g or i in grads_started:
                continue
            if p.grad is None:
                zero.append(g)
            else:
                g.copy_(p.grad)
            p.grad = g
        if zero:
            torch._foreach_zero_(zero)

    def take_started_grads(self, grads_started: tuple):
        """Copy the backward's gradients for grads_started into their buffers (none: zeros); point .grad at them."""
        made = [i for i in grads_started if self.params[i].grad is not None]
        if made:
            torch._foreach_copy_([self.grads[i] for i in made], [self.params[i].grad for i in made])
        unused = [self.grads[i] for i in grads_started if self.params[i].grad is None]
        if unused:
            torch._foreach_zero_(unused)
        for i in grads_started:
            self.params[i].grad = self.grads[i]

    def run(self, batch: tuple, ws_short: int, ws_long: int, micro_batches: int, forward_backward) -> Tensor:
        """One micro-batch through its graph: forward_backward(inputs, targets, cu_seqlens, ws_short, ws_long, divisor)
        runs loss / divisor backward and returns the loss, which the graph writes into self.loss (returned; the next
        micro-batch writes over it)."""
        key = self.key(batch, ws_short, ws_long)
        grads_started = key[-1]
        self.attach_grads(grads_started)
        if micro_batches != self.divisor_value:
            self.divisor.fill_(micro_batches)
            self.divisor_value = micro_batches
        entry = self.graphs.get(key)
        if entry is None:
            static = tuple(t.clone() for t in batch)
            reduced = []

            def micro_batch():
                for i in grads_started:  # an eager run before the capture left its buffer here
                    self.params[i].grad = None
                self.loss.copy_(forward_backward(*static, ws_short, ws_long, self.divisor))
                self.take_started_grads(grads_started)
                reduced[:] = self.adam.join_reduce_scatters()

            graph = CudaGraph()
            ran = graph.capture(micro_batch)
            entry = self.graphs[key] = (graph, static, reduced)
            self.captures += 1
            if ran:
                return self.loss
        else:
            for mine, t in zip(entry[1], batch):
                mine.copy_(t, non_blocking=True)
        graph, _, reduced = entry
        graph.replay()
        for i in grads_started:  # the replay wrote their buffers; .grad is still None (no Python runs in a replay)
            self.params[i].grad = self.grads[i]
        if reduced:
            self.adam.reduce_scatters_replayed(reduced)
        self.replays += 1
        return self.loss

def compiled_graph_count() -> int:
    """Graphs torch.compile has produced in this process (model regions and optimizer helpers)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])

def compile_cache_counts() -> dict:
    """This process's cache hits and misses: Inductor's compiled graphs and AOT autograd's traced ones."""
    c = torch._dynamo.utils.counters
    return {group: dict(hits=int(c[group][f"{name}_hit"]), misses=int(c[group][f"{name}_miss"]))
            for group, name in (("inductor", "fxgraph_cache"), ("aot_autograd", "autograd_cache"))}

def no_compiles_allowed(enabled: bool = True):
    """Context in which any torch.compile (re)compilation raises instead of silently spending tens of seconds:
    every graph the timed loop needs must have been compiled by the warm-up."""
    return torch.compiler.set_stance("fail_on_recompile") if enabled else contextlib.nullcontext()

def replicas_identical(model: nn.Module) -> bool:
    """True when every rank holds bit-identical parameters (integer checksums of the raw bits, all-gathered)."""
    sums = []
    for p in model.parameters():
        bits = p.detach().contiguous().view(torch.int16 if p.element_size() == 2 else torch.int32).long().flatten()
        weights = torch.arange(1, bits.numel() + 1, device=bits.device) % 65521  # position-sensitive
        sums += [bits.sum(), (bits * weights).sum()]
    local = torch.stack(sums)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return all(torch.equal(g, gathered[0]) for g in gathered)

def synchronize(device: str):
    if device == "cuda":
        torch.cuda.synchronize()

def peak_memory(device: str) -> tuple:
    """(allocated, reserved, the graphs' pool) in MiB: reserved is all the process holds on the GPU, the graphs' pool
    (their temporaries, not counted as allocated) included. A CPU run: its peak resident set size for both."""
    if device == "cuda":
        return (torch.cuda.max_memory_allocated() // 2**20, torch.cuda.max_memory_reserved() // 2**20,
                CudaGraph.pool_bytes() // 2**20)
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    return rss, rss, 0

class NonFiniteLossWatch:
    """Stops a run whose training loss is no longer finite without making the host wait: the device counts the steps
    with a finite loss, and rank 0 reads that count from a pinned copy once its event has passed, a step or two later
    (a non-finite loss on any rank reaches every rank's weights at the next step; the launcher ends the others)."""

    def __init__(self, device: str, master: bool):
        self.active, self.cuda = master, device == "cuda"
        self.finite_steps = torch.zeros((), dtype=torch.int64, device=device)
        self.seen = torch.zeros((), dtype=torch.int64, pin_memory=self.cuda)
        self.copied_steps, self.copied = 0, None  # steps the count in `seen` covers, and its copy's event

    def after_step(self, step: int, loss: Tensor):
        if not self.active:
            return
        self.finite_steps += torch.isfinite(loss)
        if self.copied is not None and not self.copied.query():
            return
        if int(self.seen) < self.copied_steps:
            raise TrainingDiverged(f"stopped at step {int(self.seen) + 1}: its training loss is not finite")
        self.seen.copy_(self.finite_steps, non_blocking=self.cuda)
        self.copied_steps = step + 1
        if self.cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

# --- bf16 GEMMs on CPUs without native bf16 ---
# On x86 CPUs without AVX-512 (most laptops, AMD servers) ATen runs bf16 GEMMs as loops 5-7x slower than an fp32
# GEMM. A bf16 x bf16 product is exact in fp32, so an fp32 GEMM of the bf16 operands rounded once to bf16 is what a
# bf16 GEMM with fp32 accumulation computes (up to the order of the sums): there the eager CPU path takes it.

def native_bf16_gemms() -> bool:
    """Whether ATen hands bf16 GEMMs on this CPU to oneDNN (honours ONEDNN_MAX_CPU_ISA)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False

def gemm_in_fp32(gemm_out):
    """A CPU kernel for a GEMM op: bf16 operands widened to fp32, ATen's kernel (the op's out= form), rounded once."""
    def kernel(*args, **kwargs):
        bf16 = args[-1].dtype == torch.bfloat16
        args = [a.float() if bf16 and isinstance(a, Tensor) else a for a in args]
        out = gemm_out(*args, **kwargs, out=args[-1].new_empty(0))
        return out.bfloat16() if bf16 else out
    return kernel

@contextlib.contextmanager
def bf16_gemms_in_fp32():
    """Within it, every bf16 CPU GEMM (the backward's too) runs in fp32, rounded once: the four GEMM ops get CPU kernels
    of their own, process-wide (a dispatch mode would send every op through Python, 30x the calls). Not reentrant."""
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ATen's notice that a kernel is overridden
        for op in ("mm", "addmm", "bmm", "baddbmm"):
            lib.impl(op, gemm_in_fp32(getattr(torch.ops.aten, op).out), "CPU")
    try:
        yield
    finally:
        lib._destroy()  # ATen's own kernels again


# =====================================================================================
# Engine room: the log, checkpoints, locks and every way a run ends
# =====================================================================================

def process_start_time() -> float:
    """When this process started, on the wall clock: the cold-start figure then counts the imports of torch, Triton
    and the kernel libraries too. Linux reads it from /proc (start ticks against the uptime); elsewhere, now."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])  # field 22, after the name
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return time.time() - uptime + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()

PROCESS_START = process_start_time()  # for the cold-start figure in the log
SEPARATOR = "=" * 100
LOG_SIGNATURE = '"""speedrun:'  # how every log starts: the source of the script that wrote it, whose first line this is

def is_our_log(path: Path) -> bool:
    """A log this trainer wrote: a regular file that starts with LOG_SIGNATURE."""
    try:
        with open(path, "rb") as f:
            return stat.S_ISREG(os.fstat(f.fileno()).st_mode) and f.read(len(LOG_SIGNATURE)) == LOG_SIGNATURE.encode()
    except OSError:
        return False

CHECKPOINT_FILE = re.compile(r"state_step\d+\.pt|\.state_step\d+\.pt\..+\.tmp")  # save_checkpoint's names

def is_our_checkpoint_folder(folder: Path) -> bool:
    """A checkpoint folder this trainer wrote: a real folder holding only save_checkpoint's files."""
    return folder.is_dir() and not folder.is_symlink() and \
        all(f.is_file() and CHECKPOINT_FILE.fullmatch(f.name) for f in folder.iterdir())

def make_folders(folder: Path) -> list:
    """mkdir -p, returning the folders it created (deepest last)."""
    missing = []
    while not os.path.lexists(folder) and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for f in reversed(missing):
        f.mkdir(exist_ok=True)
    return list(reversed(missing))

class RunLock:
    """An exclusive lock (flock) on <log-dir>/<run-id>.lock, taken by rank 0 before anything is written and held for
    the run's whole life: a second run of the same run id is refused, with or without --replace-log, instead of
    replacing or interleaving the first one's log. The kernel drops a lock with its process, so a killed run leaves
    only a stale file that the next run takes over; a .lock file this trainer did not write is never touched."""
    SIGNATURE = b"speedrun run lock: "
    held = None  # this process's lock: main() releases it however the run ends

    def __init__(self, path: Path, fd: int, made: list):
        self.path, self.fd, self.made = path, fd, made

    @staticmethod
    def path_for(log_file: Path) -> Path:
        return log_file.with_suffix(".lock")

    @staticmethod
    def same_file(fd: int, path: Path) -> bool:
        try:
            a, b = os.fstat(fd), os.stat(path, follow_symlinks=False)
        except OSError:
            return False
        return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)

    @classmethod
    def refusal(cls, fd: int, path: Path, run_id: str) -> ConfigError | None:
        """Why a run may not take this lock file (None: it may): not ours, or held by a run still going."""
        if os.pread(fd, len(cls.SIGNATURE), 0) != cls.SIGNATURE:
            return ConfigError(f"{path} exists and is not a run lock of this trainer: move it away, or pick another "
                               "--run-id")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0)[len(cls.SIGNATURE):].decode(errors="replace").strip()
            return ConfigError(f"--run-id {run_id} is in use by a run still going ({holder}): wait for it to end, or "
                               "pick another --run-id")
        return None

    @classmethod
    def check(cls, log_file: Path) -> None:
        """Refuse as acquire() would, writing nothing (--check)."""
        path = cls.path_for(log_file)
        if not os.path.lexists(path):
            return
        if path.is_symlink() or not path.is_file():
            raise ConfigError(f"{path} exists and is not a run lock of this trainer: move it away, or pick another "
                              "--run-id")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            if refusal := cls.refusal(fd, path, log_file.stem):
                raise refusal
        finally:
            os.close(fd)

    @classmethod
    def acquire(cls, log_file: Path) -> "RunLock":
        path = cls.path_for(log_file)
        made = make_folders(path.parent)
        try:
            while True:
                fd = cls.open_or_create(path)
                refusal = cls.refusal(fd, path, log_file.stem)
                if refusal is None and cls.same_file(fd, path):
                    break
                os.close(fd)  # refused, or the file was removed by a run that ended meanwhile: take the new one
                if refusal is not None:
                    raise refusal
            os.ftruncate(fd, 0)
            os.pwrite(fd, cls.SIGNATURE + f"pid {os.getpid()} on {os.uname().nodename}\n".encode(), 0)
        except BaseException:
            for folder in reversed(made):
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise
        cls.held = cls(path, fd, made)
        return cls.held

    @classmethod
    def open_or_create(cls, path: Path) -> int:
        """The lock file, opened; created complete (a temporary file linked into place): no run ever sees it empty."""
        while True:
            with contextlib.suppress(FileNotFoundError):
                return os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
            try:
                os.write(fd, cls.SIGNATURE + b"starting\n")
                os.link(tmp, path)
                return fd
            except FileExistsError:
                os.close(fd)
            finally:
                os.unlink(tmp)

    def release(self) -> None:
        """Remove the file (while still holding it) and drop the lock; and the log folder, were it made for nothing."""
        if self.fd is None:
            return
        if self.same_file(self.fd, self.path):
            with contextlib.suppress(OSError):
                self.path.unlink()
        os.close(self.fd)
        self.fd = None
        for folder in reversed(self.made):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only an empty one: the lock's, when the run stopped before its log
        if RunLock.held is self:
            RunLock.held = None

def replace_earlier_run(log_file: Path) -> None:
    """--replace-log: the earlier log of the run id and its checkpoint folder go, each only if this trainer wrote
    it (check_outputs refused anything else; this runs again under the run's lock)."""
    if os.path.lexists(log_file):
        if not is_our_log(log_file):
            raise ConfigError(f"{log_file} is not a log of this trainer: --replace-log replaces only those; move it "
                              "away, or pick another --run-id")
        log_file.unlink()
    folder = log_file.with_suffix("")
    if os.path.lexists(folder):
        if not is_our_checkpoint_folder(folder):
            raise ConfigError(f"{folder} holds files other than this trainer's checkpoints: move them away, or pick "
                              "another --run-id")
        shutil.rmtree(folder)

def file_identity(path: Path) -> tuple | None:
    """(device, inode, change time) of a file, None where there is none: a new file under the same name differs."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino, info.st_ctime_ns

def end_log_of_a_dead_run(log_file: Path, last_line: str) -> None:
    """./run.sh launch, after a rank of the run ended without a word (SIGKILL, a crash): the run's log, where the run
    got as far as making it, gets what happened as its last line (the run id's lock is free: the run is over)."""
    if not is_our_log(log_file):
        return
    try:
        lock = RunLock.acquire(log_file)
    except (ConfigError, OSError):  # another run holds the run id by now
        return
    try:
        with contextlib.suppress(OSError), open(log_file, "a") as f:
            f.write(last_line + "\n")
    finally:
        lock.release()

class Logger:
    """Rank 0 writes the log file (script source first, then the run) and echoes run lines to the console. The file is
    created exclusively, under the run id's lock: an earlier log of the run id is replaced only with `replace`, and
    only if this trainer wrote it. close() writes the last line of a run that ended early and drops the lock."""
    active = None  # this process's open log: main() closes it however the run ends

    def __init__(self, path, master: bool, replace: bool = False, lock: RunLock = None):
        self.path, self.master, self.lock, self.file = Path(path), master, lock, None
        self.where = "while starting"  # what the run is doing, for the last line of a run that ends early
        if not master:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if replace:
            replace_earlier_run(self.path)
        try:
            self.file = open(self.path, "x")
        except FileExistsError:
            raise ConfigError(f"log {self.path} appeared while this run started: pick another --run-id") from None
        Logger.active = self

    def __call__(self, text: str = "", console: bool = True):
        if self.file is None:
            return
        if console:
            print(text, flush=True)
        try:
            self.file.write(text + "\n")
            self.file.flush()
        except OSError as e:  # a full disk: the error names the log
            raise OSError(e.errno, e.strerror, str(self.path)) from None

    def close(self, last_line: str = "", console: bool = True) -> None:
        try:
            if last_line:
                self(last_line, console)
        finally:
            if self.file is not None:
                with contextlib.suppress(OSError):
                    self.file.close()
                self.file = None
            if self.lock is not None:
                self.lock.release()
            if Logger.active is self:
                Logger.active = None

def nvidia_smi() -> str:
    try:
        return subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "nvidia-smi: not available\n"

def check_writable(path: Path, what: str) -> None:
    """The folder `path` is, or would be created in, must be one this process can write in: checked before anything
    is written or launched, so that a bad path is one line and not a traceback once the run has started."""
    existing = path
    while not os.path.lexists(existing) and existing != existing.parent:
        existing = existing.parent
    try:
        real = existing.resolve(strict=True)
    except (OSError, RuntimeError) as e:  # RuntimeError: a loop, before Python 3.13
        kind = "a symbolic link to nothing" if getattr(e, "errno", None) == errno.ENOENT else \
            "a loop of symbolic links" if isinstance(e, RuntimeError) or e.errno == errno.ELOOP else \
            f"out of reach ({e.strerror})"
        raise ConfigError(f"{what} {path}: {existing} is {kind}; pick another path") from None
    if not real.is_dir():
        raise ConfigError(f"{what} {path}: {existing} is a file, not a folder; pick another path")
    try:
        tempfile.TemporaryFile(dir=real).close()
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot write in {existing} ({e.strerror or e}); pick a folder you can "
                          "write in") from None

def log_path(args: Hyperparameters, run_id: str) -> Path:
    return Path(args.log_dir) / f"{run_id}.txt"

def check_outputs(args: Hyperparameters) -> None:
    """Where this run will write: the log folder; the log and checkpoint folder of --run-id (replaced only with
    --replace-log, and only if this trainer wrote them), its lock (no run of it still going); and the --compile-cache
    bundle (absent, or one of this trainer's, in a writable folder)."""
    check_writable(Path(args.log_dir), "--log-dir")
    if args.run_id:
        log, folder = log_path(args, args.run_id), Path(args.log_dir) / args.run_id
        if os.path.lexists(log) and not log.is_file():
            raise ConfigError(f"{log} exists and is not a file: pick another --run-id")
        if os.path.lexists(folder) and (folder.is_symlink() or not folder.is_dir()):
            raise ConfigError(f"{folder}, where the checkpoints of --run-id {args.run_id} go, exists and is not a "
                              "folder: pick another --run-id")
        for old in (log, folder):
            if os.path.lexists(old) and not args.replace_log:
                raise ConfigError(f"{old} exists (a run with --run-id {args.run_id}): pick another --run-id, or add "
                                  "--replace-log to replace it")
        if os.path.lexists(log) and not is_our_log(log):
            raise ConfigError(f"{log} is not a log of this trainer (it does not start with {LOG_SIGNATURE}): "
                              "--replace-log replaces only those; move it away, or pick another --run-id")
        if os.path.lexists(folder) and not is_our_checkpoint_folder(folder):
            raise ConfigError(f"{folder} holds files other than this trainer's checkpoints: move them away, or pick "
                              "another --run-id")
        RunLock.check(log)
    if args.compile_cache:
        bundle = Path(args.compile_cache)
        if bundle.is_dir():
            raise ConfigError(f"--compile-cache {bundle} is a folder, not a file: name the bundle's file, e.g. "
                              f"{bundle / 'compile_cache.zip'}")
        if args.run_id and os.path.abspath(bundle) in {os.path.abspath(f) for f in (log, RunLock.path_for(log))}:
            raise ConfigError(f"--compile-cache {bundle} is this run's own log or lock: name another file")
        if os.path.lexists(bundle) and not is_our_bundle(bundle):
            raise ConfigError(f"--compile-cache {bundle} exists and is not a compile-cache bundle of this trainer: "
                              "name a new file (it is written after the warm-up) or one an earlier run wrote")
        check_writable(bundle.parent, "--compile-cache")

def new_file_beside(path: Path) -> str:
    """A new temporary file in path's folder (renamed to path once written: never half a file), readable as any new
    file is (mkstemp's own mode is the owner's only)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    umask = os.umask(0)
    os.umask(umask)
    os.fchmod(fd, 0o666 & ~umask)
    os.close(fd)
    return tmp

def save_checkpoint(path: Path, trainer: "Trainer", steps: int) -> None:
    """Model and optimizer states, written to a new file beside `path` and renamed: never half a checkpoint."""
    made = make_folders(path.parent)
    tmp = new_file_beside(path)
    try:
        torch.save(dict(step=steps, code=Path(__file__).read_text(), model=trainer.model.state_dict(),
                        optimizers=[trainer.adam.state_dict(), trainer.muon.state_dict()]), tmp)
        Path(tmp).replace(path)
    except RuntimeError as e:  # torch.save's own report of a failed write (a full disk, usually)
        free = shutil.disk_usage(path.parent).free
        raise OSError(None, f"cannot write the checkpoint, {free / 2**20:.0f} MiB free there (torch.save: "
                            f"{str(e).splitlines()[-1]})", str(path)) from None
    finally:
        Path(tmp).unlink(missing_ok=True)
        for folder in reversed(made if not path.exists() else []):
            with contextlib.suppress(OSError):
                folder.rmdir()

RANK0_REPORT_GRACE_S = 3.0  # how long the other ranks wait for rank 0 to report a config error

def ignore_further_signals():
    """A second signal (Ctrl-C twice, the launcher's SIGTERM after one) adds nothing to the stop under way. A handler
    that does nothing, not SIG_IGN: Python raises an error for a signal that arrived before the switch to SIG_IGN."""
    for s in (*STOP_SIGNALS, LAUNCHER_DIED):
        signal.signal(s, lambda signum, frame: None)

def stop_on_signal(signum, frame):
    """SIGINT, SIGTERM and SIGHUP end the run through Interrupted: the log's last line, one console line, exit 128+N."""
    ignore_further_signals()
    raise Interrupted(signum)

def stop_on_launcher_death(signum, frame):
    if stray(signum):
        return
    ignore_further_signals()
    raise LauncherDied()

def exit_on_signal(said: str):
    """A handler for the moments nothing is left to close (the grace after another rank's error, after the run):
    one line on rank 0 unless `said` is empty, then exit 128+N."""
    def handler(signum, frame):
        if said and env_rank() == 0:
            print(f"interrupted by {signal.Signals(signum).name} {said}", flush=True)
        os._exit(128 + signum)
    for s in STOP_SIGNALS:
        signal.signal(s, handler)

def out_of_memory(e: BaseException) -> bool:
    return isinstance(e, (MemoryError, torch.OutOfMemoryError)) or \
        (isinstance(e, RuntimeError) and "can't allocate memory" in str(e))

def collective_failed(e: Exception) -> bool:
    """An error of the process group: another rank has ended (gloo reports the broken connection as a RuntimeError)."""
    return dist.is_initialized() and (isinstance(e, dist.DistError) or
                                      (isinstance(e, RuntimeError) and "gloo/transport" in str(e)))

def stop_run(stop: RunStopped, rank: int) -> None:
    """The end of a run that stops early: the log's last line, echoed on rank 0 as the run's one line, and its exit
    status, without the process group's teardown (which could wait on ranks already gone)."""
    line = stop.last_line(where_the_run_is())
    if Logger.active is not None:
        end_log(line, console=True)
    elif rank == 0:
        print(line)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(stop.status)

def end_log(last_line: str, console: bool = False) -> None:
    """Close this process's log (if one is open) with its last line, and release the run id: whatever ended the run.
    A log that cannot be written any more (a full disk) keeps what it has."""
    if Logger.active is not None:
        with contextlib.suppress(OSError):
            Logger.active.close(last_line, console)  # which releases the run id
    if RunLock.held is not None:  # the run stopped before its log was made
        RunLock.held.release()

def where_the_run_is() -> str:
    return Logger.active.where if Logger.active is not None else "while starting"

OUTPUT_FAILED = 4  # exit status: an output could not be written (a full disk)


# =====================================================================================
# Engine room: the compile cache
# =====================================================================================

# A bundle of everything compiled for this script, to skip compilation on a fresh machine: PyTorch's portable cache
# artifacts (Inductor graphs and their Triton kernels) plus the folders of kernel caches named by COMPILE_CACHE_DIRS,
# in one zip with the versions it was made with. A bundle from other versions or GPUs is ignored, never an error.
# Triton's folder holds Inductor's kernels too (already in the artifacts): only this script's own kernels travel.
COMPILE_CACHE_DIRS = ("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "QUACK_CACHE_DIR", "TRITON_CACHE_DIR")
INDUCTOR_DIR_ENTRY = "inductor_cache_dir.txt"  # the Inductor folder the bundle was written from

def default_kernel_cache_dirs(triton: bool = True) -> None:
    """Name every kernel-cache folder before anything compiles (a bundle restores and carries them): the folder each
    owner would pick anyway, and for Triton (unless triton=False: it imports Inductor, seconds) the one Inductor sets
    for this rank's GPU (our kernels then share it)."""
    env, user_tmp = os.environ, Path(tempfile.gettempdir()) / getpass.getuser()
    env.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", str(user_tmp / "flash_attention_cute_dsl_cache"))
    env.setdefault("QUACK_CACHE_DIR", str(user_tmp / "quack_cache"))
    if triton and "TRITON_CACHE_DIR" not in env:
        with contextlib.suppress(Exception):  # a torch without it: Triton keeps its own default, which the bundle skips
            from torch._inductor.runtime.cache_dir_utils import triton_cache_dir
            env["TRITON_CACHE_DIR"] = triton_cache_dir(int(env.get("LOCAL_RANK", 0)))

def own_triton_kernels() -> set:
    """Names of the Triton kernels defined in this file (the names of their entries in Triton's cache)."""
    if triton is None:
        return set()
    return {name for name, obj in globals().items() if isinstance(obj, triton.runtime.jit.JITFunction)}

def relocated_triton_group(data: bytes, folder: Path) -> bytes:
    """A Triton cache entry's group file lists its files by absolute path: point them into the folder restored here
    (Triton takes an entry whose files are missing for a miss and compiles again)."""
    group = json.loads(data)
    group["child_paths"] = {name: str(folder / Path(path).name) for name, path in group["child_paths"].items()}
    return json.dumps(group).encode()

def kernel_cache_files(var: str, folder: Path) -> list:
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    if var == "TRITON_CACHE_DIR":
        # One sub-folder per compiled kernel, named in its __grp__<kernel>.json: ours travel. So do the C modules
        # Triton builds with the host compiler on first use (its CUDA driver helpers, a launcher per kernel
        # signature), which a fresh machine would otherwise build again; the bundle's key pins Python and Triton.
        groups = {f"__grp__{name}.json" for name in own_triton_kernels()}
        c_module = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
        ours = {p.parent for p in files if p.name in groups or p.name.endswith(c_module)}
        files = [p for p in files if p.parent in ours]
    return files

def compile_cache_key() -> dict:
    gpu = (f"{torch.cuda.get_device_name()} sm{''.join(map(str, torch.cuda.get_device_capability()))}"
           if torch.cuda.is_available() else "cpu")
    return dict(torch=torch.__version__, triton=triton.__version__ if triton else None, cuda=torch.version.cuda,
                python=f"{sys.version_info.major}.{sys.version_info.minor}", gpu=gpu)

def inductor_cache_dir() -> str:
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    return cache_dir()

def place_autotune_results(keys: list, origin: str) -> str:
    """A kernel from the bundle looks up its autotuning result beside its source file, by that file's absolute path
    on the machine that wrote the bundle; PyTorch restores the results into this machine's Inductor folder. Where the
    two differ, copy them to the bundle's path too, or every kernel would benchmark its configs again. Returns a note
    for the log line ("" when nothing needed doing)."""
    here = Path(inductor_cache_dir())
    if not keys or not origin or Path(origin) == here:
        return ""
    placed = 0
    try:
        for key in keys:
            rel = Path(key)
            if rel.is_absolute() or ".." in rel.parts or rel.suffix != ".best_config" or not (here / rel).is_file():
                continue
            target = Path(origin) / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes((here / rel).read_bytes())
            placed += 1
    except OSError as e:
        return (f"; its autotuning results could not be placed under {origin} ({type(e).__name__}), so kernels "
                f"benchmark their configs again: set TORCHINDUCTOR_CACHE_DIR={origin} to avoid it")
    return f"; {placed} autotuning results also placed under {origin}, where its kernels look for them"

def is_our_bundle(path: Path) -> bool:
    """A compile-cache bundle this trainer wrote (save_compile_cache): a zip holding its key and PyTorch's artifacts."""
    try:
        if not stat.S_ISREG(path.stat().st_mode):  # a FIFO would block the read
            return False
        with zipfile.ZipFile(path) as z:
            return {"key.json", "artifacts.bin"} <= set(z.namelist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return False

def load_compile_cache(path: Path) -> tuple[bool, str]:
    """(loaded, one line for the log). Restores the kernel-cache folders whose variable is set here."""
    if not path.is_file():
        return False, f"compile cache: {path} not found; it will be written after the warm-up"
    try:
        with zipfile.ZipFile(path) as z:
            made_with = json.loads(z.read("key.json"))
            here = compile_cache_key()
            if made_with != here:
                diff = ", ".join(f"{k} {made_with.get(k)} there vs {v} here" for k, v in here.items()
                                 if made_with.get(k) != v)
                return False, f"compile cache: {path} was made elsewhere ({diff}); ignored, rewritten after the warm-up"
            info = torch.compiler.load_cache_artifacts(z.read("artifacts.bin"))
            origin = z.read(INDUCTOR_DIR_ENTRY).decode() if INDUCTOR_DIR_ENTRY in z.namelist() else ""
            autotune_note = place_autotune_results(list(getattr(info, "autotune_artifacts", None) or []), origin)
            restored = 0
            for name in z.namelist():
                var, _, rel = name.partition("/")
                if var in COMPILE_CACHE_DIRS and rel and os.environ.get(var):
                    target = Path(os.environ[var]) / rel
                    target.parent.mkdir(parents=True, exist_ok=True)
                    data = z.read(name)
                    if var == "TRITON_CACHE_DIR" and target.name.startswith("__grp__"):
                        data = relocated_triton_group(data, target.parent)
                    target.write_bytes(data)
                    restored += 1
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, RuntimeError) as e:
        return False, (f"compile cache: {path} unreadable ({type(e).__name__}: {e}); ignored, rewritten after the "
                       "warm-up")
    return True, (f"compile cache: loaded {path} ({path.stat().st_size / 2**20:.1f} MB, {restored} kernel-cache files)"
                  + autotune_note)

def save_compile_cache(path: Path) -> str:
    """Write the bundle atomically (rank 0, after the warm-up), through a new file beside it; returns the log line."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return f"compile cache: nothing was compiled, {path} not written"
    if os.path.lexists(path) and not is_our_bundle(path):  # it appeared since check_outputs
        return f"compile cache: {path} is not a bundle of this trainer; not written over"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_file_beside(path)
    files = 0
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as z:
            z.writestr("key.json", json.dumps(compile_cache_key()))
            z.writestr("artifacts.bin", saved[0])
            z.writestr(INDUCTOR_DIR_ENTRY, inductor_cache_dir())
            for var in COMPILE_CACHE_DIRS:
                if os.environ.get(var) and (folder := Path(os.environ[var])).is_dir():
                    for f in kernel_cache_files(var, folder):
                        z.write(f, f"{var}/{f.relative_to(folder)}")
                        files += 1
        Path(tmp).replace(path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return f"compile cache: wrote {path} ({path.stat().st_size / 2**20:.1f} MB, {files} kernel-cache files)"

def compile_cache_after_warm_up(path: Path | None, loaded: bool) -> str:
    """After the warm-up (rank 0): write the bundle where none matched, or rewrite a loaded one that lacked graphs
    this run compiled (else every later start compiles them again). Returns the log line ("" for none)."""
    if path is None:
        return ""
    if not loaded:
        return save_compile_cache(path)
    misses = compile_cache_counts()["inductor"]["misses"]  # graphs this run compiled that the bundle lacked
    if misses == 0:
        return ""
    return (f"compile cache: {path} lacked {misses} graph(s) this run compiled (the script or a setting that changes "
            f"a graph differs from the run that wrote it); " + save_compile_cache(path).removeprefix("compile cache: "))

def open_compile_cache(args: Hyperparameters) -> tuple[Path | None, bool, str]:
    """(bundle path or None, loaded, line for the log), before anything compiles; run() and bench/bench.py share it."""
    default_kernel_cache_dirs()  # bench.py: before resolve_runtime imports FA4 and quack, which read theirs at import
    if not args.compile_cache:
        return None, False, ""
    path = Path(args.compile_cache)
    return (path, *load_compile_cache(path))


# =====================================================================================
# main(): settings -> runtime -> trainer -> run
# =====================================================================================

def check_model(args: Hyperparameters, runtime: Runtime, memory: bool = True) -> None:
    """--check: what the settings ask of the model, before anything is allocated. The model is built on the meta
    device (no memory): every learning rate, times its multipliers, must stay finite in float32, where the optimizers
    apply it, and its parameters, their gradients and Adam's states must fit the device (a lower bound: activations
    are left out, so good settings are never refused; running out later is one line too, see main())."""
    with torch.device("meta"):
        model = GPT(args, max_seq_len=1)
    check_optimizer_labels(model, world_sizes=sorted({1, 2, 4, 8, runtime.world_size}))
    check_learning_rates(args, model)
    if not memory:
        return
    need = 0
    for p in model.parameters():
        size = p.numel() * p.element_size()
        need += 2 * size + (2 * size // runtime.world_size if p.treatment == "adam" else 0)
    if runtime.device == "cuda":
        have, per = torch.cuda.get_device_properties(runtime.local_rank).total_memory, "this GPU"
    else:
        processes = min(runtime.world_size, int(os.environ.get("LOCAL_WORLD_SIZE", runtime.world_size)))
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // processes
        per = "this machine's memory" + (f" / {processes} processes" if processes > 1 else "")
    if need > have:
        raise ConfigError(f"the model's parameters, gradients and optimizer states alone need {need / 2**30:,.1f} GiB "
                          f"per process, more than {per} ({have / 2**30:,.1f} GiB): shrink --model-dim or "
                          "--vocab-size")

def check_learning_rates(args: Hyperparameters, model: GPT) -> None:
    peak = max(*args.lr_plateaus, args.lr_floor)  # the largest multiplier get_lr gives
    limit = float(np.finfo(np.float32).max)
    for name, p in model.named_parameters():
        if p.treatment == "adam":  # Adam's first steps divide by 1 - beta1 (bias correction)
            lr, flag = args.adam_lr * peak * p.lr_mul / (1 - args.adam_betas[0]), "--adam-lr"
        else:  # weight decay is scaled by the lr
            lr, flag = args.muon_lr * peak * normuon_lr_factor(p) * max(1.0, args.muon_weight_decay), "--muon-lr"
        if not lr < limit:
            raise ConfigError(f"{flag} {getattr(args, flag[2:].replace('-', '_'))} with --lr-plateaus/--lr-floor up "
                              f"to {peak} gives parameter {name} a step of {lr:.3g}, past float32's largest "
                              f"({limit:.3g}): lower them")

def run(args: Hyperparameters) -> None:
    if args.check or args.check_flags:
        runtime = resolve_runtime(args)
        check_model(args, runtime)
        if args.check:
            find_data(args, runtime)
            check_outputs(args)
        print(f"check: ok: {runtime.world_size} process(es) on {runtime.device}, fused kernels {runtime.fused}, "
              f"{runtime.grad_accum_steps} micro-batch(es) per step, "
              f"data {args.data_path if args.check else 'not checked'}", flush=True)
        return
    check_outputs(args)
    default_kernel_cache_dirs(triton=False)  # FA4 and quack read theirs at import: before resolve_runtime imports them
    runtime = resolve_runtime(args)
    # Bad data is refused before the compile cache's imports. ./run.sh launch ran --check, which read every token.
    find_data(args, runtime, scan=not os.environ.get(LAUNCHER_PID_ENV))
    check_model(args, runtime, memory=False)
    cache_path, cache_loaded, cache_line = open_compile_cache(args)
    run_id = args.run_id or str(uuid.uuid4())
    trainer = build_trainer(args, runtime, log_path(args, run_id), replace_log=args.replace_log)
    log = trainer.log
    if cache_line:
        log(cache_line)
    t_warm = time.time()
    log.where = "during the warm-up"
    trainer.warm_up_kernels()
    if runtime.master and (cache_note := compile_cache_after_warm_up(cache_path, cache_loaded)):
        log(cache_note)
    caches = compile_cache_counts()
    log(f"Kernel warm-up done in {time.time() - t_warm:.1f}s (process start to timed loop: "
        f"{time.time() - PROCESS_START:.1f}s; {compiled_graph_count()} compiled graphs, Inductor's cache "
        f"{caches['inductor']['hits']} hits and {caches['inductor']['misses']} misses, AOTAutograd's "
        f"{caches['aot_autograd']['hits']} and {caches['aot_autograd']['misses']})")
    result = trainer.train()
    if dist.is_initialized() and runtime.world_size > 1:
        same = replicas_identical(trainer.model)
        log(f"replica check: parameters {'bit-identical' if same else 'DIFFER'} across {runtime.world_size} ranks")
    allocated, reserved, pool = peak_memory(runtime.device)
    log(f"peak memory allocated: {allocated} MiB reserved: {reserved} MiB"
        + (f" graphs' pool: {pool} MiB" if runtime.device == "cuda" else ""))
    log(summary_line(args, runtime, result))
    if args.save_checkpoint and runtime.master:
        log.where = "while saving the checkpoint"
        save_checkpoint(Path(args.log_dir) / run_id / f"state_step{result.steps:06d}.pt", trainer, result.steps)
    log.close()

def main(argv=None) -> int:
    rank = env_rank()
    for s in STOP_SIGNALS:
        signal.signal(s, stop_on_signal)
    signal.signal(LAUNCHER_DIED, stop_on_launcher_death)
    prefix = "error" if rank == 0 else f"error (rank {rank})"
    status = 1
    try:
        try:
            run(parse_args(argv))
        except BaseException:
            # Whatever ended the run, its stop is under way: a signal now (the launcher's SIGTERM to every rank once
            # one has ended) would cut it short, and the exit status would be 1 instead of the stop's own.
            ignore_further_signals()
            raise
        status = 0
    except (ConfigError, ShardError, DataExhausted) as e:
        # Config errors are seen identically by every rank: rank 0 speaks for all. Data errors during training
        # may hit one rank only, so that rank reports it (torchrun then stops the others).
        end_log(f"stopped {where_the_run_is()}: {e}")
        if rank == 0 or not isinstance(e, ConfigError):
            print(f"{prefix}: {e}", file=sys.stderr, flush=True)
        else:
            # A silent rank that exits first makes torchrun stop rank 0, possibly before its line is out: wait,
            # ending quietly on torchrun's SIGTERM (rank 0 said it all).
            exit_on_signal("")
            time.sleep(RANK0_REPORT_GRACE_S)
        status = 2
    except RunStopped as stop:
        stop_run(stop, rank)
    except OSError as e:  # a full disk, a folder taken away: one line, and the log keeps what it has
        said = f"{e.filename or 'input/output'}: {e.strerror or e}"
        end_log(f"stopped {where_the_run_is()}: {said}")
        print(f"{prefix}: {said}", file=sys.stderr, flush=True)
        status = OUTPUT_FAILED
    except Exception as e:
        where = where_the_run_is()
        if collective_failed(e):
            stop_run(PeerGone(), rank)
        if not out_of_memory(e):
            end_log(f"crashed {where}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            if not dist.is_initialized():
                raise  # a bug: its traceback
            traceback.print_exc()  # the same, before the exit (status 1) without the teardown below
        else:
            device = "GPU" if isinstance(e, torch.OutOfMemoryError) else "machine"
            said = (f"these settings need more than this {device} has; shrink the tokens per process "
                    "(--train-bs-schedule, --train-bs-extension, --val-batch-size) or the model (--model-dim), or use "
                    "more GPUs")
            end_log(f"stopped {where}: out of memory: {said}")
            print(f"{prefix}: out of memory {where}: {said}", file=sys.stderr, flush=True)
            status = 2
    finally:
        exit_on_signal("after the run ended")  # nothing is left to close; the teardown below may still take a moment
        if dist.is_initialized():
            if status != 0:  # the other ranks may be gone: the teardown could wait on them
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
            dist.destroy_process_group()
    return status

if __name__ == "__main__":
    sys.exit(main())
