#!/usr/bin/env python3
"""Build speedrun token shards (SPEC section 2) from text documents.

    python data/fineweb.py --input PATH [PATH ...] --out-dir DIR [--val-input PATH [PATH ...]]
    python data/fineweb.py --version 10B            # HuggingFaceFW/fineweb sample-10BT, needs `datasets` + network

Every document is tokenized with tiktoken's GPT-2 BPE (`encode_ordinary`: special strings in the text are plain
text) and preceded by <|endoftext|> = 50256. The token stream is cut into fixed-size shards (--shard-size tokens,
default 10**8); a document that does not fit is split, its tail starting the next shard, and the last shard holds
the remainder. Shard 0 is fineweb_val_000000.bin, later ones fineweb_train_000001.bin, 000002, ... With
--val-input, the validation documents alone (any number of tokens) form shard 0 and --input starts at shard 1.

Each shard is a 256 x int32 little-endian header (magic 20240520, version 1, token count, zeros) followed by the
tokens as uint16 little-endian. Shards are written as DIR/<name>.tmp and renamed to their final names only once the
whole input has been read and tokenized without error, so a failed run never leaves a shard under a final name.
Output is deterministic: the same inputs give byte-identical shards whatever --workers is.

The GPT-2 BPE files ship with the repo in data/tiktoken_cache (TIKTOKEN_CACHE_DIR), so no network is needed.

Exit status: 0 ok; 2 for every failure the user can fix, as one line on stderr saying what is wrong and what to do:
a bad command line (found before anything is read or created), bad input data (malformed JSON, a record without a
string "text", invalid UTF-8, a truncated or corrupt .gz/.xz/.parquet, no documents), an --out-dir that cannot be
created or written (disk full), a missing package, an unreachable Hub for --version; 130 on Ctrl-C, 143 on SIGTERM.
Exit status 1 is left to internal failures (a bug in this script): Python's traceback, worth reporting. Whatever
the failure, no shard is left under a final name and the output folder is removed if this run created it.
"""
import argparse
import ast
import gzip
import importlib.util
import json
import lzma
import multiprocessing
import os
import re
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
# Use the repo's own copy of the GPT-2 BPE files: tokenizing never needs the network (see tiktoken_cache/README.md).
# A TIKTOKEN_CACHE_DIR from the environment is kept only if it really holds them (an empty or foreign cache
# would make tiktoken try to download, which hangs on offline machines).
_BPE_FILES = ("6d1cbeee0f20b3d9449abfede4726ed8212e3aee", "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6")
if not all((Path(os.environ.get("TIKTOKEN_CACHE_DIR", "/nonexistent")) / f).is_file() for f in _BPE_FILES):
    os.environ["TIKTOKEN_CACHE_DIR"] = str(HERE / "tiktoken_cache")

import numpy as np  # noqa: E402


