"""Command-line errors of the data tools (data/fineweb.py, data/cached_fineweb10B.py): an unusable --out-dir or a
bad input path is one line on stderr and exit status 2, found before anything is created, read or downloaded."""
import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest

from processes import run_group

REPO = Path(__file__).resolve().parents[1]
FINEWEB = REPO / "data" / "fineweb.py"
CACHED = REPO / "data" / "cached_fineweb10B.py"


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # fineweb's pool workers unpickle its functions by module name
    spec.loader.exec_module(module)
    return module


fineweb = load(FINEWEB, "fineweb_cli_under_test")
cached = load(CACHED, "cached_fineweb10B_cli_under_test")


@pytest.fixture
def docs(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n" for i in range(5)))
    return path


def one_error_line(err: str, prog: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: "), err
    return lines[0]


def blocked_out_dirs(tmp_path):
    """(out_dir, words its error must contain): an existing file, and a path below a file."""
    afile = tmp_path / "shards"
    afile.write_text("not a folder")
    return [(afile, ["is an existing file", "another --out-dir"]),
            (afile / "sub" / "dir", ["cannot be created", str(afile), "another --out-dir"])]


# ---- data/fineweb.py -----------------------------------------------------------------------------------------

def test_fineweb_out_dir_that_is_a_file(tmp_path, docs, capsys):
    for out, words in blocked_out_dirs(tmp_path):
        assert fineweb.main(["--input", str(docs), "--out-dir", str(out), "--workers", "1"]) == 2
        line = one_error_line(capsys.readouterr().err, "fineweb.py")
        for w in words:
            assert w in line, (w, line)
    assert (tmp_path / "shards").read_text() == "not a folder"


def test_fineweb_out_dir_file_from_the_command_line_has_no_traceback(tmp_path, docs):
    (tmp_path / "out").write_text("x")
    r = run_group([sys.executable, str(FINEWEB), "--input", str(docs), "--out-dir", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "FileExistsError" not in r.stderr
    one_error_line(r.stderr, "fineweb.py")


def test_fineweb_missing_input_creates_nothing(tmp_path, capsys):
    out = tmp_path / "new" / "out"
    assert fineweb.main(["--input", str(tmp_path / "nope.jsonl"), "--out-dir", str(out)]) == 2
    line = one_error_line(capsys.readouterr().err, "fineweb.py")
    assert "nope.jsonl: no such file" in line
    assert not (tmp_path / "new").exists()


def test_fineweb_bad_data_removes_the_folders_it_created(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"text": broken}\n')
    out = tmp_path / "a" / "b" / "out"
    assert fineweb.main(["--input", str(bad), "--out-dir", str(out), "--workers", "1"]) == 2
    assert "bad.jsonl:2: malformed JSON" in one_error_line(capsys.readouterr().err, "fineweb.py")
    assert not (tmp_path / "a").exists()


def test_fineweb_bad_data_keeps_an_existing_out_dir(tmp_path, capsys):
    bad = tmp_path / "empty.jsonl"
    bad.write_text("\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert fineweb.main(["--input", str(bad), "--out-dir", str(out), "--workers", "1"]) == 2
    capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    empty = tmp_path / "empty_out"
    empty.mkdir()
    assert fineweb.main(["--input", str(bad), "--out-dir", str(empty), "--workers", "1"]) == 2
    assert empty.is_dir()  # the user's folder, even empty, is not removed


def test_fineweb_unwritable_parent(tmp_path, docs, capsys, monkeypatch):
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as for a non-root user in a read-only folder
    assert fineweb.main(["--input", str(docs), "--out-dir", str(tmp_path / "out")]) == 2
    assert "no permission to write in" in one_error_line(capsys.readouterr().err, "fineweb.py")
    assert not (tmp_path / "out").exists()


def test_fineweb_out_dir_that_cannot_be_created_is_exit_2(tmp_path, docs, capsys, monkeypatch):
    # os.access says yes, mkdir says no: a read-only or virtual file system (e.g. --out-dir /proc/x).
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if self.name == "out":  # its parent can be made, the folder itself cannot
            real_mkdir(self.parent, parents=True, exist_ok=True)
            raise PermissionError(1, "Operation not permitted", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    assert fineweb.main(["--input", str(docs), "--out-dir", str(tmp_path / "a" / "out"), "--workers", "1"]) == 2
    line = one_error_line(capsys.readouterr().err, "fineweb.py")
    assert "cannot create --out-dir" in line and "Operation not permitted" in line and "another --out-dir" in line
    assert not (tmp_path / "a").exists()  # the parent made on the way is removed again


def test_fineweb_good_build_still_creates_nested_out_dir(tmp_path, docs):
    out = tmp_path / "x" / "y"
    assert fineweb.main(["--input", str(docs), "--out-dir", str(out), "--workers", "1"]) == 0
    assert (out / "fineweb_val_000000.bin").is_file()


# ---- data/cached_fineweb10B.py --------------------------------------------------------------------------------

def test_download_out_dir_that_is_a_file(tmp_path, capsys, monkeypatch):
    def no_download(*args, **kwargs):
        raise AssertionError("download attempted")
    monkeypatch.setattr(cached, "download", no_download)
    for out, words in blocked_out_dirs(tmp_path):
        assert cached.main(["1", "--out-dir", str(out)]) == 2
        line = one_error_line(capsys.readouterr().err, "cached_fineweb10B.py")
        for w in words:
            assert w in line, (w, line)
    assert (tmp_path / "shards").read_text() == "not a folder"


def test_download_bad_count_is_usage_error_before_anything(tmp_path, capsys):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        cached.main(["200", "--out-dir", str(out)])
    assert exc.value.code == 2
    assert "between 0 and 103" in capsys.readouterr().err
    assert not out.exists()
