"""Where the persistent one-read kernel's time goes: copies of train_gpt.py with parts of its synchronisation cut
(the results are wrong; only the times count), env VARIANTS (comma list) and CONFIGS (tile, ahead, recompute).

    VARIANTS=full,no_sync_at_all python3 bench/kernels/ce_one_read_ablate.py OUT.json"""
import importlib.util, json, sys, os
from pathlib import Path
import torch, triton, triton.testing
ROOT = Path(__file__).resolve().parents[2]
src = (ROOT / "train_gpt.py").read_text()
WAIT = '''        while tl.atomic_add(arrived + band, 0, sem="acquire", scope="gpu") < chunks:
            pass
'''
SUMS = '        tl.atomic_add(sums + rows, tl.sum(e, axis=1), mask=rmask, sem="relaxed", scope="gpu")\n'
ARRIVE = '        tl.atomic_add(arrived + band, 1, sem="release", scope="gpu")\n'
OWN = '''        target = tl.load(targets + rows, mask=rmask, other=-1)
        owned = rmask & (target >= chunk * BLOCK_V) & (target < chunk * BLOCK_V + BLOCK_V)
        x_t = tl.load(logits + rows.to(tl.int64) * V + target, mask=owned, other=0.0).to(tl.float32)
        s_t = _softcap_sigmoid(x_t, WIDTH, True, PTX_TANH)
        tl.store(target_terms + rows, (CAP / WIDTH) * s_t * (1.0 - s_t), mask=owned)
        tl.store(target_terms + T + rows, CAP * _softcap_sigmoid(x_t, WIDTH, False, PTX_TANH), mask=owned)
'''
for x in (WAIT, SUMS, ARRIVE, OWN):
    assert x in src, x
variants = {
    "full": src,
}
all_variants = {
    "full": src,
    "no_wait": src.replace(WAIT, ""),
    "no_wait_no_sums": src.replace(WAIT, "").replace(SUMS, "        tl.store(sums + rows, tl.sum(e, axis=1), mask=rmask)\n"),
    "no_wait_no_sums_no_owner": src.replace(WAIT, "").replace(SUMS, "        tl.store(sums + rows, tl.sum(e, axis=1), mask=rmask)\n").replace(OWN, ""),
    "no_sync_at_all": src.replace(WAIT, "").replace(SUMS, "        tl.store(sums + rows, tl.sum(e, axis=1), mask=rmask)\n").replace(OWN, "").replace(ARRIVE, "").replace("        tl.debug_barrier()  # every thread's writes before the arrival that publishes them\n", ""),
    "spread_counters": src.replace("arrived + band", "arrived + band * 32").replace("sync = torch.zeros(bands * (1 + block_t)", "sync = torch.zeros(bands * (32 + block_t)").replace("sync[bands:].view(torch.float32), sync[:bands]", "sync[32 * bands:].view(torch.float32), sync[:32 * bands]"),
}
T, V = 49152, 50304
torch.manual_seed(0)
logits = (torch.randn(T, V, device="cuda") * 1.4).bfloat16()
targets = torch.randint(0, V, (T,), device="cuda")
lse, pt = torch.empty(T, device="cuda"), torch.empty(T, device="cuda")
q, qt = torch.empty((T, V), dtype=torch.uint8, device="cuda"), torch.empty((V, T), dtype=torch.uint8, device="cuda")
out = {}
variants = {k: all_variants[k] for k in os.environ.get('VARIANTS', 'full').split(',')}
CONFIGS = eval(os.environ.get('CONFIGS', '[((32, 128, 4), 1, False)]'))
for name, text in variants.items():
    d = Path(f"/tmp/abl_{name}"); d.mkdir(exist_ok=True); (d / "train_gpt.py").write_text(text.replace("speedrun::", f"speedrun_{name}::").replace("torch.ops.speedrun.", f"torch.ops.speedrun_{name}."))
    spec = importlib.util.spec_from_file_location(f"tg_{name}", d / "train_gpt.py")
    m = importlib.util.module_from_spec(spec); sys.modules[f"tg_{name}"] = m; spec.loader.exec_module(m)
    for tile, ahead, rec in CONFIGS:
        m.CE_ONE_READ_TILE, m.CE_ONE_READ_AHEAD, m.CE_ONE_READ_RECOMPUTE = tile, ahead, rec
        key = f"{name} {tile} ahead={ahead} rec={rec}"
        try:
            run = lambda: m.launch_softcap_ce_one_read(logits, targets, lse, pt, q, qt, m.FP8_GRAD_SCALE)
            run(); torch.cuda.synchronize()
            out[key] = triton.testing.do_bench(run, warmup=10, rep=100, return_mode="median")
        except Exception as e:
            out[key] = f"{type(e).__name__}: {e}"[:300]
        print(key, out[key], flush=True)
Path(sys.argv[1]).write_text(json.dumps(out, indent=1))
