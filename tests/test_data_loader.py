"""Data loading: shard reader, BOSFinder, distributed_data_generator, validation_batches."""
import numpy as np
import pytest
import torch

import train_gpt as tg
from proxy_shards import BOS, build_shards, flatten, synthetic_documents, write_shard


# ----------------------------------------------------------------------------------------------------
# an independent reference of the record's BOS-aligned batching, used to check the loader batch by batch
# ----------------------------------------------------------------------------------------------------

def ref_next_batch(tokens: np.ndarray, cursor: int, L: int, msl: int, W: int):
    """Returns (per-rank ranges, new cursor) or None when the shard has too few documents left."""
    bos = np.flatnonzero(tokens == BOS)
    i, ranks = cursor, []
    for _ in range(W):
        ranges, filled = [], 0
        while filled < L + 1:
            if i >= len(bos):
                return None
            start = int(bos[i])
            nxt = int(bos[i + 1]) if i + 1 < len(bos) else len(tokens)
            end = min(nxt, start + msl, start + (L - filled) + 1)
            ranges.append((start, end))
            filled += end - start
            i += 1
        assert filled == L + 1
        ranks.append(ranges)
    return ranks, i


def ref_stream(shards: list, L: int, msl: int, W: int, epochs: int = 1):
    """Yields (shard index, per-rank ranges) for consecutive steps over all shards."""
    for _ in range(epochs):
        for k, tokens in enumerate(shards):
            cursor = 0
            while True:
                r = ref_next_batch(tokens, cursor, L, msl, W)
                if r is None:
                    break
                ranks, cursor = r
                yield k, ranks


def tokens_of(path) -> np.ndarray:
    return tg.load_data_shard(path).numpy().astype(np.int64)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shards")
    return build_shards(folder, train_shards=3, tokens_per_train_shard=60_000, val_tokens=9_000, seed=7)


def doc_tokens(num_docs=300, seed=0, max_len=120, long_len=400):
    rng = np.random.default_rng(seed)
    return flatten(synthetic_documents(num_docs, rng=rng, max_len=max_len, long_len=long_len, long_frac=0.15))


# ----------------------------------------------------------------------------------------------------
# shard files
# ----------------------------------------------------------------------------------------------------

def test_load_data_shard_roundtrip(tmp_path):
    toks = np.array([BOS, 0, 1, 32767, 32768, 50255, BOS, 65535], dtype=np.int64)
    path = write_shard(tmp_path / "s.bin", toks)
    assert path.stat().st_size == 1024 + 2 * len(toks)
    assert tg.read_shard_header(path) == len(toks)
    t = tg.load_data_shard(path)
    assert t.dtype == torch.uint16 and t.shape == (len(toks),)
    assert t.to(torch.int32).tolist() == toks.tolist()  # values above 32767 survive the casts
    assert t.to(torch.int64).tolist() == toks.tolist()
    assert tg.find_bos(t).tolist() == [0, 6]


def _assert_one_line_error(excinfo, path, *words):
    msg = str(excinfo.value)
    assert "\n" not in msg
    assert str(path) in msg
    for w in words:
        assert w in msg


@pytest.mark.parametrize("loader", [tg.read_shard_header, tg.load_data_shard])
def test_bad_magic(tmp_path, loader):
    path = write_shard(tmp_path / "bad.bin", np.arange(10), magic=20240521)
    with pytest.raises(tg.ShardError) as e:
        loader(path)
    _assert_one_line_error(e, path, "magic")


@pytest.mark.parametrize("loader", [tg.read_shard_header, tg.load_data_shard])
def test_bad_version(tmp_path, loader):
    path = write_shard(tmp_path / "v2.bin", np.arange(10), version=2)
    with pytest.raises(tg.ShardError) as e:
        loader(path)
    _assert_one_line_error(e, path, "version")


@pytest.mark.parametrize("loader", [tg.read_shard_header, tg.load_data_shard])
def test_truncated_body(tmp_path, loader):
    path = write_shard(tmp_path / "trunc.bin", np.arange(100))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(tg.ShardError) as e:
        loader(path)
    _assert_one_line_error(e, path, "truncated")


