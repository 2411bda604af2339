"""--compile-cache: a portable bundle of compiled graphs (and kernel-cache folders) that a fresh machine loads
instead of compiling, and that is ignored, with one log line, whenever it does not fit."""
import json
import os
import shutil
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

import train_gpt as tg
from processes import run_group

REPO = Path(__file__).resolve().parents[1]

# The graphs these processes compile are matrix products only, which Inductor hands to ATen (extern kernels): on
# the CPU it then writes no C++ and runs no compiler, which would cost each fresh process seconds (a vector-ISA
# probe and the kernel), while the FX graph cache and the bundle work as for any graph.
# mode save: compile, record an autotuning result, write the bundle; load: load the bundle, then compile the same
# graph; load-only: load the bundle.
PROCESS = r"""
import json, sys, torch
from pathlib import Path
from torch._dynamo.utils import counters
from torch.compiler._cache import CacheArtifactManager
import train_gpt as tg
mode, bundle = sys.argv[1], Path(sys.argv[2])
loaded, line = tg.load_compile_cache(bundle) if mode.startswith("load") else (False, "")
if mode != "load-only":
    f = torch.compile(lambda a, b: a @ b, dynamic=False)
    f(torch.randn(16, 16), torch.randn(16, 16))
saved = ""
if mode == "save":
    # what Inductor records when a kernel's launch configs have been benchmarked (GPU only)
    CacheArtifactManager.record_artifact("autotune", "ab/abcdef.best_config", {"XBLOCK": 128, "num_warps": 4})
    saved = tg.save_compile_cache(bundle)
print("RESULT=" + json.dumps(dict(loaded=loaded, line=line, saved=saved, hits=counters["inductor"]["fxgraph_cache_hit"],
                                  misses=counters["inductor"]["fxgraph_cache_miss"])))
"""


def run_script(script: str, args: list, **cache_dirs):
    """Run `script` in a fresh Python process with these cache-folder variables; returns its RESULT= JSON."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONWARNINGS="ignore", **{k: str(v) for k, v in cache_dirs.items()})
    r = run_group([sys.executable, "-c", script, *map(str, args)], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT="))[len("RESULT="):])


def run_process(mode, bundle, machine: Path):
    """PROCESS on a machine: its Inductor folder and kernel-cache folders under `machine`."""
    return run_script(PROCESS, [mode, bundle], TORCHINDUCTOR_CACHE_DIR=machine / "inductor",
                      FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=machine / "fa4", QUACK_CACHE_DIR=machine / "quack",
                      TRITON_CACHE_DIR=machine / "triton")


def fake_triton_entry(folder: Path, key: str, kernel: str) -> None:
    """One compiled kernel as Triton's cache stores it: a folder per compile key, named in its group file."""
    (folder / key).mkdir(parents=True)
    (folder / key / f"{kernel}.cubin").write_bytes(b"cubin of " + kernel.encode())
    (folder / key / f"__grp__{kernel}.json").write_text(
        json.dumps({"child_paths": {f"{kernel}.cubin": str(folder / key / f"{kernel}.cubin")}}))


LAUNCHER = f"__triton_launcher{sysconfig.get_config_var('EXT_SUFFIX')}"


