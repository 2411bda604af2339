"""data/fineweb.py: shard writer -> train_gpt reader round trip, splitting, input formats, determinism, bad input."""
import concurrent.futures
import contextlib
import gzip
import importlib.util
import io
import json
import lzma
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tiktoken

from train_gpt import BOS_ID, HEADER_INTS, SHARD_MAGIC, SHARD_VERSION, load_data_shard
from processes import run_group

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "data" / "fineweb.py"

_spec = importlib.util.spec_from_file_location("fineweb_builder", SCRIPT)
fineweb = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fineweb  # pool workers unpickle its functions by module name
_spec.loader.exec_module(fineweb)

ENC = tiktoken.get_encoding("gpt2")

# No blank lines inside documents, so the same documents can be written in every input format.
DOCS = [
    "The quick brown fox jumps over the lazy dog.",
    "Special strings are plain text here: <|endoftext|> stays ordinary.\nSecond line.",
    "Unicode: naïve café, 日本語, emoji 🚀 and a tab\there.",
    "A longer document. " * 40,
    "short",
]


def stream(docs):
    out = []
    for d in docs:
        out.append(BOS_ID)
        out.extend(ENC.encode_ordinary(d))
    return np.array(out, dtype=np.uint16)


def names(out_dir):
    return sorted(p.name for p in Path(out_dir).iterdir())


def shard_files(out_dir):
    """Shards in stream order: val (index 0) first, then train 1, 2, ..."""
    return sorted(Path(out_dir).glob("fineweb_*.bin"), key=lambda p: p.name.rsplit("_", 1)[1])


def write_jsonl(path, docs, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"id": len(d), "text": d}) + "\n")
    return path


def build(*argv):
    """Run the CLI in this process (fast); returns its exit status. One worker unless a test asks for more: a pool
    forked from this process, which has threads of its own (torch's, pytest-timeout's), can deadlock in the child."""
    argv = [str(a) for a in argv]
    return fineweb.main(argv if "--workers" in argv else [*argv, "--workers", "1"])


def run_cli(*argv):
    return run_group([sys.executable, str(SCRIPT), *map(str, argv)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "TIKTOKEN_CACHE_DIR": str(REPO / "data" / "tiktoken_cache")})


def test_format_constants_come_from_train_gpt():
    import train_gpt
    assert (fineweb.SHARD_MAGIC, fineweb.SHARD_VERSION, fineweb.HEADER_INTS, fineweb.BOS_ID) == \
        (train_gpt.SHARD_MAGIC, train_gpt.SHARD_VERSION, train_gpt.HEADER_INTS, train_gpt.BOS_ID)


def test_round_trip_with_val_input(tmp_path):
    val = write_jsonl(tmp_path / "val.jsonl", DOCS[:2])
    train = write_jsonl(tmp_path / "train.jsonl", DOCS[2:])
    out = tmp_path / "out"
    assert build("--input", train, "--val-input", val, "--out-dir", out, "--workers", 1) == 0
    assert names(out) == ["fineweb_train_000001.bin", "fineweb_val_000000.bin"]
    for fname, docs in (("fineweb_val_000000.bin", DOCS[:2]), ("fineweb_train_000001.bin", DOCS[2:])):
        expected = stream(docs)
        raw = (out / fname).read_bytes()
        header = np.frombuffer(raw[:HEADER_INTS * 4], dtype="<i4")
        assert header[0] == SHARD_MAGIC and header[1] == SHARD_VERSION and header[2] == len(expected)
        assert not header[3:].any()
        assert len(raw) == HEADER_INTS * 4 + 2 * len(expected)
        tokens = load_data_shard(out / fname).numpy()
        np.testing.assert_array_equal(tokens, expected)
        assert (tokens == BOS_ID).sum() == len(docs)  # "<|endoftext|>" in the text is not the special token


