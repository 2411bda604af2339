"""The Polar Express Triton kernels (xxt, ba_plus_cAA, ax_plus_bx), run for real in the Triton interpreter on CPU.

TRITON_INTERPRET=1 must be set before triton is imported, and other tests import triton without it, so the kernels
run in one subprocess (launched once per module) that prints its measurements as JSON; the asserts live here.
The interpreter is exact for float32/float16 but not bfloat16, so the kernels are checked in fp32 and fp16 against
float64 torch matmuls, on sizes that are not multiples of the blocks, strided/transposed/2-D/broadcast layouts, and
with NaN-poisoned outputs embedded in larger NaN buffers (every element written, nothing outside it).
"""
import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

from processes import run_group

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(r"""
    import json, os
    assert os.environ.get("TRITON_INTERPRET") == "1"
    import torch
    import train_gpt as tg
    assert tg.triton is not None and tg._TRITON_INTERPRET

    g = torch.Generator().manual_seed(0)
    SMALL = {"xxt": dict(BLOCK_M=16, BLOCK_K=16, num_warps=1, num_stages=1),
             "ba_plus_cAA": dict(BLOCK_M=16, BLOCK_K=16, num_warps=1, num_stages=1),
             "ax_plus_bx": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, num_warps=1, num_stages=1)}
    results = []
    rule_config = tg.kernel_config

    def tiles_over_the_rule(tiles):
        # kernel_config with `tiles` laid over the rule's choice per kind (symmetric kernels keep BLOCK_N = BLOCK_M);
        # the launchers look kernel_config up in train_gpt's namespace at every call
        def config(kind, n, m, k, dtype):
            cfg = dict(rule_config(kind, n, m, k, dtype), **tiles.get(kind, {}))
            if kind != "ax_plus_bx":
                cfg["BLOCK_N"] = cfg["BLOCK_M"]
            return cfg
        return config

    def poisoned(shape, dtype, pad=(3, 5)):
        # output view inside a larger NaN buffer: strided, and anything written out of bounds stays visible
        big = torch.full((*shape[:-2], shape[-2] + pad[0], shape[-1] + pad[1]), float("nan"), dtype=dtype)
        return big, big[..., : shape[-2], : shape[-1]]

    def record(name, dtype, out, ref, big=None):
        out64 = out.double()
        scale = ref.abs().max().item()
        outside = 0
        if big is not None:
            inside = torch.zeros(big.shape, dtype=torch.bool)
            inside[..., : out.shape[-2], : out.shape[-1]] = True
            outside = int((~torch.isnan(big[~inside])).sum())
        results.append(dict(name=name, dtype=str(dtype), nan=int(torch.isnan(out64).sum()), outside=outside,
                            err=(out64 - ref).abs().max().item() / scale, shape=list(out.shape)))

    def rnd(*shape, dtype):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    for dtype in (torch.float32, torch.float16):
        # small tiles (many blocks, ragged last ones) in fp32 only: the masks and the block walk do not depend on the
        # dtype, which the rule's tiles check in both (their last blocks are ragged too), at a fifth of the time
        for cfg_name, tiles in (("small", SMALL), ("rule", {})) if dtype == torch.float32 else (("rule", {}),):
            tg.kernel_config = tiles_over_the_rule(tiles)
            assert tg.kernel_config("ax_plus_bx", 2, 37, 70, dtype)["BLOCK_N"] == (32 if tiles else 64)
            # ---- xxt: batched, transposed view, 2-D, block-aligned (EVEN path) ----
            cases = {"b2_37x70": rnd(2, 37, 70, dtype=dtype), "mT_37x70": rnd(2, 70, 37, dtype=dtype).mT,
                     "2d_37x70": rnd(37, 70, dtype=dtype), "even_32x64": rnd(2, 32, 64, dtype=dtype)}
            for cname, X in cases.items():
                big, out = poisoned((*X.shape[:-1], X.shape[-2]), dtype)
                r = tg.xxt(X, out=out)
                assert r.data_ptr() == out.data_ptr()
                X64 = X.double()
                record(f"xxt/{cfg_name}/{cname}", dtype, out, X64 @ X64.mT, big)
            X = cases["b2_37x70"]
            record(f"xxt/{cfg_name}/alloc", dtype, tg.xxt(X), X.double() @ X.double().mT)

            # ---- ba_plus_cAA on symmetric A (Gram / k, like the iteration's A) ----
            for cname, X in cases.items():
                A = (X.double() @ X.double().mT / X.shape[-1]).to(dtype)
                A64 = A.double()
                for b, c in ((-2.808917465908714, 0.5000178451051316), (1.5, -0.25)):
                    big, out = poisoned(A.shape, dtype)
                    tg.ba_plus_cAA(A, b, c, out=out)
                    record(f"ba_plus_cAA/{cfg_name}/{cname}/b={b:.2f}", dtype, out, b * A64 + c * A64 @ A64, big)
            A = (X.double() @ X.double().mT / 70).to(dtype)
            record(f"ba_plus_cAA/{cfg_name}/alloc", dtype, tg.ba_plus_cAA(A, 2.0, -1.0),
                   2.0 * A.double() - A.double() @ A.double())

            # ---- ax_plus_bx: per-matrix B, broadcast B (stride 0), 2-D B with 3-D X, transposed X, 2-D ----
            for cname, X in cases.items():
                m = X.shape[-2]
                Bfull = rnd(*X.shape[:-2], m, m, dtype=torch.float64)
                Bfull = ((Bfull + Bfull.mT) / (2 * m ** 0.5)).to(dtype)
                Bs = {"perB": Bfull}
                if X.dim() == 3:
                    Bs["bcast1"] = Bfull[:1]
                    Bs["B2d"] = Bfull[0]
                for bname, B in Bs.items():
                    big, out = poisoned(X.shape, dtype)
                    tg.ax_plus_bx(X, B, 4.042929935166739, out=out)
                    ref = 4.042929935166739 * X.double() + B.double() @ X.double()
                    record(f"ax_plus_bx/{cfg_name}/{cname}/{bname}", dtype, out, ref, big)
            X = cases["b2_37x70"]
            B = (X.double() @ X.double().mT / 70).to(dtype)
            record(f"ax_plus_bx/{cfg_name}/alloc", dtype, tg.ax_plus_bx(X, B, -0.5),
                   -0.5 * X.double() + B.double() @ X.double())

    # ---- the full iteration through the kernels (buffers, X/C swapping, turbo's fused first step) ----
    # with the tiles the rule picks: the small tiles' many blocks and ragged edges are checked kernel by kernel
    # above, and in the interpreter they cost 7x the time here
    tg.kernel_config = rule_config
    for turbo in (False, True):
        for cname, G in (("wide_b2_40x72", rnd(2, 40, 72, dtype=torch.float32)),
                         ("tall_b2_72x40", rnd(2, 72, 40, dtype=torch.float32)),
                         ("2d_33x50", rnd(33, 50, dtype=torch.float32))):
            out = tg._polar_loop(G, turbo, torch.float32, tg._TRITON_OPS, buffers=True)
            ref = tg._polar_loop(G.double(), turbo, torch.float64, tg._TORCH_OPS, buffers=False)
            record(f"polar_loop/turbo={int(turbo)}/{cname}", torch.float32, out, ref)
            assert list(out.shape) == list(G.shape)
    print("RESULTS=" + json.dumps(results))
""")