@pytest.fixture(scope="module")
def two_machines(tmp_path_factory):
    """Machine A compiles (kernel-cache folders filled, an autotuning result recorded) and writes a bundle; its folders
    are then removed. Machine B, fresh (another path, empty folders), loads the bundle and compiles the same graph.
    Last, a process at A's Inductor path only loads the bundle. The processes' results, in order."""
    tmp = tmp_path_factory.mktemp("bundle")
    bundle, a, b = tmp / "bundle.zip", tmp / "machine_a", tmp / "machine_b"
    (a / "fa4" / "sub").mkdir(parents=True)
    (a / "fa4" / "sub" / "kernel.o").write_bytes(b"compiled kernel")
    (a / "quack").mkdir()
    (a / "quack" / "gemm_act.o").write_bytes(b"quack kernel")
    fake_triton_entry(a / "triton", "KEY1", "_softcap_ce_backward_kernel")  # ours: travels
    fake_triton_entry(a / "triton", "KEY2", "triton_poi_fused_add_0")  # Inductor's: already in the artifacts
    (a / "triton" / "KEY3").mkdir()
    (a / "triton" / "KEY3" / LAUNCHER).write_bytes(b"compiled C module")  # Triton's gcc-built launcher: travels
    saved = run_process("save", bundle, a)
    inductor_dir_entry = zipfile.ZipFile(bundle).read(tg.INDUCTOR_DIR_ENTRY).decode()
    shutil.rmtree(a)  # a fresh machine has no such folder
    loaded = run_process("load", bundle, b)
    at_origin = run_process("load-only", bundle, a)
    return dict(tmp=tmp, bundle=bundle, a=a, b=b, saved=saved, inductor_dir_entry=inductor_dir_entry,
                loaded=loaded, at_origin=at_origin)


@pytest.mark.slow
def test_bundle_from_one_machine_skips_compilation_on_a_fresh_one(two_machines):
    """Inductor's graphs and the kernel-cache folders (FlashAttention-4's, quack's, and of Triton's this script's own
    kernels and Triton's compiled C modules) travel in the bundle."""
    first, second, bundle, b = (two_machines[k] for k in ("saved", "loaded", "bundle", "b"))
    assert first["misses"] >= 1 and "wrote" in first["saved"] and "5 kernel-cache files" in first["saved"]
    # the fresh machine: empty Inductor cache, empty kernel-cache folders
    assert second["loaded"] and second["line"].startswith(f"compile cache: loaded {bundle}")
    assert second["hits"] >= 1 and second["misses"] == 0
    assert (b / "fa4" / "sub" / "kernel.o").read_bytes() == b"compiled kernel"
    assert (b / "quack" / "gemm_act.o").read_bytes() == b"quack kernel"
    restored = sorted(p.relative_to(b / "triton").as_posix() for p in (b / "triton").rglob("*") if p.is_file())
    assert restored == ["KEY1/__grp___softcap_ce_backward_kernel.json", "KEY1/_softcap_ce_backward_kernel.cubin",
                        f"KEY3/{LAUNCHER}"]
    # Triton finds an entry through the absolute paths in its group file: they must point into the new folder
    group = json.loads((b / "triton" / restored[0]).read_text())
    assert group["child_paths"] == {"_softcap_ce_backward_kernel.cubin": str(b / "triton" / restored[1])}


@pytest.mark.slow
def test_autotuning_results_are_also_placed_where_the_bundles_kernels_look_for_them(two_machines):
    """A kernel from the bundle looks for its autotuning result under the Inductor folder of the machine that wrote
    the bundle; on a machine whose folder has another path the result must be there too, or it is benchmarked again."""
    origin, here = two_machines["a"] / "inductor", two_machines["b"] / "inductor"
    assert two_machines["inductor_dir_entry"] == str(origin)
    line = two_machines["loaded"]["line"]
    assert "1 autotuning results also placed under " + str(origin) in line and "\n" not in line
    restored = (here / "ab" / "abcdef.best_config").read_bytes()  # PyTorch's own restore
    assert json.loads(restored)["XBLOCK"] == 128
    assert (origin / "ab" / "abcdef.best_config").read_bytes() == restored
    # loading where the bundle was written: nothing to copy, nothing said
    at_origin = two_machines["at_origin"]
    assert at_origin["loaded"] and "also placed" not in at_origin["line"]