def test_val_input_is_one_shard_of_any_size(tmp_path):
    val = write_jsonl(tmp_path / "val.jsonl", DOCS)
    train = write_jsonl(tmp_path / "train.jsonl", DOCS)
    full = stream(DOCS)
    size = len(full) // 3
    assert build("--input", train, "--val-input", val, "--out-dir", tmp_path / "o", "--shard-size", size) == 0
    files = shard_files(tmp_path / "o")
    assert files[0].name == "fineweb_val_000000.bin"
    np.testing.assert_array_equal(load_data_shard(files[0]).numpy(), full)  # val ignores --shard-size
    train_files = files[1:]
    assert [f.name for f in train_files] == [f"fineweb_train_{i:06d}.bin" for i in range(1, len(train_files) + 1)]
    np.testing.assert_array_equal(np.concatenate([load_data_shard(f).numpy() for f in train_files]), full)


def test_split_at_exact_document_boundary(tmp_path):
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    boundary = len(stream(DOCS[:2]))
    out = tmp_path / "out"
    assert build("--input", src, "--out-dir", out, "--shard-size", boundary) == 0
    val = load_data_shard(out / "fineweb_val_000000.bin").numpy()
    np.testing.assert_array_equal(val, stream(DOCS[:2]))
    train1 = load_data_shard(out / "fineweb_train_000001.bin").numpy()
    assert train1[0] == BOS_ID  # the next shard starts with the next document's delimiter
    everything = np.concatenate([load_data_shard(f).numpy() for f in shard_files(out)])
    np.testing.assert_array_equal(everything, stream(DOCS))


@pytest.mark.parametrize("extra", [1, 7])
def test_document_split_across_shards(tmp_path, extra):
    src = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    full = stream(DOCS)
    size = len(stream(DOCS[:3])) + extra  # DOCS[3] (long) is cut: head in one shard, tail in the next
    out = tmp_path / "out"
    assert build("--input", src, "--out-dir", out, "--shard-size", size, "--workers", 2, "--chunksize", 1) == 0
    n_shards = -(-len(full) // size)
    expected_names = ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, n_shards)]
    assert sorted(expected_names) == names(out)
    shards = [load_data_shard(out / n).numpy() for n in expected_names]
    assert all(len(s) == size for s in shards[:-1]) and 0 < len(shards[-1]) <= size  # last holds the remainder
    np.testing.assert_array_equal(np.concatenate(shards), full)


def _parquet(path, docs):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=2)
    return [path]


def _txt_files(tmp_path, docs):
    d = tmp_path / "txt"
    d.mkdir()
    paths = []
    for i, doc in enumerate(docs):
        (d / f"doc{i:02d}.txt").write_text(doc, encoding="utf-8")
        paths.append(d / f"doc{i:02d}.txt")
    return paths


FORMAT_CASES = {
    "txt": lambda tmp, docs: _txt_files(tmp, docs),
    "txt-dir": lambda tmp, docs: [_txt_files(tmp, docs)[0].parent],
    "txt-sep": lambda tmp, docs: [tmp / "docs.txt"] if (tmp / "docs.txt").write_text(
        "\n\n\n".join(docs[:2]) + "\n  \n" + "\n\n".join(docs[2:]) + "\n", encoding="utf-8") else [],
    "jsonl": lambda tmp, docs: [write_jsonl(tmp / "d.jsonl", docs)],
    "jsonl.gz": lambda tmp, docs: [write_jsonl(tmp / "d.jsonl.gz", docs, gzip.open)],
    "jsonl.xz": lambda tmp, docs: [write_jsonl(tmp / "d.jsonl.xz", docs, lzma.open)],
    "parquet": lambda tmp, docs: _parquet(tmp / "d.parquet", docs),
    "mixed": lambda tmp, docs: [write_jsonl(tmp / "a.jsonl.gz", docs[:2], gzip.open), *_parquet(tmp / "b.parquet",
                                                                                                docs[2:])],
}


@pytest.mark.parametrize("fmt", list(FORMAT_CASES))
def test_input_formats(tmp_path, fmt):
    paths = FORMAT_CASES[fmt](tmp_path, DOCS)
    extra = ["--txt-docs-sep"] if fmt == "txt-sep" else []
    out = tmp_path / "out"
    assert build("--input", *paths, "--out-dir", out, "--shard-size", 40, "--workers", 1, *extra) == 0
    got = np.concatenate([load_data_shard(f).numpy() for f in shard_files(out)])
    np.testing.assert_array_equal(got, stream(DOCS))


