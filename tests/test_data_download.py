"""data/cached_fineweb10B.py against a local fake of the Hugging Face Hub.

A real HTTP server on 127.0.0.1 answers the two requests huggingface_hub's hf_hub_download makes for a dataset
file (HEAD then GET on /datasets/<repo>/resolve/main/<file>, with X-Repo-Commit, ETag and Content-Length), and the
script runs as a subprocess with HF_ENDPOINT pointing at it, so the real huggingface_hub download path is exercised.
"""
import hashlib
import importlib.util
import http.server
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from train_gpt import BOS_ID, HEADER_INTS, SHARD_MAGIC, SHARD_VERSION, load_data_shard
from processes import run_group

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "data" / "cached_fineweb10B.py"
RESOLVE = "/datasets/kjj0/fineweb10B-gpt2/resolve/main/"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_shard(seed: int, ntok: int = 300) -> bytes:
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = SHARD_MAGIC, SHARD_VERSION, ntok
    tokens = np.random.default_rng(seed).integers(0, BOS_ID, ntok).astype("<u2")
    tokens[0] = BOS_ID
    return header.tobytes() + tokens.tobytes()


def name(i: int) -> str:
    return "fineweb_val_000000.bin" if i == 0 else f"fineweb_train_{i:06d}.bin"


class FakeHub(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, files):
        self.files = files  # name -> bytes
        self.requests = []  # (method, file name)
        super().__init__(("127.0.0.1", 0), FakeHubHandler)

    def gets(self, fname):
        return sum(1 for m, f in self.requests if m == "GET" and f == fname)

    def touched(self, fname):
        return [m for m, f in self.requests if f == fname]


class FakeHubHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self._serve(body=False)

    def do_GET(self):
        self._serve(body=True)

    def _serve(self, body):
        path = self.path.split("?")[0]
        fname = path[len(RESOLVE):] if path.startswith(RESOLVE) else None
        self.server.requests.append((self.command, fname or path))
        data = self.server.files.get(fname) if fname else None
        if data is None:
            msg = b"Entry not found"
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound" if fname else "RepoNotFound")
            self.send_header("X-Error-Message", "Entry not found")
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            if body:
                self.wfile.write(msg)
            return
        start = 0
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and rng.endswith("-"):
            start = int(rng[len("bytes="):-1])
        self.send_response(206 if start else 200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        self.send_header("X-Repo-Commit", COMMIT)
        self.send_header("Accept-Ranges", "bytes")
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if body:
            self.wfile.write(data[start:])


@pytest.fixture
def hub():
    files = {name(i): fake_shard(i) for i in range(4)}  # val + train 1..3
    server = FakeHub(files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def run_script(hub, tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{hub.server_address[1]}", HF_HOME=str(tmp_path / "hf_home"),
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_ETAG_TIMEOUT="5",
               HF_HUB_DOWNLOAD_TIMEOUT="5", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    for k in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        env.pop(k, None)
    return run_group([sys.executable, str(SCRIPT), *args, "--out-dir", str(tmp_path / "out")],
                          env=env, capture_output=True, text=True, timeout=60)


def test_fresh_download(hub, tmp_path):
    r = run_script(hub, tmp_path, "3")
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "out"
    for i in range(4):
        assert (out / name(i)).read_bytes() == hub.files[name(i)]
        assert hub.gets(name(i)) == 1
    assert len(load_data_shard(out / name(2))) == 300
    assert "all 4 shards present and valid" in r.stdout


def test_valid_files_are_skipped(hub, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for i in (0, 1):
        (out / name(i)).write_bytes(hub.files[name(i)])
    r = run_script(hub, tmp_path, "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert hub.touched(name(0)) == [] and hub.touched(name(1)) == []  # no HEAD, no GET
    assert hub.gets(name(2)) == 1
    assert (out / name(2)).read_bytes() == hub.files[name(2)]
    assert "skipped" in r.stdout


def test_truncated_file_is_replaced(hub, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / name(0)).write_bytes(hub.files[name(0)])
    (out / name(1)).write_bytes(hub.files[name(1)][:-10])  # truncated: size disagrees with the header
    r = run_script(hub, tmp_path, "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "invalid" in r.stdout
    assert hub.gets(name(1)) == 1 and hub.touched(name(0)) == []
    assert (out / name(1)).read_bytes() == hub.files[name(1)]


def test_missing_shard_404(hub, tmp_path):
    del hub.files[name(3)]
    r = run_script(hub, tmp_path, "3")
    assert r.returncode != 0
    assert "fineweb_train_000003.bin" in r.stderr and "re-run the same command" in r.stderr
    assert "Traceback" not in r.stderr
    out = tmp_path / "out"
    assert not (out / name(3)).exists()
    for i in range(3):  # the other shards still arrive
        assert (out / name(i)).read_bytes() == hub.files[name(i)]


def test_invalid_download_is_rejected(hub, tmp_path):
    bad = bytearray(hub.files[name(1)])
    bad[0:4] = (123).to_bytes(4, "little")  # wrong magic
    hub.files[name(1)] = bytes(bad)
    r = run_script(hub, tmp_path, "1")
    assert r.returncode != 0
    assert "fineweb_train_000001.bin" in r.stderr and "magic" in r.stderr
    assert not (tmp_path / "out" / name(1)).exists()


@pytest.mark.parametrize("n", ["104", "-1"])
def test_out_of_range_count(n, capsys):
    spec = importlib.util.spec_from_file_location("cached_fineweb10B", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exc:
        module.main([n])
    assert exc.value.code == 2
    assert "between 0 and 103" in capsys.readouterr().err