@pytest.mark.parametrize("loader", [tg.read_shard_header, tg.load_data_shard])
def test_file_longer_than_header_promises(tmp_path, loader):
    path = write_shard(tmp_path / "long.bin", np.arange(100), num_tokens=50)
    with pytest.raises(tg.ShardError) as e:
        loader(path)
    _assert_one_line_error(e, path)


@pytest.mark.parametrize("nbytes", [0, 12, 13, 1020, 1023])
@pytest.mark.parametrize("loader", [tg.read_shard_header, tg.load_data_shard])
def test_short_header(tmp_path, loader, nbytes):
    path = tmp_path / "short.bin"
    path.write_bytes(write_shard(tmp_path / "x.bin", np.arange(4)).read_bytes()[:nbytes])
    with pytest.raises(tg.ShardError) as e:
        loader(path)
    _assert_one_line_error(e, path, "header")


def test_missing_file(tmp_path):
    path = tmp_path / "nope.bin"
    with pytest.raises(tg.ShardError) as e:
        tg.read_shard_header(path)
    _assert_one_line_error(e, path)


# ----------------------------------------------------------------------------------------------------
# BOSFinder
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("W", [1, 2, 4])
def test_bosfinder_invariants(W):
    toks = doc_tokens(seed=W)
    t = torch.from_numpy(toks.astype(np.uint16))
    bos = np.flatnonzero(toks == BOS)
    finder = tg.BOSFinder(t, W)
    L, msl = 100, 64
    expected_next_doc = 0  # index into bos: ranks consume consecutive documents from one cursor
    batches = 0
    while True:
        try:
            ranks = finder.next_batch(L, msl)
        except StopIteration:
            break
        batches += 1
        assert len(ranks) == W
        for ranges in ranks:  # rank 0 first, then 1, ...
            assert sum(e - s for s, e in ranges) == L + 1
            for j, (s, e) in enumerate(ranges):
                assert toks[s] == BOS
                assert s == bos[expected_next_doc]
                expected_next_doc += 1
                assert 0 < e - s <= msl
                doc_end = bos[expected_next_doc] if expected_next_doc < len(bos) else len(toks)
                assert e <= doc_end
                if j < len(ranges) - 1 and e < doc_end:
                    assert e - s == msl  # a cut inside a document that is not the rank's last: truncation
                assert BOS not in toks[s + 1:e]
        assert finder.i == expected_next_doc
    assert batches >= 5
    # StopIteration leaves the cursor alone and keeps raising
    i = finder.i
    with pytest.raises(StopIteration):
        finder.next_batch(L, msl)
    assert finder.i == i
    # too few documents were left for a whole batch
    assert len(bos) - i < W * (L + 1)


def test_bosfinder_matches_reference():
    toks = doc_tokens(seed=11)
    t = torch.from_numpy(toks.astype(np.uint16))
    finder = tg.BOSFinder(t, 2)
    got = []
    while True:
        try:
            got.append(finder.next_batch(80, 50))
        except StopIteration:
            break
    want = [ranks for _, ranks in ref_stream([toks], 80, 50, 2)]
    assert got == want


def test_bosfinder_truncates_long_documents():
    toks = flatten([np.arange(1, 500), np.arange(1, 10), np.arange(1, 300)])
    finder = tg.BOSFinder(torch.from_numpy(toks.astype(np.uint16)), 1)
    (ranges,) = finder.next_batch(100, 64)
    assert ranges == [(0, 64), (500, 510), (510, 537)]  # 64 + 10 + 27 = 101


