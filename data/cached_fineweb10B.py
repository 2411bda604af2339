#!/usr/bin/env python3
"""Download pre-tokenized FineWeb-10B GPT-2 shards (SPEC section 2.2) from the Hugging Face Hub.

    python data/cached_fineweb10B.py [N] [--out-dir DIR]

Fetches fineweb_val_000000.bin and fineweb_train_000001.bin ... fineweb_train_{N:06d}.bin (N defaults to 9, i.e.
900M train tokens; 0..103, 103 = the whole 10B sample) from the dataset repo kjj0/fineweb10B-gpt2 into
data/fineweb10B/ beside this script. Shards already present with a valid header and size are skipped; invalid ones
are replaced by a fresh download (kept as they were if that download fails); every downloaded shard is validated.
Set HF_ENDPOINT to use a Hub mirror.

Before the first download, one HEAD request without retries (huggingface_hub's get_hf_file_metadata; its timeout is
the library's own HF_HUB_ETAG_TIMEOUT if set, else 5 s) checks that the Hub answers, because offline
huggingface_hub retries every shard with back-off for tens of seconds and has no setting for the number of retries.
No answer (no DNS, connection refused, timeout, proxy failure, HF_HUB_OFFLINE set) or a 502/503/504 is one line and
exit status 2, with nothing created or changed. The check runs again after a failed download, so a network lost
midway stops the run instead of retrying each remaining shard. Download locks (*.lock) and partial downloads
(*.incomplete) that this run created, in DIR/.cache/huggingface/ or in the huggingface_hub cache, are removed at
the end; files that were there before are never touched, and folders this run created are removed again if nothing
was downloaded into them.

Exit status: 0 all shards present and valid; 2 a bad command line (N out of range, an --out-dir that cannot be a
folder; found before anything is created or downloaded), an unreachable Hub, or no huggingface_hub package; 1 if
the Hub answered but some shard is still missing or invalid at the end (a 404, a failed transfer, a corrupt
download): re-running the same command resumes.
"""
import argparse
import importlib.util
import os
import signal
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from data.fineweb import BuildError, make_out_dir, one_line, out_dir_problem  # noqa: E402  (the one --out-dir check)

REPO_ID = "kjj0/fineweb10B-gpt2"
MAX_TRAIN_SHARDS = 103
DEFAULT_TRAIN_SHARDS = 9
PROBE_TIMEOUT_S = 5.0  # a HEAD answers in well under a second when the Hub is reachable
PROG = "cached_fineweb10B.py"


def shard_names(num_train: int) -> list:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, num_train + 1)]