def _shard_format():
    """SHARD_MAGIC, SHARD_VERSION, HEADER_INTS, BOS_ID: defined once, in train_gpt.py beside the shard reader.
    They are read from its source rather than imported, so building data does not import torch (seconds per run);
    if they ever stop being plain literals there, this falls back to importing train_gpt."""
    names = ("SHARD_MAGIC", "SHARD_VERSION", "HEADER_INTS", "BOS_ID")
    try:
        found = {}
        for node in ast.parse((HERE.parent / "train_gpt.py").read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and node.targets[0].id in names:
                found[node.targets[0].id] = ast.literal_eval(node.value)
        return tuple(int(found[n]) for n in names)
    except (OSError, SyntaxError, ValueError, KeyError):
        import train_gpt
        return tuple(getattr(train_gpt, n) for n in names)


SHARD_MAGIC, SHARD_VERSION, HEADER_INTS, BOS_ID = _shard_format()

FORMATS = (".jsonl.gz", ".jsonl.xz", ".jsonl", ".parquet", ".txt")  # longest suffixes first
MAX_SHARD_TOKENS = 2**31 - 1  # the header stores the token count as int32
HF_VERSIONS = {"10B": "sample-10BT", "100B": "sample-100BT"}


class BuildError(Exception):
    """A failure the user can fix (bad input data, an unwritable --out-dir, a missing package, no network for
    --version), found while building: one line on stderr saying what is wrong and what to do, exit status 2."""


class UsageError(BuildError):
    """A bad command line, found before anything is read or created (a missing or unsupported input path, an
    --out-dir that cannot be a folder): one line on stderr, exit status 2, like argparse's own errors."""


def one_line(exc: BaseException) -> str:
    """An exception as one line (library messages may span several)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def shard_name(index: int) -> str:
    return f"fineweb_{'val' if index == 0 else 'train'}_{index:06d}.bin"


# ----------------------------------------------------------------------------------------------------------------
# Reading documents. Every reader yields str documents in file order and raises BuildError naming the file and
# line/row (and byte offset for bad UTF-8) on malformed input. Invalid UTF-8 is rejected, never replaced.

def input_format(path: Path) -> str:
    name = path.name.lower()
    for suffix in FORMATS:
        if name.endswith(suffix):
            return suffix
    raise UsageError(f"{path}: unsupported input type (expected one of {', '.join(sorted(FORMATS))}); "
                     f"convert it, or pass the files of a supported type")


def expand_inputs(paths) -> list:
    """Check that every input exists and has a known format; a directory stands for its supported files, sorted."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.name.lower().endswith(FORMATS))
            if not found:
                raise UsageError(f"{p}: directory holds no {'/'.join(FORMATS)} files; pass the folder or files "
                                 f"that hold the documents")
            out.extend(found)
        elif p.is_file():
            input_format(p)
            out.append(p)
        elif p.exists():
            raise UsageError(f"{p}: not a regular file; pass a file or a folder of documents")
        else:
            raise UsageError(f"{p}: no such file; check the --input / --val-input paths")
    return out


def out_dir_problem(path: Path):
    """None if `path` is a folder or can be made one, else a one-line reason (checked before anything is created,
    so that a bad --out-dir is a clear error rather than a FileExistsError traceback after the input was read)."""
    if os.path.lexists(path) and not path.is_dir():  # a file, or a symlink to nothing
        return f"--out-dir {path} is an existing file, not a folder; remove it or choose another --out-dir"
    existing = path
    while not os.path.lexists(existing):
        existing = existing.parent
    if not existing.is_dir():
        return f"--out-dir {path} cannot be created because {existing} is a file; choose another --out-dir"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"--out-dir {path}: no permission to write in {existing}; choose another --out-dir"
    return None


def make_out_dir(path: Path) -> list:
    """mkdir -p; returns the folders it created, deepest first, so that a failed build can remove them again."""
    created = []
    d = path
    while not os.path.lexists(d):
        created.append(d)
        d = d.parent
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # e.g. a read-only or virtual file system (/proc), which os.access does not reveal
        for d in created:
            try:
                d.rmdir()
            except OSError:
                pass
        raise BuildError(f"cannot create --out-dir {path}: {e.strerror or one_line(e)}; choose another --out-dir") \
            from None
    return created


def _utf8_error(path, data: bytes, err: UnicodeDecodeError, base_offset=0, line=None) -> BuildError:
    offset = base_offset + err.start
    if line is None:
        line = data.count(b"\n", 0, err.start) + 1
    return BuildError(f"{path}:{line}: invalid UTF-8 (byte 0x{data[err.start]:02x} at byte offset {offset}"
                      f"{' of the decompressed stream' if str(path).lower().endswith(('.gz', '.xz')) else ''}); "
                      f"inputs must be UTF-8, fix or re-encode the file")


def read_txt(path: Path, docs_sep: bool):
    try:
        data = path.read_bytes()
    except OSError as e:
        raise BuildError(f"{path}: cannot read: {e.strerror or one_line(e)}; check the file and its permissions") \
            from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _utf8_error(path, data, e) from None
    if not docs_sep:
        if text.strip():
            yield text
        return
    # --txt-docs-sep: a document is a maximal run of non-blank lines; blank (whitespace-only) lines separate them.
    for doc in re.split(r"\n[ \t\r\f\v]*(?:\n[ \t\r\f\v]*)+", text.strip("\n")):
        if doc.strip():
            yield doc


def read_jsonl(path: Path, fmt: str):
    opener = {".jsonl": open, ".jsonl.gz": gzip.open, ".jsonl.xz": lzma.open}[fmt]
    offset = 0
    lineno = 0
    try:
        with opener(path, "rb") as f:
            for raw in f:
                lineno += 1
                start, offset = offset, offset + len(raw)
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise _utf8_error(path, raw, e, base_offset=start, line=lineno) from None
                if not line.strip():
                    continue  # blank lines (e.g. a trailing newline) are not records
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError) as e:  # also a too-long integer, a too-deep nesting
                    why = (f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else
                           "nested too deeply" if isinstance(e, RecursionError) else str(e).split(":")[0])
                    raise BuildError(f"{path}:{lineno}: malformed JSON ({why}); "
                                     f"fix or remove that line (one JSON object per line)") from None
                if not isinstance(record, dict) or "text" not in record:
                    raise BuildError(f"{path}:{lineno}: record has no \"text\" field; every line must be a JSON "
                                     f"object whose \"text\" holds the document")
                text = record["text"]
                if not isinstance(text, str):
                    raise BuildError(f"{path}:{lineno}: \"text\" is {type(text).__name__}, expected a string; "
                                     f"fix or remove that line")
                yield text
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise BuildError(f"{path}: cannot read{f' after line {lineno}' if lineno else ''}: {one_line(e)}; "
                         f"the file is unreadable, truncated or not {fmt[1:]}: copy or compress it again") from None


