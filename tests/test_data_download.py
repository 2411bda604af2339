"""data/cached_fineweb10B.py against a local fake of the Hugging Face Hub.

A real HTTP server on 127.0.0.1 answers the two requests huggingface_hub's hf_hub_download makes for a dataset
file (HEAD then GET on /datasets/<repo>/resolve/main/<file>, with X-Repo-Commit, ETag and Content-Length), and the
script runs as a subprocess with HF_ENDPOINT pointing at it, so the real huggingface_hub download path is exercised.
"""
import hashlib
import importlib.util
import http.server
import os
import socket
import sys
import threading
import time
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
        self.fail_get = {}  # name -> HTTP status its GET answers (its HEAD still succeeds)
        self.down = None  # an HTTP status every request answers (a Hub that is down)
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
        if self.server.down or (body and fname in self.server.fail_get):
            self.send_response(self.server.down or self.server.fail_get[fname])
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
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


def run_script(hub, tmp_path, *args, port=None, **extra_env):
    """The script against `hub`, or against whatever listens on 127.0.0.1:port (nothing: offline)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{port or hub.server_address[1]}", HF_HOME=str(tmp_path / "hf_home"),
               HF_HUB_DISABLE_XET="1", HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_ETAG_TIMEOUT="5",
               HF_HUB_DOWNLOAD_TIMEOUT="5", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
    env.update(extra_env)
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


# ---- no network: one line, exit 2, within seconds (huggingface_hub alone retries each shard for ~40 s), and no file
# created, changed or removed ----

def closed_port() -> int:
    """A local port nothing listens on: connecting is refused at once, as for an unreachable host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(root: Path) -> dict:
    """Every file under root (hidden ones included) -> its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()} \
        if root.exists() else {}


def unreachable_line(r, port) -> str:
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"cached_fineweb10B.py: error: the Hugging Face Hub at http://127.0.0.1:{port} "
                               f"is unreachable ("), lines[0]
    assert "./run.sh proxy" in lines[0] and "HF_ENDPOINT" in lines[0]
    return lines[0]


def test_offline_fails_fast_with_one_line_and_creates_nothing(hub, tmp_path):
    port = closed_port()
    t0 = time.monotonic()
    r = run_script(hub, tmp_path, "3", port=port)
    elapsed = time.monotonic() - t0
    assert r.returncode == 2, r.stdout + r.stderr
    unreachable_line(r, port)
    assert elapsed < 15, elapsed  # huggingface_hub's retries alone sleep 1+2+4+8+8 s
    assert not (tmp_path / "out").exists()  # no shard, no .cache/huggingface/*.lock, not even the folder
    assert tree(tmp_path / "hf_home") == {}  # nor anything in huggingface_hub's own cache


@pytest.mark.parametrize("count", ["2", "1"])  # "2": shard 2 is missing; "1": nothing missing, shard 1 invalid
def test_offline_leaves_files_that_were_there_untouched(hub, tmp_path, count):
    out = tmp_path / "out"
    (out / ".cache" / "huggingface" / "download").mkdir(parents=True)
    (out / name(0)).write_bytes(hub.files[name(0)])
    (out / name(1)).write_bytes(hub.files[name(1)][:-10])  # truncated: would be downloaded again
    (out / ".cache" / "huggingface" / "download" / f"{name(1)}.lock").write_bytes(b"")  # an earlier run's
    (out / "notes.txt").write_text("mine")
    before = tree(out)
    port = closed_port()
    r = run_script(hub, tmp_path, count, port=port)
    assert r.returncode == 2, r.stdout + r.stderr
    unreachable_line(r, port)
    assert tree(out) == before  # the invalid shard is not deleted, the old lock is kept, nothing is added


def test_silent_hub_fails_within_hf_hub_etag_timeout(hub, tmp_path):
    # A host that accepts the connection and never answers (a black-holing firewall or proxy): HF_HUB_ETAG_TIMEOUT,
    # huggingface_hub's own timeout for this HEAD request, bounds the wait.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        t0 = time.monotonic()
        r = run_script(hub, tmp_path, "1", port=port, HF_HUB_ETAG_TIMEOUT="1")
        elapsed = time.monotonic() - t0
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Timeout" in unreachable_line(r, port) or "no answer within 1 s" in r.stderr
    assert elapsed < 15, elapsed
    assert not (tmp_path / "out").exists()


def test_hub_answering_503_counts_as_unreachable(hub, tmp_path):
    hub.down = 503  # huggingface_hub retries a 503 as long as a refused connection
    t0 = time.monotonic()
    r = run_script(hub, tmp_path, "1")
    elapsed = time.monotonic() - t0
    assert r.returncode == 2, r.stdout + r.stderr
    assert "(HTTP 503)" in unreachable_line(r, hub.server_address[1])
    assert elapsed < 15, elapsed
    assert [m for m, _ in hub.requests] == ["HEAD"]  # one request, no retries
    assert not (tmp_path / "out").exists()


def test_failed_download_leaves_no_lock_or_partial_file(hub, tmp_path):
    out = tmp_path / "out"
    (out / ".cache" / "huggingface" / "download").mkdir(parents=True)
    old_lock = out / ".cache" / "huggingface" / "download" / f"{name(3)}.lock"
    old_lock.write_bytes(b"")  # an earlier run's lock: not this run's to remove
    (out / name(2)).write_bytes(hub.files[name(2)][:-10])  # invalid, and its new download fails
    hub.fail_get = {name(1): 500, name(2): 500}
    r = run_script(hub, tmp_path, "3")
    assert r.returncode == 1, r.stdout + r.stderr
    assert name(1) in r.stderr and name(2) in r.stderr and "re-run the same command" in r.stderr
    assert not (out / name(1)).exists()
    assert (out / name(2)).read_bytes() == hub.files[name(2)][:-10]  # set aside during the attempt, then restored
    for i in (0, 3):
        assert (out / name(i)).read_bytes() == hub.files[name(i)]
    assert old_lock.exists()
    left = [p for p in [*out.rglob("*"), *(tmp_path / "hf_home").rglob("*")]
            if p.name.endswith((".lock", ".incomplete", ".invalid")) and p != old_lock]
    assert left == []
    assert sorted(p.name for p in out.iterdir()) == sorted([".cache", name(0), name(2), name(3)])