def test_bosfinder_quickload_identical(monkeypatch):
    toks = doc_tokens(num_docs=600, seed=3)
    t = torch.from_numpy(toks.astype(np.uint16))
    monkeypatch.setattr(tg.BOSFinder, "QUICK_SCAN_TOKENS", 700)
    quick = tg.BOSFinder(t, 2, quickload=True)
    assert quick._partial_end == 700 and len(quick.bos_idx) < len(np.flatnonzero(toks == BOS))
    full = tg.BOSFinder(t, 2)
    n = 0
    while True:
        try:
            want = full.next_batch(64, 48)
        except StopIteration:
            with pytest.raises(StopIteration):
                quick.next_batch(64, 48)
            break
        assert quick.next_batch(64, 48) == want, f"batch {n}"
        n += 1
    assert n > tg.BOSFinder.QUICK_SCAN_BATCHES + 2
    assert quick._partial_end is None


def test_bosfinder_quickload_switches_after_5_batches(monkeypatch):
    toks = doc_tokens(num_docs=2000, seed=4)
    t = torch.from_numpy(toks.astype(np.uint16))
    monkeypatch.setattr(tg.BOSFinder, "QUICK_SCAN_TOKENS", len(toks) // 2)
    quick = tg.BOSFinder(t, 1, quickload=True)
    for _ in range(5):
        quick.next_batch(32, 32)
        assert quick._partial_end is not None  # small batches stay inside the partial index
    quick.next_batch(32, 32)
    assert quick._partial_end is None
    assert np.array_equal(quick.bos_idx, np.flatnonzero(toks == BOS))


# ----------------------------------------------------------------------------------------------------
# distributed_data_generator
# ----------------------------------------------------------------------------------------------------

def expected_batch(tokens, ranges, L):
    buf = np.concatenate([tokens[s:e] for s, e in ranges])
    lengths = [e - s for s, e in ranges]
    lengths[-1] -= 1
    cu = np.full(tg.max_num_docs_for(L), L)
    cu[0] = 0
    cu[1:len(lengths) + 1] = np.cumsum(lengths)
    return buf[:-1], buf[1:], cu


def check_batch_format(inputs, targets, cu, L):
    assert inputs.dtype == torch.int32 and targets.dtype == torch.int64 and cu.dtype == torch.int32
    assert inputs.shape == (L,) and targets.shape == (L,)
    assert torch.equal(inputs[1:].long(), targets[:-1])
    assert cu.shape == (tg.max_num_docs_for(L),)
    c = cu.tolist()
    assert c[0] == 0 and c[-1] == L
    assert all(a <= b for a, b in zip(c, c[1:]))
    real = [x for x in c if x < L]
    assert real == sorted(set(real))  # strictly increasing until the padding
    # every sequence boundary holds a BOS, and there is no BOS anywhere else (no document is split
    # except by truncation, and truncated remainders are dropped, so a new range always starts at a BOS)
    assert torch.nonzero(inputs == BOS).flatten().tolist() == real


def test_generator_against_reference_across_shards(shards):
    files = [str(p) for p in shards["train"]]
    toks = [tokens_of(p) for p in files]
    W, G, bs, msl = 2, 2, 512, 96
    L = bs // (G * W)
    want = list(ref_stream(toks, L, msl, W))
    assert len({k for k, _ in want}) == 3  # the test really crosses shard boundaries
    gens = [tg.distributed_data_generator(files, bs, msl, G, r, W) for r in range(W)]
    for step, (k, ranks) in enumerate(want):
        for r, gen in enumerate(gens):
            inputs, targets, cu = next(gen)
            check_batch_format(inputs, targets, cu, L)
            ei, et, ec = expected_batch(toks[k], ranks[r], L)
            assert inputs.tolist() == ei.tolist(), (step, r)
            assert targets.tolist() == et.tolist(), (step, r)
            assert cu.tolist() == ec.tolist(), (step, r)
    for gen in gens:
        with pytest.raises(tg.DataExhausted, match="ran out after 3 shard"):
            next(gen)


def test_ranks_get_disjoint_documents(shards):
    files = [str(shards["train"][0])]
    toks = tokens_of(files[0])
    W, L, msl = 4, 64, 200
    bos = np.flatnonzero(toks == BOS)
    seen = set()
    for _, ranks in list(ref_stream([toks], L, msl, W))[:10]:
        starts = [s for ranges in ranks for s, _ in ranges]
        assert not seen & set(starts)
        seen |= set(starts)
    assert sorted(seen) == bos[:len(seen)].tolist()  # consecutive documents, none skipped
    gens = [tg.distributed_data_generator(files, L * W, msl, 1, r, W) for r in range(W)]
    firsts = [next(g)[0] for g in gens]
    for a in range(W):
        for b in range(a + 1, W):
            assert not torch.equal(firsts[a], firsts[b])


def test_send_changes_size_on_that_same_send(shards):
    files = [str(p) for p in shards["train"]]
    W, G = 2, 4
    gen = tg.distributed_data_generator(files, 2048, 256, G, 0, W)
    inputs, targets, cu = next(gen)
    check_batch_format(inputs, targets, cu, 256)
    inputs, targets, cu = gen.send(None)
    check_batch_format(inputs, targets, cu, 256)
    inputs, targets, cu = gen.send((4096, 32, G))  # L = 512, max_seq_len 32
    check_batch_format(inputs, targets, cu, 512)
    real = [x for x in cu.tolist() if x < 512] + [512]
    assert max(b - a for a, b in zip(real, real[1:])) <= 32
    assert len(real) - 1 >= 512 // 32
    inputs, targets, cu = gen.send(None)  # settings persist
    check_batch_format(inputs, targets, cu, 512)
    inputs, targets, cu = gen.send((4096, 256, 2))  # new G: L = 4096 / (2*2) = 1024
    check_batch_format(inputs, targets, cu, 1024)
    with pytest.raises(tg.ConfigError):
        gen.send((1004, 256, 4))


def test_send_matches_reference(shards):
    """After a send the cursor continues where it was: same documents as a reference that switches L."""
    files = [str(shards["train"][0])]
    toks = tokens_of(files[0])
    W = 2
    cursor = 0
    gen = tg.distributed_data_generator(files, 256, 64, 1, 1, W)
    for step, (bs, msl) in enumerate([(256, 64), (256, 64), (512, 32), (512, 32), (384, 300)]):
        L = bs // W
        ranks, cursor = ref_next_batch(toks, cursor, L, msl, W)
        got = next(gen) if step == 0 else gen.send((bs, msl, 1))
        ei, et, ec = expected_batch(toks, ranks[1], L)
        assert got[0].tolist() == ei.tolist() and got[1].tolist() == et.tolist() and got[2].tolist() == ec.tolist()


def test_train_epochs_cycles(tmp_path):
    rng = np.random.default_rng(5)
    path = write_shard(tmp_path / "fineweb_train_000001.bin", flatten(synthetic_documents(60, rng=rng, max_len=80)))
    one = list(ref_stream([tokens_of(path)], 64, 64, 1))
    n = len(one)
    assert n >= 3
    gen = tg.distributed_data_generator([str(path)], 64, 64, 1, 0, 1, epochs=2)
    got = [next(gen)[0] for _ in range(2 * n)]
    for a, b in zip(got[:n], got[n:]):
        assert torch.equal(a, b)  # the second epoch replays the first
    assert not torch.equal(got[0], got[1])
    with pytest.raises(tg.DataExhausted) as e:
        next(gen)
    assert "\n" not in str(e.value) and "--train-epochs" in str(e.value)


def test_a_shard_that_fails_to_load_in_the_background_raises_in_the_training_thread(tmp_path):
    """The next shard is read while the current one trains: its error surfaces where the loader advances to it, as
    the same ShardError, not as a dead thread or a hang."""
    rng = np.random.default_rng(6)
    good = write_shard(tmp_path / "fineweb_train_000001.bin", flatten(synthetic_documents(60, rng=rng, max_len=80)))
    bad = tmp_path / "fineweb_train_000002.bin"
    bad.write_bytes(b"\0" * 2048)  # a header of zeros: wrong magic
    n = len(list(ref_stream([tokens_of(good)], 64, 64, 1)))
    gen = tg.distributed_data_generator([str(good), str(bad)], 64, 64, 1, 0, 1)
    for _ in range(n):
        next(gen)
    with pytest.raises(tg.ShardError, match="magic 0"):
        next(gen)


def test_max_num_docs_for():
    assert tg.max_num_docs_for(16384) == 128
    assert tg.max_num_docs_for(32768) == 128
    assert tg.max_num_docs_for(49152) == 256
    assert tg.max_num_docs_for(262144) == 896
    assert tg.max_num_docs_for(256) == 128


def test_pack_cu_seqlens():
    cu = tg.pack_cu_seqlens([3, 5, 0], 8, 8)
    assert cu.dtype == torch.int32
    assert cu.tolist() == [0, 3, 8, 8, 8, 8, 8, 8]
    with pytest.raises(tg.DataExhausted):
        tg.pack_cu_seqlens([1] * 8, 8, 8)


# ----------------------------------------------------------------------------------------------------
# validation_batches
# ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("W,G", [(1, 8), (2, 4), (4, 2)])
def test_validation_batches(shards, W, G):
    path = shards["val"]
    toks = tokens_of(path)
    val_bs, val_tokens = 1024, 4096
    L = val_bs // (G * W)
    steps = G * val_tokens // val_bs
    covered = np.zeros(len(toks), dtype=int)
    for r in range(W):
        batches = list(tg.validation_batches(path, val_bs, val_tokens, G, r, W))
        assert len(batches) == steps
        for s, (inputs, targets, cu) in enumerate(batches):
            start = s * L * W + r * L
            assert inputs.dtype == torch.int32 and targets.dtype == torch.int64 and cu.dtype == torch.int32
            assert inputs.tolist() == toks[start:start + L].tolist()
            assert targets.tolist() == toks[start + 1:start + L + 1].tolist()
            bos = np.flatnonzero(toks[start:start + L] == BOS)
            want = [0] + [int(b) for b in bos if b > 0]
            assert cu.shape == (tg.max_num_docs_for(L),)
            assert cu.tolist() == want + [L] * (len(cu) - len(want))
            covered[start:start + L] += 1
    assert covered[:val_tokens].tolist() == [1] * val_tokens  # contiguous, every token exactly once
    assert covered[val_tokens:].sum() == 0


def test_validation_restarts_from_zero(shards):
    a = list(tg.validation_batches(shards["val"], 1024, 2048, 2, 0, 2))
    b = list(tg.validation_batches(shards["val"], 1024, 2048, 2, 0, 2))
    assert all(torch.equal(x[0], y[0]) for x, y in zip(a, b))


def test_generator_on_real_text(tmp_path):
    """Optional: real GPT-2 tokens (shared corpus + tiktoken); skipped where either is unavailable."""
    from proxy_shards import real_text_documents
    docs = real_text_documents(max_docs=150)
    if not docs:
        pytest.skip("shared corpus or tiktoken not available")
    toks = flatten(docs)
    path = write_shard(tmp_path / "fineweb_train_000001.bin", toks)
    want = list(ref_stream([toks], 256, 128, 2))
    assert len(want) >= 3
    gen = tg.distributed_data_generator([str(path)], 1024, 128, 2, 1, 2)
    for _, ranks in want:
        inputs, targets, cu = next(gen)
        check_batch_format(inputs, targets, cu, 256)
        ei, et, ec = expected_batch(toks, ranks[1], 256)
        assert inputs.tolist() == ei.tolist() and targets.tolist() == et.tolist() and cu.tolist() == ec.tolist()


def test_to_device_on_cpu_keeps_values_and_dtypes():
    batch = (torch.arange(5, dtype=torch.int32), torch.arange(5, dtype=torch.int64), torch.tensor([0, 5], dtype=torch.int32))
    moved = tg.to_device(batch, "cpu")
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(batch, moved))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_to_device_on_cuda_copies_through_pinned_memory():
    batch = (torch.arange(5, dtype=torch.int32),)
    (moved,) = tg.to_device(batch, "cuda")
    assert moved.is_cuda and torch.equal(moved.cpu(), batch[0])