def read_parquet(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise BuildError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") from None
    row = 0
    try:
        pf = pq.ParquetFile(path)
        if "text" not in pf.schema_arrow.names:
            raise BuildError(f"{path}: no \"text\" column (columns: {', '.join(pf.schema_arrow.names)}); "
                             f"write the documents to a string column named \"text\"")
        for batch in pf.iter_batches(columns=["text"], batch_size=1024):
            for text in batch.column(0).to_pylist():
                row += 1
                if not isinstance(text, str):
                    raise BuildError(f"{path}: row {row}: \"text\" is {type(text).__name__}, expected a string; "
                                     f"drop or fix that row")
                yield text
    except BuildError:
        raise
    except UnicodeDecodeError as e:
        raise BuildError(f"{path}: invalid UTF-8 in \"text\" near row {row + 1} ({e.reason}); inputs must be UTF-8, "
                         f"re-encode the column") from None
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for files that are not parquet
        raise BuildError(f"{path}: cannot read parquet: {str(e).splitlines()[0] if str(e) else type(e).__name__}; "
                         f"the file is unreadable, truncated or not parquet: export it again") from None


def read_documents(paths, docs_sep: bool):
    for path in paths:
        fmt = input_format(path)
        if fmt == ".txt":
            yield from read_txt(path, docs_sep)
        elif fmt == ".parquet":
            yield from read_parquet(path)
        else:
            yield from read_jsonl(path, fmt)


def read_hf_fineweb(version: str):
    try:
        from datasets import load_dataset
    except ImportError:
        raise BuildError("--version streams from the Hugging Face Hub and needs the `datasets` package: "
                         "pip install datasets") from None
    # Network failures (offline, Hub down) come from deep inside `datasets`, as many exception types.
    try:
        ds = load_dataset("HuggingFaceFW/fineweb", name=HF_VERSIONS[version], split="train", streaming=True)
        for record in ds:
            yield record["text"]
    except Exception as e:
        raise BuildError(f"cannot stream HuggingFaceFW/fineweb {HF_VERSIONS[version]} from the Hugging Face Hub: "
                         f"{one_line(e)[:300]}; check the network (or HF_ENDPOINT), or build shards from local "
                         f"files with --input (offline: ./run.sh proxy)") from None


# ----------------------------------------------------------------------------------------------------------------
# Tokenizing (worker processes).

_ENC = None
_MAIN_PID = os.getpid()


def _load_encoding():
    """Load GPT-2 BPE once in the parent, so a broken tokenizer is one clear error, not a pool of failing workers
    (a Pool whose initializer raises respawns workers forever)."""
    global _ENC
    if _ENC is None:
        import tiktoken
        try:
            _ENC = tiktoken.get_encoding("gpt2")
        except Exception as e:
            raise BuildError(f"cannot load the GPT-2 tokenizer from {os.environ['TIKTOKEN_CACHE_DIR']}: "
                             f"{one_line(e)[:200]}; restore data/tiktoken_cache (git checkout data/tiktoken_cache) "
                             f"or unset TIKTOKEN_CACHE_DIR") from None


def _init_worker():
    if _ENC is None:  # spawn start method: workers do not inherit the parent's encoder
        import tiktoken
        globals()["_ENC"] = tiktoken.get_encoding("gpt2")
    if os.getpid() != _MAIN_PID:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is handled by the main process
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # pool.terminate() must simply stop workers


def tokenize(text: str) -> np.ndarray:
    """<|endoftext|> followed by the document's GPT-2 tokens, as little-endian uint16."""
    ids = _ENC.encode_ordinary(text)
    out = np.empty(len(ids) + 1, dtype="<u2")
    out[0] = BOS_ID
    out[1:] = ids  # GPT-2 ids are < 50257, they fit uint16
    return out


# ----------------------------------------------------------------------------------------------------------------
# Writing shards.

class ShardWriter:
    """Streams tokens into DIR/<shard>.tmp files; commit() renames them all, abort() deletes them. A failed write
    (disk full, I/O error) is a BuildError naming the shard."""

    def __init__(self, out_dir: Path, limit):
        self.out_dir = out_dir
        self.limit = limit  # tokens per shard; None = unlimited (the --val-input shard)
        self.index = 0
        self.count = 0
        self.file = None
        self.written = []  # (tmp path, final path, tokens)

    def add(self, tokens: np.ndarray):
        pos, n = 0, len(tokens)
        while pos < n:
            if self.file is None:
                self._open()
            take = n - pos if self.limit is None else min(n - pos, self.limit - self.count)
            if self.count + take > MAX_SHARD_TOKENS:
                raise BuildError(f"shard {shard_name(self.index)} would exceed {MAX_SHARD_TOKENS} tokens "
                                 f"(the header's int32 count): use a smaller validation input")
            try:
                self.file.write(memoryview(tokens[pos:pos + take]))
            except OSError as e:
                raise self._write_error(e) from None
            self.count += take
            pos += take
            if self.limit is not None and self.count == self.limit:
                self.end_shard()

    def _write_error(self, e: OSError) -> BuildError:
        return BuildError(f"cannot write {shard_name(self.index)} in {self.out_dir}: {e.strerror or one_line(e)}; "
                          f"free space there or choose another --out-dir")

    def _open(self):
        final = self.out_dir / shard_name(self.index)
        tmp = final.with_name(final.name + ".tmp")
        try:
            self.file = open(tmp, "wb")
            self.written.append([tmp, final, 0])
            self.file.write(bytes(HEADER_INTS * 4))  # placeholder, rewritten once the token count is known
        except OSError as e:
            raise self._write_error(e) from None

    def end_shard(self):
        """Finish the current shard (if it holds any tokens); the next token starts shard index + 1."""
        if self.file is None:
            return
        header = np.zeros(HEADER_INTS, dtype="<i4")
        header[0], header[1], header[2] = SHARD_MAGIC, SHARD_VERSION, self.count
        try:
            self.file.seek(0)
            self.file.write(header.tobytes())
            self.file.close()  # flushes: a full disk may only show here
        except OSError as e:
            raise self._write_error(e) from None
        self.file = None
        self.written[-1][2] = self.count
        self.index += 1
        self.count = 0

    def commit(self):
        for tmp, final, _ in self.written:
            try:
                os.replace(tmp, final)
            except OSError as e:
                raise BuildError(f"cannot rename {tmp.name} to {final.name} in {self.out_dir}: "
                                 f"{e.strerror or one_line(e)}; check that folder, then build again") from None

    def abort(self):
        if self.file is not None:
            try:
                self.file.close()
            except OSError:  # the write that failed (disk full) may fail again on the final flush
                pass
            self.file = None
        for tmp, _, _ in self.written:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


# ----------------------------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Tokenize text documents (GPT-2 BPE, <|endoftext|>=50256 before each document) into speedrun "
                    "shards: fineweb_val_000000.bin, then fineweb_train_000001.bin, ...",
        epilog="Input formats, by extension: .txt (one document per file; with --txt-docs-sep, documents separated "
               "by blank lines), .jsonl / .jsonl.gz / .jsonl.xz (one JSON object per line, document in \"text\"), "
               ".parquet (column \"text\"). A directory stands for its supported files, sorted. Inputs must be "
               "UTF-8: invalid bytes are an error naming the file, line and byte offset (never silently replaced). "
               "On any error no shard is left under its final name. Tokenizer files come from data/tiktoken_cache "
               "(TIKTOKEN_CACHE_DIR), so no network is needed.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input", nargs="+", metavar="PATH", help="local documents (train; also val without --val-input)")
    src.add_argument("--version", choices=sorted(HF_VERSIONS),
                     help="stream HuggingFaceFW/fineweb sample-10BT or sample-100BT (needs `datasets` and network)")
    p.add_argument("--val-input", nargs="+", metavar="PATH",
                   help="validation documents: all of them go to fineweb_val_000000.bin (any size), and --input "
                        "starts at fineweb_train_000001.bin")
    p.add_argument("--out-dir", type=Path,
                   help="output folder (default for --version: data/fineweb10B or data/fineweb100B)")
    p.add_argument("--shard-size", type=int, default=10**8, help="tokens per shard (default 10**8)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="tokenizer processes (default: all cores, %(default)s here); 1 = no pool")
    p.add_argument("--chunksize", type=int, default=16, help="documents per pool task (default 16)")
    p.add_argument("--txt-docs-sep", action="store_true",
                   help=".txt inputs hold several documents separated by blank lines")
    args = p.parse_args(argv)
    if not 1 <= args.shard_size <= MAX_SHARD_TOKENS:
        p.error(f"--shard-size must be between 1 and {MAX_SHARD_TOKENS}")
    if args.workers < 1 or args.chunksize < 1:
        p.error("--workers and --chunksize must be at least 1")
    if args.out_dir is None:
        if args.version is None:
            p.error("--out-dir is required with --input")
        args.out_dir = HERE / f"fineweb{args.version}"
    return args


def build(args) -> dict:
    """Tokenize and write all shards; return counts. Raises UsageError on a bad command line (before anything is
    created), BuildError on bad input data or an unwritable output (a folder it created for the output is removed
    again)."""
    problem = out_dir_problem(args.out_dir)
    if problem:
        raise UsageError(problem)
    val_paths = expand_inputs(args.val_input) if args.val_input else []
    train_paths = expand_inputs(args.input) if args.input else []
    if args.version and importlib.util.find_spec("datasets") is None:
        raise BuildError("--version streams from the Hugging Face Hub and needs the `datasets` package: "
                         "pip install datasets")
    _load_encoding()
    created = make_out_dir(args.out_dir)

    # The document stream, tagged so the writer knows where --val-input ends.
    def stream():
        if val_paths:
            for text in read_documents(val_paths, args.txt_docs_sep):
                yield text
            yield None  # end of the validation documents
        yield from (read_hf_fineweb(args.version) if args.version else read_documents(train_paths, args.txt_docs_sep))

    writer = ShardWriter(args.out_dir, None if val_paths else args.shard_size)
    stats = {"docs": 0, "tokens": 0, "val_docs": 0, "val_tokens": 0}
    t0 = time.perf_counter()
    try:
        from tqdm import tqdm
        bar = tqdm(unit=" docs", mininterval=0.5, smoothing=0.1, dynamic_ncols=True, disable=None)
        pool = None
        try:
            if args.workers > 1:
                pool = multiprocessing.Pool(args.workers, initializer=_init_worker)
                encode = lambda texts: pool.imap(_tokenize_or_marker, texts, chunksize=args.chunksize)  # noqa: E731
            else:
                _init_worker()
                encode = lambda texts: map(_tokenize_or_marker, texts)  # noqa: E731
            last = 0.0
            in_val = bool(val_paths)
            for tokens in encode(stream()):
                if tokens is None:  # validation input finished: it is shard 0 alone, train starts at shard 1
                    if stats["docs"] == 0:
                        raise BuildError(f"no documents in --val-input {' '.join(map(str, val_paths))} (empty "
                                         f"files, blank lines only?); pass validation files that hold documents")
                    stats["val_docs"], stats["val_tokens"] = stats["docs"], stats["tokens"]
                    writer.end_shard()
                    writer.limit = args.shard_size
                    in_val = False
                    continue
                writer.add(tokens)
                stats["docs"] += 1
                stats["tokens"] += len(tokens)
                bar.update(1)
                now = time.perf_counter()
                if now - last > 1.0:
                    last = now
                    bar.set_postfix_str(f"{stats['tokens'] / (now - t0):,.0f} tok/s, shard {writer.index}",
                                        refresh=False)
            assert not in_val
            writer.end_shard()
        finally:
            bar.close()
            if pool is not None:
                pool.terminate()
                pool.join()
        train_docs = stats["docs"] - stats["val_docs"]
        if train_docs == 0:
            what = " ".join(map(str, train_paths)) if train_paths else f"--version {args.version}"
            raise BuildError(f"no documents in {what}" + (" (empty files, blank lines only?); pass the files that "
                                                           "hold the documents" if train_paths else
                                                           "; try again later, or build from local files with --input"))
        writer.commit()
        # Shards left over from an earlier, larger build would be globbed by the trainer: remove them.
        finals = {final.name for _, final, _ in writer.written}
        stale = [f for f in args.out_dir.glob("fineweb_*.bin")
                 if re.fullmatch(r"fineweb_(val|train)_\d{6}\.bin", f.name) and f.name not in finals]
        for f in stale:
            f.unlink()
        stats["stale_removed"] = len(stale)
    except BaseException:
        writer.abort()
        for d in created:  # the output folders this run created, if still empty: a failed build leaves nothing
            try:
                d.rmdir()
            except OSError:
                break
        raise
    stats["seconds"] = time.perf_counter() - t0
    stats["shards"] = [(final, n) for _, final, n in writer.written]
    return stats


def _tokenize_or_marker(text):
    return None if text is None else tokenize(text)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        stats = build(args)
    except BuildError as e:  # anything the user can fix; a bug stays a traceback (exit status 1)
        print(f"fineweb.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fineweb.py: interrupted, no shards written", file=sys.stderr)
        return 130
    shards = stats["shards"]
    secs = stats["seconds"]
    val = shards[0] if shards and shards[0][0].name == shard_name(0) else None
    if val is None or len(shards) == 1:
        print(f"fineweb.py: warning: {'no validation' if val is None else 'no training'} shard was written "
              f"(only {stats['tokens']:,} tokens for --shard-size {args.shard_size:,})", file=sys.stderr)
    if stats["stale_removed"]:
        print(f"fineweb.py: removed {stats['stale_removed']} shard(s) of an earlier build from {args.out_dir}",
              file=sys.stderr)
    val_part = f" (val shard: {val[1]:,} tokens)" if val else ""
    print(f"fineweb.py: {stats['docs']:,} documents, {stats['tokens']:,} tokens{val_part}, {len(shards)} shards "
          f"written to {args.out_dir} in {secs:.1f} s ({stats['tokens'] / max(secs, 1e-9):,.0f} tokens/s, "
          f"{args.workers} workers)")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so a killed build still removes its .tmp shards
    sys.exit(main())
