#!/usr/bin/env python3
"""Download pre-tokenized FineWeb-10B GPT-2 shards (SPEC section 2.2) from the Hugging Face Hub.

    python data/cached_fineweb10B.py [N] [--out-dir DIR]

Fetches fineweb_val_000000.bin and fineweb_train_000001.bin ... fineweb_train_{N:06d}.bin (N defaults to 9, i.e.
900M train tokens; 0..103, 103 = the whole 10B sample) from the dataset repo kjj0/fineweb10B-gpt2 into
data/fineweb10B/ beside this script. Shards already present with a valid header and size are skipped; invalid ones
are deleted and downloaded again; every downloaded shard is validated. Exit status 1 if any shard is missing or
invalid at the end: re-running the same command resumes. Exit status 2 for a bad command line (N out of range, an
--out-dir that cannot be a folder), before anything is created or downloaded. Set HF_ENDPOINT to use a Hub mirror.
"""
import argparse
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from train_gpt import ShardError, read_shard_header  # noqa: E402  (the one shard reader)
from data.fineweb import out_dir_problem  # noqa: E402  (the one --out-dir check)

REPO_ID = "kjj0/fineweb10B-gpt2"
MAX_TRAIN_SHARDS = 103
DEFAULT_TRAIN_SHARDS = 9


def shard_names(num_train: int) -> list:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, num_train + 1)]


def shard_problem(path: Path):
    """None if the shard is valid, else a one-line reason."""
    try:
        read_shard_header(path)
        return None
    except ShardError as e:
        return str(e)


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def download(name: str, out_dir: Path) -> bool:
    from huggingface_hub import hf_hub_download
    try:
        hf_hub_download(repo_id=REPO_ID, filename=name, repo_type="dataset", local_dir=out_dir)
    except Exception as e:  # network, HTTP (404, 5xx), disk errors: report and go on with the other shards
        endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
        print(f"error: downloading {name} from {endpoint} (dataset {REPO_ID}) failed: {one_line(e)}\n"
              f"       re-run the same command to retry (valid shards are skipped); "
              f"set HF_ENDPOINT=<url> to use a Hub mirror", file=sys.stderr, flush=True)
        return False
    return True


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=f"Download GPT-2 tokenized FineWeb-10B shards from {REPO_ID}.")
    p.add_argument("num_train", metavar="N", nargs="?", type=int, default=DEFAULT_TRAIN_SHARDS,
                   help=f"train shards to fetch, 0..{MAX_TRAIN_SHARDS} (default {DEFAULT_TRAIN_SHARDS}; "
                        f"100M tokens each); the val shard is always fetched")
    p.add_argument("--out-dir", type=Path, default=HERE / "fineweb10B",
                   help="destination folder (default: data/fineweb10B beside this script)")
    args = p.parse_args(argv)
    if not 0 <= args.num_train <= MAX_TRAIN_SHARDS:
        p.error(f"N must be between 0 and {MAX_TRAIN_SHARDS} (the repo has {MAX_TRAIN_SHARDS} train shards), "
                f"got {args.num_train}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out_dir = args.out_dir
    problem = out_dir_problem(out_dir)
    if problem:
        print(f"cached_fineweb10B.py: error: {problem}", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    names = shard_names(args.num_train)
    failed = []
    t0 = time.perf_counter()
    for i, name in enumerate(names, 1):
        path = out_dir / name
        tag = f"[{i}/{len(names)}] {name}"
        if path.exists():
            problem = shard_problem(path)
            if problem is None:
                print(f"{tag}: present and valid, skipped", flush=True)
                continue
            print(f"{tag}: invalid ({problem}); deleting and downloading again", flush=True)
            path.unlink()
        print(f"{tag}: downloading", flush=True)
        if not download(name, out_dir):
            failed.append(name)
            continue
        problem = shard_problem(path)
        if problem is not None:
            print(f"error: downloaded {name} is invalid ({problem}); deleted it, re-run the same command to retry",
                  file=sys.stderr, flush=True)
            path.unlink(missing_ok=True)
            failed.append(name)
    secs = time.perf_counter() - t0
    if failed:
        print(f"cached_fineweb10B.py: {len(failed)} of {len(names)} shards missing or invalid in {out_dir}: "
              f"{', '.join(failed)}. Re-run the same command to retry.", file=sys.stderr)
        return 1
    print(f"cached_fineweb10B.py: all {len(names)} shards present and valid in {out_dir} ({secs:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