# Tolerances on max|out - ref| / max|ref| (ref in float64), measured with the triton 3.9 interpreter (maxima over
# all cases): fp32 xxt 2.2e-7, ba_plus_cAA 4.2e-7, ax_plus_bx 2.7e-7; fp16 3.5e-4 / 3.8e-4 / 3.5e-4 (one rounding
# of the output to fp16: 2^-11 = 4.9e-4 relative); full 5-iteration loop in fp32 vs float64 torch 3.8e-6 (with the
# rule's tiles; 1.9e-6 with the small ones).
TOL = {"torch.float32": 2e-6, "torch.float16": 1.5e-3}
TOL_LOOP = 2e-5


@pytest.fixture(scope="module")
def kernel_results():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    proc = run_group([sys.executable, "-c", SCRIPT], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS=")][-1]
    return json.loads(line[len("RESULTS="):])


def _check(rows, tol_for):
    assert rows
    bad = [r for r in rows if r["nan"] or r["outside"] or not r["err"] <= tol_for(r)]
    assert not bad, "\n".join(map(str, bad))


@pytest.mark.parametrize("kernel", ["xxt", "ba_plus_cAA", "ax_plus_bx"])
def test_kernel_matches_float64(kernel_results, kernel):
    rows = [r for r in kernel_results if r["name"].startswith(kernel + "/")]
    # (fp32 x 2 config sets + fp16 x the rule's) x (4 layouts [+ b values / B variants] + 1 allocating call)
    assert len(rows) >= 15
    assert {(r["dtype"], r["name"].split("/")[1]) for r in rows} == {
        ("torch.float32", "small"), ("torch.float32", "rule"), ("torch.float16", "rule")}
    _check(rows, lambda r: TOL[r["dtype"]])


def test_polar_loop_through_kernels(kernel_results):
    rows = [r for r in kernel_results if r["name"].startswith("polar_loop/")]
    assert len(rows) == 6
    _check(rows, lambda r: TOL_LOOP)