def shard_problem(path: Path):
    """None if the shard is valid, else a one-line reason."""
    # The one shard reader; imported only when a shard is checked, because importing train_gpt imports torch
    # (seconds), which an offline run with no shard yet should not wait for.
    from train_gpt import ShardError, read_shard_header
    try:
        read_shard_header(path)
        return None
    except ShardError as e:
        return str(e)


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def hub_problem(name: str):
    """None if the Hub (or the HF_ENDPOINT mirror) gives an HTTP answer for `name`, else why not, as one line.

    An HTTP answer counts, a 404 included (the download loop reports it for that shard), except 502/503/504: a Hub
    that is down, or a proxy that cannot reach it, on which huggingface_hub would retry as long as when offline.
    The request runs in a thread that is given up after the timeout, because a name lookup is not bounded by it."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.utils import HfHubHTTPError

    try:
        timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or PROBE_TIMEOUT_S)
    except ValueError:  # huggingface_hub ignores a value that is not a number, and so does this
        timeout = PROBE_TIMEOUT_S
    result = []

    def probe():
        try:
            get_hf_file_metadata(hf_hub_url(REPO_ID, name, repo_type="dataset"), timeout=timeout)
            result.append(None)
        except HfHubHTTPError as e:
            status = getattr(getattr(e, "response", None), "status_code", None)
            result.append(f"HTTP {status}" if status in (502, 503, 504) else None)
        except Exception as e:
            result.append(one_line(e))

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout + 1.0)
    return result[0] if result else f"no answer within {timeout:g} s"


def unreachable_line(problem: str) -> str:
    return (f"{PROG}: error: the Hugging Face Hub at {endpoint()} is unreachable ({problem[:300]}); connect to the "
            f"network (or set HF_ENDPOINT=<mirror>) and re-run, or train offline on proxy shards: ./run.sh proxy, "
            f"then --data-path data/proxy")


def hub_check(name: str):
    """None if `name` can be downloaded from here, else the one error line saying why not and what to do."""
    if importlib.util.find_spec("huggingface_hub") is None:
        return f"{PROG}: error: downloading needs the huggingface_hub package: pip install huggingface_hub"
    problem = hub_problem(name)
    return None if problem is None else unreachable_line(problem)


class NewFiles:
    """Remembers which files and folders exist under some roots, so that what this run added can be removed again.

    huggingface_hub leaves its download locks (*.lock) behind, and partial downloads (*.incomplete) when a transfer
    fails; it keeps them under DIR/.cache/huggingface/ (local_dir downloads) or its own cache (other versions)."""

    MARKERS = (".gitignore", "CACHEDIR.TAG")  # written by huggingface_hub into a .cache folder it creates

    def __init__(self, roots):
        self.roots = [Path(r) for r in roots]
        self.before = set()
        for root in self.roots:
            self.before.update(self._walk(root))

    @staticmethod
    def _walk(root: Path):
        if os.path.lexists(root):
            yield root
        for parent, dirs, files in os.walk(root):
            for n in dirs + files:
                yield Path(parent) / n

    def clean(self, prune_roots=()):
        """Delete new *.lock / *.incomplete files; then, under prune_roots, the new folders left holding nothing else
        than new huggingface_hub markers (deepest first)."""
        for root in self.roots:
            for path in list(self._walk(root)):
                if path not in self.before and path.name.endswith((".lock", ".incomplete")) and path.is_file():
                    path.unlink(missing_ok=True)
        for root in map(Path, prune_roots):
            for path in sorted(self._walk(root), key=lambda p: len(p.parts), reverse=True):
                if path in self.before or not path.is_dir() or path.is_symlink():
                    continue
                entries = list(path.iterdir())
                if all(e.name in self.MARKERS and e not in self.before and e.is_file() for e in entries):
                    for e in entries:
                        e.unlink()
                    path.rmdir()


def download(name: str, out_dir: Path) -> bool:
    from huggingface_hub import hf_hub_download
    try:
        hf_hub_download(repo_id=REPO_ID, filename=name, repo_type="dataset", local_dir=out_dir)
    except Exception as e:  # network, HTTP (404, 5xx), disk errors: report and go on with the other shards
        print(f"error: downloading {name} from {endpoint()} (dataset {REPO_ID}) failed: {one_line(e)}\n"
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
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    names = shard_names(args.num_train)
    t0 = time.perf_counter()
    missing = [name for name in names if not (out_dir / name).exists()]
    # A missing shard means a download: check the Hub first, before validating the present shards (which imports
    # torch, seconds that an offline run should not wait for). Nothing is created or changed before this check.
    error = hub_check(missing[0]) if missing else None
    todo = []  # (position, name, why the present file is invalid, or None if it is missing)
    if error is None:
        for i, name in enumerate(names, 1):
            if name in missing:
                todo.append((i, name, None))
            elif (problem := shard_problem(out_dir / name)) is None:
                print(f"[{i}/{len(names)}] {name}: present and valid, skipped", flush=True)
            else:
                todo.append((i, name, problem))
        if todo and not missing:
            error = hub_check(todo[0][1])
    if error is not None:
        print(error, file=sys.stderr)
        return 2
    if not todo:
        print(f"{PROG}: all {len(names)} shards present and valid in {out_dir} ({time.perf_counter() - t0:.1f} s)")
        return 0
    try:
        created = make_out_dir(out_dir)
    except BuildError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    from huggingface_hub import constants
    repo_folder = f"datasets--{REPO_ID.replace('/', '--')}"
    hf_files = NewFiles([out_dir / ".cache", Path(constants.HF_HUB_CACHE) / ".locks" / repo_folder,
                         Path(constants.HF_HUB_CACHE) / repo_folder])
    failed = []
    try:
        for k, (i, name, invalid) in enumerate(todo):
            path = out_dir / name
            tag = f"[{i}/{len(names)}] {name}"
            keep = None
            if invalid is not None:
                # Set aside, not deleted: it comes back if no valid replacement arrives.
                print(f"{tag}: invalid ({invalid}); downloading it again", flush=True)
                keep = path.with_name(f"{path.name}.{os.getpid()}.invalid")
                os.replace(path, keep)
            try:
                print(f"{tag}: downloading", flush=True)
                ok = download(name, out_dir)
                if ok:
                    problem = shard_problem(path)
                    if problem is not None:
                        print(f"error: downloaded {name} is invalid ({problem}); deleted it, re-run the same command "
                              f"to retry", file=sys.stderr, flush=True)
                        path.unlink(missing_ok=True)
                        ok = False
            finally:
                if keep is not None:
                    if path.exists():
                        keep.unlink()
                    else:
                        os.replace(keep, path)
            if not ok:
                failed.append(name)
                # Lost the network midway? Then stop rather than retry each remaining shard for ~40 s.
                if k + 1 < len(todo) and (error := hub_check(todo[k + 1][1])) is not None:
                    print(error, file=sys.stderr)
                    return 2
    finally:
        hf_files.clean(prune_roots=[out_dir / ".cache"])
        for d in created:  # folders this run created and left empty (nothing downloaded)
            try:
                d.rmdir()
            except OSError:
                break
    secs = time.perf_counter() - t0
    if failed:
        print(f"{PROG}: {len(failed)} of {len(names)} shards missing or invalid in {out_dir}: "
              f"{', '.join(failed)}. Re-run the same command to retry.", file=sys.stderr)
        return 1
    print(f"{PROG}: all {len(names)} shards present and valid in {out_dir} ({secs:.1f} s)")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so a killed run still cleans up after itself
    sys.exit(main())