def test_jsonl_blank_lines_and_crlf(tmp_path):
    src = tmp_path / "d.jsonl"
    src.write_bytes(b'{"text": "a\\n\\nb"}\r\n\r\n{"text": ""}\n\n{"text": "c"}')  # no final newline
    assert build("--input", src, "--out-dir", tmp_path / "o") == 0
    np.testing.assert_array_equal(load_data_shard(tmp_path / "o" / "fineweb_val_000000.bin").numpy(),
                                  stream(["a\n\nb", "", "c"]))


def test_deterministic_across_worker_counts(tmp_path):
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "é", "🚀", "\n", "the", "of", "1234"]
    docs = [" ".join(rng.choice(words, size=rng.integers(1, 200))) for _ in range(300)]
    src = write_jsonl(tmp_path / "d.jsonl.gz", docs, gzip.open)
    size = len(stream(docs)) // 4 + 3
    outs = []
    for workers, chunk in ((1, 16), (2, 1), (3, 7)):
        out = tmp_path / f"w{workers}"
        assert build("--input", src, "--out-dir", out, "--shard-size", size, "--workers", workers,
                     "--chunksize", chunk) == 0
        outs.append({f.name: f.read_bytes() for f in shard_files(out)})
    assert len(outs[0]) == 4 and outs[0] == outs[1] == outs[2]


