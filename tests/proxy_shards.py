"""Tiny speedrun-format token shards for tests.

Format (the speedrun's shard format): a header of 256 little-endian int32 (magic 20240520, version 1, token count, zeros),
then the tokens as little-endian uint16. Every document is preceded by the BOS token 50256.

    write_shard(path, tokens)                          one shard from a token array
    synthetic_documents(n, ...)                        random documents (lists of token ids)
    patterned_documents(n, ...)                        documents made of a few repeated n-grams (learnable)
    build_shards(folder, ...)                          train + val shards from synthetic documents
    real_text_documents(max_docs)                      optional: ../shared/corpus/val.jsonl.xz (beside the repo) via tiktoken
"""
import json
import lzma
import os
from pathlib import Path

import numpy as np

MAGIC = 20240520
VERSION = 1
HEADER_INTS = 256
BOS = 50256
VOCAB = 50257


def shard_bytes(tokens, magic: int = MAGIC, version: int = VERSION, num_tokens: int = None) -> bytes:
    tokens = np.asarray(tokens)
    assert tokens.min(initial=0) >= 0 and tokens.max(initial=0) < 2 ** 16
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[0], header[1] = magic, version
    header[2] = len(tokens) if num_tokens is None else num_tokens
    return header.tobytes() + tokens.astype("<u2").tobytes()


def write_shard(path, tokens, **kw) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(shard_bytes(tokens, **kw))
    return path


def flatten(docs) -> np.ndarray:
    """BOS before every document, concatenated."""
    parts = []
    for d in docs:
        parts.append(np.array([BOS], dtype=np.int64))
        parts.append(np.asarray(d, dtype=np.int64))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def synthetic_documents(num_docs: int, rng=None, min_len: int = 1, max_len: int = 600,
                        long_frac: float = 0.1, long_len: int = 1500) -> list:
    """Random token ids in 0..50255 (never BOS); lengths uniform in [min_len, max_len] plus a fraction
    of long documents (up to long_len tokens) so truncation at max_seq_len gets exercised."""
    rng = np.random.default_rng(0) if rng is None else rng
    docs = []
    for _ in range(num_docs):
        hi = long_len if rng.random() < long_frac else max_len
        n = int(rng.integers(min_len, hi + 1))
        docs.append(rng.integers(0, BOS, size=n))
    return docs


def patterned_documents(num_docs: int, rng=None, num_patterns: int = 16, pattern_len: int = 8,
                        vocab: int = 512, min_len: int = 40, max_len: int = 400) -> list:
    """Documents built by chaining a few fixed n-grams over a small vocabulary: a tiny model can learn
    both the unigram distribution and the within-pattern continuations, so the loss falls fast."""
    rng = np.random.default_rng(1) if rng is None else rng
    patterns = rng.integers(0, vocab, size=(num_patterns, pattern_len))
    docs = []
    for _ in range(num_docs):
        n = int(rng.integers(min_len, max_len + 1))
        reps = -(-n // pattern_len)
        doc = patterns[rng.integers(0, num_patterns, size=reps)].reshape(-1)[:n]
        docs.append(doc)
    return docs


def build_shards(folder, train_shards: int = 2, tokens_per_train_shard: int = 100_000,
                 val_tokens: int = 20_000, kind: str = "synthetic", seed: int = 0) -> dict:
    """Write fineweb_val_000000.bin and fineweb_train_00000k.bin (k = 1..train_shards) into folder.

    kind: "synthetic" (random tokens, many lengths) or "patterned" (learnable n-grams).
    Each shard is cut at a document boundary-free position (like the real builder, a document may straddle
    two shards). Returns {"train": [paths], "val": path}.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    make = synthetic_documents if kind == "synthetic" else patterned_documents

    def stream(n_tokens):
        out, total = [], 0
        while total < n_tokens:
            chunk = flatten(make(64, rng=rng))
            out.append(chunk)
            total += len(chunk)
        return np.concatenate(out)[:n_tokens]

    val = write_shard(folder / "fineweb_val_000000.bin", stream(val_tokens))
    train = [write_shard(folder / f"fineweb_train_{k:06d}.bin", stream(tokens_per_train_shard))
             for k in range(1, train_shards + 1)]
    return {"train": train, "val": val}


def real_text_documents(max_docs: int = 200, path=None):
    """Tokenized real documents from the shared corpus, or None where it (or tiktoken) is unavailable."""
    default = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "val.jsonl.xz"  # ../shared beside the repo
    path = Path(path or os.environ.get("SPEEDRUN_CORPUS", default))
    if not path.exists():
        return None
    try:
        import tiktoken
        enc = tiktoken.get_encoding("gpt2")
    except Exception:
        return None
    docs = []
    with lzma.open(path, "rt") as f:
        for line in f:
            text = json.loads(line).get("text", "")
            if text:
                docs.append(enc.encode_ordinary(text))
            if len(docs) >= max_docs:
                break
    return docs