def test_autotuning_results_never_leave_their_folder_and_an_unwritable_one_is_one_clause(tmp_path, monkeypatch):
    here, origin = tmp_path / "here", tmp_path / "there"
    (here / "ab").mkdir(parents=True)
    (here / "ab" / "k.best_config").write_bytes(b"{}")
    (here / "ab" / "k.py").write_bytes(b"source")
    monkeypatch.setattr(tg, "inductor_cache_dir", lambda: str(here))
    note = tg.place_autotune_results(["ab/k.best_config", "ab/k.py", "../ab/k.best_config", "/etc/k.best_config"],
                                     str(origin))
    assert note.startswith("; 1 autotuning results") and sorted(p.name for p in origin.rglob("*")) == ["ab", "k.best_config"]
    assert tg.place_autotune_results([], str(origin)) == "" and tg.place_autotune_results(["ab/k.best_config"], "") == ""
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder should be")
    note = tg.place_autotune_results(["ab/k.best_config"], str(blocked))
    assert f"TORCHINDUCTOR_CACHE_DIR={blocked}" in note and "\n" not in note


@pytest.mark.skipif(tg.triton is None, reason="needs triton")
def test_restored_triton_entry_is_a_cache_hit_for_triton_itself(tmp_path, monkeypatch):
    """Triton's own cache manager, pointed at the restored folder, finds the entry through the rewritten group."""
    from triton.runtime.cache import FileCacheManager
    fake_triton_entry(tmp_path / "machine_a", "KEY1", "_sym_gram_kernel")
    data = (tmp_path / "machine_a" / "KEY1" / "__grp___sym_gram_kernel.json").read_bytes()
    fresh = tmp_path / "machine_b" / "KEY1"
    fresh.mkdir(parents=True)
    (fresh / "_sym_gram_kernel.cubin").write_bytes(b"cubin")
    (fresh / "__grp___sym_gram_kernel.json").write_bytes(tg.relocated_triton_group(data, fresh))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "machine_b"))
    assert FileCacheManager("KEY1").get_group("_sym_gram_kernel.json") == {
        "_sym_gram_kernel.cubin": str(fresh / "_sym_gram_kernel.cubin")}
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "machine_c"))  # not restored there: a miss
    assert FileCacheManager("KEY1").get_group("_sym_gram_kernel.json") is None


@pytest.mark.skipif(tg.triton is None, reason="needs triton")
def test_bundle_knows_this_files_triton_kernels_by_name():
    names = tg.own_triton_kernels()
    assert {"_softcap_ce_backward_kernel", "_softcap_ce_forward_kernel", "_sym_gram_kernel"} <= names
    assert not any(n.startswith("triton_") for n in names)  # Inductor's prefix: those are never ours


def test_kernel_cache_folders_get_their_owners_defaults_and_keep_a_users_choice(tmp_path, monkeypatch):
    for var in ("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", "TRITON_CACHE_DIR"):  # setenv first: monkeypatch then
        monkeypatch.setenv(var, "")                                         # restores what the call sets
        monkeypatch.delenv(var)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("QUACK_CACHE_DIR", str(tmp_path / "mine"))
    tg.default_kernel_cache_dirs()  # in os.environ, where the kernels' owners read them
    assert os.environ["QUACK_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_DIR"].endswith("flash_attention_cute_dsl_cache")
    assert Path(os.environ["TRITON_CACHE_DIR"]).parts[-2:] == ("triton", "3")  # Inductor's folder for GPU 3


EDITED_SCRIPT_PROCESS = r"""
import json, sys, torch
from pathlib import Path
from torch._dynamo.utils import counters
import train_gpt as tg
graphs, bundle = sys.argv[1].split(","), Path(sys.argv[2])
loaded, line = tg.load_compile_cache(bundle)
functions = {"mm": lambda a, b: a @ b, "bmm": lambda a, b: torch.bmm(a, b)}
for name in graphs:
    shape = (4, 8, 8) if name == "bmm" else (8, 8)
    torch.compile(functions[name], dynamic=False)(torch.randn(shape), torch.randn(shape))
note = tg.compile_cache_after_warm_up(bundle, loaded)
print("RESULT=" + json.dumps(dict(loaded=loaded, note=note, misses=counters["inductor"]["fxgraph_cache_miss"])))
"""