def test_rebuild_replaces_stale_shards(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", DOCS)
    out = tmp_path / "out"
    assert build("--input", src, "--out-dir", out, "--shard-size", 20) == 0
    assert len(shard_files(out)) > 2
    assert build("--input", src, "--out-dir", out) == 0
    assert names(out) == ["fineweb_val_000000.bin"]


# ---- bad input: run the CLI, expect exit status 2, a one-line message naming the problem and what to do, and
# nothing left behind, whether the problem is in the command line (found before anything is read or created) or in
# the data (found while building, maybe after several shards were written) ----

def _bad_cases(tmp: Path):
    good = write_jsonl(tmp / "good.jsonl", DOCS)
    many = write_jsonl(tmp / "many.jsonl", DOCS * 20)
    with open(many, "a") as f:
        f.write('{"text": "unterminated\n')  # fails after several shards were already written
    (tmp / "malformed.jsonl").write_text('{"text": "ok"}\n{"text": "ok"}\n{"text": oops}\n')
    (tmp / "notext.jsonl").write_text('{"text": "ok"}\n{"body": "no text field"}\n')
    (tmp / "nulltext.jsonl").write_text('{"text": null}\n')
    (tmp / "list.jsonl").write_text('["text", "a JSON array, not an object"]\n')
    (tmp / "deep.jsonl").write_text('{"text": "ok"}\n' + "[" * 100_000 + "\n")  # json.loads: RecursionError
    (tmp / "badutf8.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (tmp / "badutf8.txt").write_bytes(b"line one\nline \xff two\n")
    (tmp / "empty.jsonl").write_text("\n\n")
    (tmp / "empty.txt").write_text("  \n")
    (tmp / "data.csv").write_text("text\nhello\n")
    (tmp / "not.parquet").write_text("this is not parquet")
    with gzip.open(tmp / "trunc.jsonl.gz", "wt") as f:
        f.write('{"text": "x"}\n' * 1000)
    (tmp / "trunc.jsonl.gz").write_bytes((tmp / "trunc.jsonl.gz").read_bytes()[:-20])
    # case: (arguments, words the error line must hold: what is wrong, then what to do)
    return {
        "missing": ([tmp / "nope.jsonl"], ["nope.jsonl", "no such file", "check the --input"]),
        "unknown_ext": ([tmp / "data.csv"], ["data.csv", "unsupported input type", "convert it"]),
        "malformed_json": ([good, tmp / "malformed.jsonl"], ["malformed.jsonl:3", "malformed JSON",
                                                             "fix or remove that line"]),
        "too_deep_json": ([tmp / "deep.jsonl"], ["deep.jsonl:2", "malformed JSON (nested too deeply)",
                                                 "fix or remove that line"]),
        "not_an_object": ([tmp / "list.jsonl"], ["list.jsonl:1", 'no "text" field', "must be a JSON object"]),
        "no_text_field": ([tmp / "notext.jsonl"], ["notext.jsonl:2", '"text"', "must be a JSON object"]),
        "null_text": ([tmp / "nulltext.jsonl"], ["nulltext.jsonl:1", "NoneType", "fix or remove that line"]),
        "non_utf8_jsonl": ([tmp / "badutf8.jsonl"], ["badutf8.jsonl:2", "invalid UTF-8", "byte offset 28",
                                                     "re-encode"]),
        "non_utf8_txt": ([tmp / "badutf8.txt"], ["badutf8.txt:2", "invalid UTF-8", "byte offset 14", "re-encode"]),
        "empty_jsonl": ([tmp / "empty.jsonl"], ["no documents", "empty.jsonl", "pass the files that hold"]),
        "empty_txt": ([tmp / "empty.txt"], ["no documents", "pass the files that hold"]),
        "empty_val": ([good, "--val-input", tmp / "empty.jsonl"], ["no documents in --val-input",
                                                                   "pass validation files"]),
        "not_parquet": ([tmp / "not.parquet"], ["not.parquet", "cannot read parquet", "export it again"]),
        "truncated_gz": ([tmp / "trunc.jsonl.gz"], ["trunc.jsonl.gz", "cannot read", "compress it again"]),
        "late_error": ([many, "--shard-size", 50], ["many.jsonl:101", "malformed JSON", "fix or remove that line"]),
    }


# the cases run as the real CLI, a subprocess each: a problem found in the command line and one found by a worker
# process after shards were written; the others run main() in this process (a process's start costs more than
# its work here)
AS_SUBPROCESS = ("missing", "late_error")


def build_in_process(*argv):
    """build(*argv) as run_cli would run it: its exit status and what it printed, as a CompletedProcess."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = build(*argv)
        except SystemExit as e:  # argparse's exit
            status = e.code
    return subprocess.CompletedProcess(argv, status, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def bad_results(tmp_path_factory):
    """Run every bad-input case: AS_SUBPROCESS as subprocesses (side by side), the rest in this process."""
    tmp = tmp_path_factory.mktemp("bad")
    cases = _bad_cases(tmp)

    def run(case):
        inputs, _ = cases[case]
        out = tmp / f"out_{case}"
        workers = 2 if case == "late_error" else 1
        args = ("--input", *inputs, "--out-dir", out, "--workers", workers)
        return case, out, run_cli(*args) if case in AS_SUBPROCESS else build_in_process(*args)

    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        results = {case: (out, r) for case, out, r in ex.map(run, AS_SUBPROCESS)}
    results.update({case: (out, r) for case, out, r in map(run, [c for c in cases if c not in AS_SUBPROCESS])})
    return cases, results


@pytest.mark.parametrize("case", [
    "missing", "unknown_ext", "malformed_json", "too_deep_json", "not_an_object", "no_text_field", "null_text",
    "non_utf8_jsonl", "non_utf8_txt", "empty_jsonl", "empty_txt", "empty_val", "not_parquet", "truncated_gz",
    "late_error"])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(bad_results, case):
    cases, results = bad_results
    out, r = results[case]
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fineweb.py: error: "), r.stderr
    for needle in cases[case][1]:
        assert needle in lines[0], (needle, lines[0])
    assert not out.exists()  # no shard, no .tmp, not even the (empty) output folder the build created


def test_bad_data_leaves_an_earlier_build_untouched(tmp_path, capsys):
    # Stale shards are removed only after a complete build: a failing one keeps the earlier build as it was.
    out = tmp_path / "out"
    assert build("--input", write_jsonl(tmp_path / "d.jsonl", DOCS), "--out-dir", out, "--shard-size", 20) == 0
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    assert len(before) > 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n' * 50 + '{"text": 3}\n')
    capsys.readouterr()
    assert build("--input", bad, "--out-dir", out, "--shard-size", 10, "--workers", 1) == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("fineweb.py: error: ") and "bad.jsonl:51" in line and "fix or remove that line" in line
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # no .tmp, no new or removed shard


def test_disk_full_while_writing_is_exit_2_and_leaves_no_tmp(tmp_path, capsys, monkeypatch):
    space = [3000]  # bytes left on the disk: the first shard (1024-byte header + 800) fits, the second does not

    class FullDisk:
        def __init__(self, path, mode):
            self.f = open(path, mode)

        def write(self, data):
            n = len(memoryview(data).cast("B"))
            if n > space[0]:
                raise OSError(28, "No space left on device")
            space[0] -= n
            return self.f.write(data)

        def seek(self, pos):
            return self.f.seek(pos)

        def close(self):
            self.f.close()

    def fake_open(path, mode="r", *args, **kwargs):  # shards are opened "wb", inputs "rb"
        return FullDisk(path, mode) if "w" in mode else open(path, mode, *args, **kwargs)

    monkeypatch.setattr(fineweb, "open", fake_open, raising=False)  # the module's name comes before the builtin
    src = write_jsonl(tmp_path / "d.jsonl", DOCS * 10)
    out = tmp_path / "new" / "out"
    assert build("--input", src, "--out-dir", out, "--shard-size", 400, "--workers", 1) == 2
    line, = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("fineweb.py: error: cannot write fineweb_"), line
    assert "No space left on device" in line and "free space there or choose another --out-dir" in line
    assert space[0] < 3000 - 1824  # the first shard was written whole before the disk filled
    assert not (tmp_path / "new").exists()  # the .tmp shards and the folders this run created are gone


def test_version_without_network_is_one_line_exit_2(tmp_path):
    # A stand-in `datasets` whose streaming fails the way an offline machine does, deep inside the library.
    stub = tmp_path / "stub" / "datasets"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(
        "def load_dataset(*args, **kwargs):\n"
        "    raise ConnectionError(\"Couldn't reach 'HuggingFaceFW/fineweb' on the Hub (LocalEntryNotFoundError)\")\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "stub"), os.environ.get("PYTHONPATH", "")])}
    out = tmp_path / "out"
    r = run_group([sys.executable, str(SCRIPT), "--version", "10B", "--out-dir", str(out), "--workers", "1"],
                  capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    line, = r.stderr.strip().splitlines()
    assert line.startswith("fineweb.py: error: cannot stream HuggingFaceFW/fineweb sample-10BT"), line
    assert "ConnectionError" in line and "check the network" in line and "./run.sh proxy" in line
    assert not out.exists()


def test_bad_options():
    r = run_cli("--input", "x.jsonl")  # no --out-dir
    assert r.returncode == 2 and "--out-dir" in r.stderr
    with pytest.raises(SystemExit):
        fineweb.parse_args(["--input", "x.jsonl", "--out-dir", "o", "--shard-size", "0"])
    with pytest.raises(SystemExit):
        fineweb.parse_args(["--input", "x.jsonl", "--version", "10B"])


def test_foreign_empty_tiktoken_cache_falls_back_to_the_repo_copy(tmp_path):
    # Seen on the GPU machines: the image sets TIKTOKEN_CACHE_DIR to a folder without the GPT-2 files, and
    # tiktoken would then try (and, offline, hang trying) to download them.
    (tmp_path / "empty_cache").mkdir()
    train = write_jsonl(tmp_path / "train.jsonl", DOCS)
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty_cache"), "HTTPS_PROXY": "http://127.0.0.1:9"}
    r = run_group([sys.executable, str(SCRIPT), "--input", str(train), "--out-dir", str(tmp_path / "out"),
                        "--shard-size", "50"], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    np.testing.assert_array_equal(load_data_shard(tmp_path / "out" / "fineweb_val_000000.bin").numpy(), stream(DOCS)[:50])
    assert not list((tmp_path / "empty_cache").iterdir())