@pytest.mark.slow
def test_a_bundle_that_lacked_graphs_the_run_compiled_is_rewritten_with_them(tmp_path):
    """After the script gains a graph, a run given the old bundle compiles it and rewrites the bundle with every
    graph it used, so the next fresh start compiles nothing; a bundle that had them all is left alone."""
    bundle = tmp_path / "bundle.zip"

    def fresh_run(graphs, k):
        return run_script(EDITED_SCRIPT_PROCESS, [graphs, bundle],
                          **{var: tmp_path / f"{var}_{k}" for var in ("TORCHINDUCTOR_CACHE_DIR", *tg.COMPILE_CACHE_DIRS)})

    first = fresh_run("mm", 1)
    assert not first["loaded"] and first["note"].startswith(f"compile cache: wrote {bundle}")
    edited = fresh_run("mm,bmm", 2)
    assert edited["loaded"] and edited["misses"] == 1
    assert edited["note"].startswith(f"compile cache: {bundle} lacked 1 graph(s) this run compiled")
    assert f"; wrote {bundle}" in edited["note"]
    written = bundle.read_bytes()
    again = fresh_run("mm,bmm", 3)
    assert again == dict(loaded=True, note="", misses=0)
    assert bundle.read_bytes() == written


def test_missing_bundle_is_reported_and_will_be_written(tmp_path):
    loaded, line = tg.load_compile_cache(tmp_path / "none.zip")
    assert not loaded and "not found" in line and "written after the warm-up" in line


def test_trainer_and_benchmark_open_the_bundle_the_flag_names_and_only_that(tmp_path, monkeypatch):
    """open_compile_cache (run() and bench.py): no flag, no bundle; a flag names the file to load or to write. Either
    way every kernel-cache folder gets a default, so that a bundle written later can carry it."""
    for var in tg.COMPILE_CACHE_DIRS:  # setenv first: monkeypatch then restores what the call sets
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    assert tg.open_compile_cache(tg.parse_args([])) == (None, False, "")
    assert all(os.environ[var] for var in tg.COMPILE_CACHE_DIRS)
    path, loaded, line = tg.open_compile_cache(tg.parse_args(["--compile-cache", str(tmp_path / "b.zip")]))
    assert path == tmp_path / "b.zip" and not loaded and "not found" in line


def test_corrupt_bundle_is_ignored_with_one_line(tmp_path):
    bad = tmp_path / "bad.zip"
    bad.write_bytes(b"not a zip file")
    loaded, line = tg.load_compile_cache(bad)
    assert not loaded and "unreadable" in line and "\n" not in line


def test_bundle_from_other_versions_is_ignored_naming_the_difference(tmp_path):
    other = tmp_path / "other.zip"
    key = dict(tg.compile_cache_key(), torch="2.99.0", gpu="NVIDIA B200 sm100")
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("key.json", json.dumps(key))
        z.writestr("artifacts.bin", b"\x00")
    loaded, line = tg.load_compile_cache(other)
    assert not loaded and "torch 2.99.0 there" in line and "NVIDIA B200 sm100 there" in line and "ignored" in line


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="the process start is read from Linux's /proc")
def test_cold_start_clock_starts_at_process_start_so_the_imports_count():
    """The figure 'process start to timed loop' includes importing torch: the clock is the process's own start,
    not train_gpt's import (here one second of sleep before the import must be inside it)."""
    code = ("import time; t0 = time.time(); time.sleep(1.0); import train_gpt as tg; "
            "print(tg.PROCESS_START - t0, time.time() - tg.PROCESS_START)")
    r = run_group([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    before_t0, elapsed = map(float, r.stdout.split())
    assert -5.0 < before_t0 <= 0.05  # the interpreter's own start-up precedes t0 by milliseconds
    assert elapsed >= 1.0
