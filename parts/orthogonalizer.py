# ---- Polar Express / Turbo-Muon orthogonalization (SPEC §6.2, §6.4) ----------------------------------------
# TEMPORARY: exec'd into train_gpt.py's globals (uses math, torch, Tensor, triton, tl); inlined later.
#
# polar_express(G) maps each matrix of a batch G (..., rows, cols) to an approximation of its polar factor U Vᵀ
# (G = U Σ Vᵀ) with a fixed odd-polynomial iteration.  On CUDA it runs in bf16 through three Triton kernels that
# exploit symmetry; everywhere else (CPU, tiny matrices, no triton) the same loop runs on torch matmuls.
#
#   iteration:   A = X Xᵀ            ns_line_1  xxt          (symmetric: lower tiles only, mirrored)
#                B = b·A + c·A·A     ns_line_2  ba_plus_cAA  (A symmetric, so A·A = A·Aᵀ: same scheme)
#                X ← a·X + B·X       ns_line_3  ax_plus_bx   (accumulator starts at a·X; no baddbmm copy)
#
# Checked once on an H100 (torch 2.11, triton 3.6): kernels match float64 to bf16 rounding (rel. 1.4e-3..2.0e-3)
# on contiguous, transposed, 2-D, broadcast-B and ragged shapes; torch.compile(fullgraph=True) captures the kernel
# launches (first compile 4-13 s per shape).  GPU time per call (CUDA graph), kernels vs torch matmuls, polar/turbo:
# (8,768,768) 280/229 vs 305/247 us; (40,768,768) 1170/971 vs 1519/1244; (22,3072,768) 1889/1457 vs 2361/1845.
# Tile configs are NOT autotuned (the record's 36-config autotune per shape cost minutes of cold start): a small
# deterministic rule, kernel_config(), picks them from the shape and dtype; KERNEL_CONFIGS overrides it.
import os as _os

POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
# Turbo-Muon drops the first tuple: AOL preconditioning does its job ([T155a]); 4 iterations in all.
TURBO_MUON_COEFFS = POLAR_EXPRESS_COEFFS[1:]
POLAR_NORM_SAFETY = 1.02     # X / (‖X‖_F·1.02 + 1e-6): spectral norm < 1 with a 2 % margin
POLAR_NORM_EPS = 1e-6
TURBO_AOL_SAFETY = 1.02      # s = rsqrt(rowsum|XXᵀ|·1.02 + 1e-6)   ([T155a] variant)
TURBO_AOL_EPS = 1e-6

ORTHO_USE_TRITON = True      # False: CUDA tensors use the torch-matmul loop too (debugging / A-B timing)
KERNEL_MIN_DIM = 64          # matrices with fewer rows (wide orientation) use torch matmuls: the gates
                             # (6x12, 1x12) are pure launch latency, cuBLAS/inductor handle them as well
_TRITON_INTERPRET = _os.environ.get("TRITON_INTERPRET") == "1"

# Tile configurations.  kernel_config(kind, n, m, k, dtype) returns dict(BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
# num_stages) for kind in {"xxt", "ba_plus_cAA", "ax_plus_bx"}, where the operation is
#   xxt:          (n, m, k) -> (n, m, m), reduction over k        ba_plus_cAA: (n, m, m) -> (n, m, m), k = m
#   ax_plus_bx:   (n, m, m) x (n, m, k) -> (n, m, k), reduction over m
# Overrides (e.g. from a benchmark): KERNEL_CONFIGS[(kind, m, k)] = {...} or KERNEL_CONFIGS[kind] = {...};
# missing keys fall back to the rule.  Symmetric kernels need BLOCK_M == BLOCK_N (the rule enforces it).
KERNEL_CONFIGS = {}
_SMEM_BUDGET = 160 * 1024    # H100/H200 have 227 KB per block; keep room for the epilogue's layout conversion


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def kernel_config(kind: str, n: int, m: int, k: int, dtype) -> dict:
    """Deterministic tile choice (no autotune), from a one-off sweep on an H100 (bf16, CUDA-graph timings of 7
    candidate configs per kernel on the trainer's shapes (8|40, 768, 768) and (2|6|22, 768, 3072)):
    - 128x128 output tiles, BLOCK_K 64, 8 warps were best or within ~5 % of best for all three kernels on every
      shape; 64x64 tiles were 10-60 % slower even when 128-tiles left SMs idle (e.g. 2 x 21 tiles for xxt).
    - stages: xxt / ba_plus_cAA 4 (3 was mixed: once 40 % slower), ax_plus_bx 3 (5-10 % faster than 4 on every
      shape).  Shared memory: 4 x (128 + 128) x 64 x 2 B = 128 KB, under the 227 KB per block of Hopper.
    - smaller matrices get 64 or the smallest tile tl.dot allows (16); stages shrink until the pipelined operand
      tiles fit _SMEM_BUDGET (fp32 operands are twice as large).  n is accepted for overrides/future rules."""
    elsize = torch.empty((), dtype=dtype).element_size()
    sym = kind in ("xxt", "ba_plus_cAA")
    if kind == "ba_plus_cAA":
        k = m
    out_rows, out_cols, red = (m, m, k) if sym else (m, k, m)
    if min(out_rows, out_cols) >= 128:
        bm = bn = 128
    elif min(out_rows, out_cols) >= 64:
        bm = bn = 64
    else:
        bm = min(64, max(16, _pow2_at_least(out_rows)))
        bn = bm if sym else min(64, max(16, _pow2_at_least(out_cols)))
    bk = min(64, max(16, _pow2_at_least(red)))
    warps = 8 if bm * bn >= 128 * 128 else 4
    stages = 4 if sym else 3
    while stages > 1 and stages * (bm + bn) * bk * elsize > _SMEM_BUDGET:
        stages -= 1
    cfg = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    cfg.update(KERNEL_CONFIGS.get(kind, {}))
    cfg.update(KERNEL_CONFIGS.get((kind, m, k), {}))
    if sym:
        cfg["BLOCK_N"] = cfg["BLOCK_M"]
    return cfg


if triton is not None:

    @triton.jit
    def _xxt_kernel(X, C, M, K,
                    s_xb, s_xm, s_xk, s_cb, s_cm, s_cn,
                    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN: tl.constexpr, IEEE: tl.constexpr):
        # C[b] = X[b] X[b]ᵀ; program (pid, b) owns output tile (i, j) = divmod(pid, T); only j <= i is computed,
        # stored at (i, j) and transposed at (j, i).  fp32 accumulation, result cast to C's dtype.
        pid = tl.program_id(0)
        bid = tl.program_id(1).to(tl.int64)
        T = tl.cdiv(M, BLOCK_M)
        ti = pid // T
        tj = pid % T
        if tj > ti:
            return
        X += bid * s_xb
        C += bid * s_cb
        rows = ti * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tj * BLOCK_M + tl.arange(0, BLOCK_M)
        offk = tl.arange(0, BLOCK_K)
        a_ptr = X + rows[:, None] * s_xm + offk[None, :] * s_xk        # (BM, BK) rows of tile i
        b_ptr = X + cols[None, :] * s_xm + offk[:, None] * s_xk        # (BK, BM) rows of tile j, transposed
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN:
                a = tl.load(a_ptr)
                b = tl.load(b_ptr)
            else:
                kk = k0 + offk
                a = tl.load(a_ptr, mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
                b = tl.load(b_ptr, mask=(cols[None, :] < M) & (kk[:, None] < K), other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptr += BLOCK_K * s_xk
            b_ptr += BLOCK_K * s_xk
        out = acc.to(C.dtype.element_ty)
        mask = (rows[:, None] < M) & (cols[None, :] < M)
        tl.store(C + rows[:, None] * s_cm + cols[None, :] * s_cn, out, mask=mask)
        if tj < ti:
            tl.store(C + cols[:, None] * s_cm + rows[None, :] * s_cn, tl.trans(out),
                     mask=(cols[:, None] < M) & (rows[None, :] < M))

    @triton.jit
    def _ba_plus_caa_kernel(A, C, M, beta, alpha,
                            s_ab, s_am, s_an, s_cb, s_cm, s_cn,
                            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                            EVEN: tl.constexpr, IEEE: tl.constexpr):
        # C[b] = beta·A[b] + alpha·A[b]A[b] for symmetric A: A·A = A·Aᵀ, so the xxt tiling applies and the result
        # is symmetric; the A tile (i, j) is loaded once per computed tile and added in fp32 before the cast.
        pid = tl.program_id(0)
        bid = tl.program_id(1).to(tl.int64)
        T = tl.cdiv(M, BLOCK_M)
        ti = pid // T
        tj = pid % T
        if tj > ti:
            return
        A += bid * s_ab
        C += bid * s_cb
        rows = ti * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tj * BLOCK_M + tl.arange(0, BLOCK_M)
        offk = tl.arange(0, BLOCK_K)
        a_ptr = A + rows[:, None] * s_am + offk[None, :] * s_an
        b_ptr = A + cols[None, :] * s_am + offk[:, None] * s_an
        acc = tl.zeros((BLOCK_M, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, M, BLOCK_K):
            if EVEN:
                a = tl.load(a_ptr)
                b = tl.load(b_ptr)
            else:
                kk = k0 + offk
                a = tl.load(a_ptr, mask=(rows[:, None] < M) & (kk[None, :] < M), other=0.0)
                b = tl.load(b_ptr, mask=(cols[None, :] < M) & (kk[:, None] < M), other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptr += BLOCK_K * s_an
            b_ptr += BLOCK_K * s_an
        mask = (rows[:, None] < M) & (cols[None, :] < M)
        a_tile = tl.load(A + rows[:, None] * s_am + cols[None, :] * s_an, mask=mask, other=0.0)
        out = tl.cast(alpha, tl.float32) * acc + tl.cast(beta, tl.float32) * a_tile.to(tl.float32)   # fp64 under inductor
        out = out.to(C.dtype.element_ty)
        tl.store(C + rows[:, None] * s_cm + cols[None, :] * s_cn, out, mask=mask)
        if tj < ti:
            tl.store(C + cols[:, None] * s_cm + rows[None, :] * s_cn, tl.trans(out),
                     mask=(cols[:, None] < M) & (rows[None, :] < M))

    @triton.jit
    def _ax_plus_bx_kernel(X, B, C, M, K, alpha,
                           s_xb, s_xm, s_xk, s_bb, s_bm, s_bn, s_cb, s_cm, s_ck,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                           EVEN: tl.constexpr, IEEE: tl.constexpr):
        # C[b] = alpha·X[b] + B[b] X[b] with X (M, K), B (M, M) (s_bb == 0 broadcasts one B over the batch).
        # ns_line_3: the fp32 accumulator starts at alpha·X and B·X accumulates into it.  Every load is masked on
        # its rows/cols AND its reduction index (the [T155b] fix) unless EVEN says all blocks are in bounds.
        pid = tl.program_id(0)
        bid = tl.program_id(1).to(tl.int64)
        tn = tl.cdiv(K, BLOCK_N)
        ti = pid // tn
        tj = pid % tn
        X += bid * s_xb
        B += bid * s_bb
        C += bid * s_cb
        rows = ti * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tj * BLOCK_N + tl.arange(0, BLOCK_N)
        offk = tl.arange(0, BLOCK_K)
        out_mask = (rows[:, None] < M) & (cols[None, :] < K)
        if EVEN:
            x0 = tl.load(X + rows[:, None] * s_xm + cols[None, :] * s_xk)
        else:
            x0 = tl.load(X + rows[:, None] * s_xm + cols[None, :] * s_xk, mask=out_mask, other=0.0)
        acc = x0.to(tl.float32) * tl.cast(alpha, tl.float32)   # inductor passes Python floats as fp64
        b_ptr = B + rows[:, None] * s_bm + offk[None, :] * s_bn        # (BM, BK)
        x_ptr = X + offk[:, None] * s_xm + cols[None, :] * s_xk        # (BK, BN)
        for k0 in range(0, M, BLOCK_K):
            if EVEN:
                b = tl.load(b_ptr)
                x = tl.load(x_ptr)
            else:
                kk = k0 + offk
                b = tl.load(b_ptr, mask=(rows[:, None] < M) & (kk[None, :] < M), other=0.0)
                x = tl.load(x_ptr, mask=(kk[:, None] < M) & (cols[None, :] < K), other=0.0)
            if IEEE:
                acc = tl.dot(b, x, acc, input_precision="ieee")
            else:
                acc = tl.dot(b, x, acc)
            b_ptr += BLOCK_K * s_bn
            x_ptr += BLOCK_K * s_xm
        tl.store(C + rows[:, None] * s_cm + cols[None, :] * s_ck, acc.to(C.dtype.element_ty), mask=out_mask)


def _kernels_usable(t: Tensor) -> bool:
    """Triton kernels run on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (tests)."""
    return triton is not None and (t.is_cuda or _TRITON_INTERPRET)


def _as_batched(t: Tensor) -> Tensor:
    return t if t.dim() == 3 else t.unsqueeze(0)


def xxt(X: Tensor, out: Tensor = None) -> Tensor:
    """out = X Xᵀ for X (m, k) or (n, m, k) -> (m, m) / (n, m, m), in X's dtype (fp32 accumulation)."""
    if out is None:
        out = X.new_empty(*X.shape[:-1], X.size(-2))
    if not _kernels_usable(X):
        return torch.matmul(X, X.mT, out=out)
    X3, C3 = _as_batched(X), _as_batched(out)
    n, m, k = X3.shape
    cfg = kernel_config("xxt", n, m, k, X.dtype)
    bm, bk = cfg["BLOCK_M"], cfg["BLOCK_K"]
    t = triton.cdiv(m, bm)
    _xxt_kernel[(t * t, n)](
        X3, C3, m, k, X3.stride(0), X3.stride(1), X3.stride(2), C3.stride(0), C3.stride(1), C3.stride(2),
        BLOCK_M=bm, BLOCK_K=bk, EVEN=(m % bm == 0 and k % bk == 0), IEEE=(X.dtype == torch.float32),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def ba_plus_cAA(A: Tensor, b: float, c: float, out: Tensor = None) -> Tensor:
    """out = b·A + c·A·A for symmetric A (m, m) or (n, m, m) (symmetry is assumed, not checked)."""
    if out is None:
        out = torch.empty_like(A)
    if not _kernels_usable(A):
        return torch.add(torch.mul(A, b), torch.matmul(A, A), alpha=c, out=out)
    A3, C3 = _as_batched(A), _as_batched(out)
    n, m, _ = A3.shape
    cfg = kernel_config("ba_plus_cAA", n, m, m, A.dtype)
    bm, bk = cfg["BLOCK_M"], cfg["BLOCK_K"]
    t = triton.cdiv(m, bm)
    _ba_plus_caa_kernel[(t * t, n)](
        A3, C3, m, float(b), float(c),
        A3.stride(0), A3.stride(1), A3.stride(2), C3.stride(0), C3.stride(1), C3.stride(2),
        BLOCK_M=bm, BLOCK_K=bk, EVEN=(m % bm == 0 and m % bk == 0), IEEE=(A.dtype == torch.float32),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def ax_plus_bx(X: Tensor, B: Tensor, a: float, out: Tensor = None) -> Tensor:
    """out = a·X + B X for X (m, k) / (n, m, k) and B (m, m) / (n or 1, m, m); out must not alias X."""
    if out is None:
        out = torch.empty_like(X)
    if not _kernels_usable(X):
        if X.dim() == 3 and B.shape == (X.size(0), X.size(1), X.size(1)):
            return torch.baddbmm(X, B, X, beta=a, out=out)
        return torch.add(torch.matmul(B, X), X, alpha=a, out=out)
    X3, C3 = _as_batched(X), _as_batched(out)
    B3 = _as_batched(B)
    n, m, k = X3.shape
    cfg = kernel_config("ax_plus_bx", n, m, k, X.dtype)
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    s_bb = 0 if B3.size(0) == 1 else B3.stride(0)
    _ax_plus_bx_kernel[(triton.cdiv(m, bm) * triton.cdiv(k, bn), n)](
        X3, B3, C3, m, k, float(a),
        X3.stride(0), X3.stride(1), X3.stride(2), s_bb, B3.stride(1), B3.stride(2),
        C3.stride(0), C3.stride(1), C3.stride(2),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, EVEN=(m % bm == 0 and k % bn == 0 and m % bk == 0),
        IEEE=(X.dtype == torch.float32), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


# ---- the iteration, parametrised by its three matrix operations ----

def _torch_gram(X, out=None):
    return X @ X.mT


def _torch_poly(A, b, c, out=None):
    return b * A + c * (A @ A)


def _torch_update(X, B, a, out=None):
    return a * X + B @ X


_TORCH_OPS = (_torch_gram, _torch_poly, _torch_update)
_TRITON_OPS = (xxt, ba_plus_cAA, ax_plus_bx)


def _polar_loop(G: Tensor, turbo: bool, dtype, ops, buffers: bool) -> Tensor:
    """Shared body of polar_express / polar_express_reference.  G (..., rows, cols) -> same shape, dtype `dtype`.
    ops = (gram(X, out), poly(A, b, c, out), update(X, B, a, out)); with buffers=True A, B and C are allocated
    once and X/C swap roles between iterations (the Triton ops write into `out`; the torch ops ignore it)."""
    gram, poly, update = ops
    transposed = G.size(-2) > G.size(-1)
    X = G.mT if transposed else G                     # wide orientation: rows <= cols, A is the small Gram
    X = X.to(dtype).contiguous()
    m = X.size(-2)
    acc = torch.promote_types(dtype, torch.float32)   # scalings in fp32 (fp64 for a float64 reference)
    A = X.new_empty(*X.shape[:-1], m) if buffers else None
    B = torch.empty_like(A) if buffers else None
    if turbo:
        # AOL preconditioning fused into iteration 1 (§6.4): one Gram of the raw X serves both the row scaling
        # s = rsqrt(rowsum|A|·1.02 + eps) (‖diag(s)X‖₂ <= 1 by Gershgorin) and A₁ = diag(s) A diag(s) = X₁X₁ᵀ.
        A = gram(X, A)
        s = torch.rsqrt(A.to(acc).abs().sum(dim=-1, keepdim=True) * TURBO_AOL_SAFETY + TURBO_AOL_EPS)
        X = (X.to(acc) * s).to(dtype)
        A = (A.to(acc) * s * s.mT).to(dtype)
        coeffs = TURBO_MUON_COEFFS
    else:
        norm = torch.linalg.vector_norm(X.to(acc), dim=(-2, -1), keepdim=True)
        X = (X.to(acc) / (norm * POLAR_NORM_SAFETY + POLAR_NORM_EPS)).to(dtype)
        coeffs = POLAR_EXPRESS_COEFFS
    C = torch.empty_like(X) if buffers else None
    for i, (a, b, c) in enumerate(coeffs):
        if i > 0 or not turbo:                        # turbo's first Gram was computed above
            A = gram(X, A)
        B = poly(A, b, c, B)
        C = update(X, B, a, C)
        X, C = C, X
    return X.mT if transposed else X


def polar_express_reference(G: Tensor, turbo: bool = False, dtype=torch.float32) -> Tensor:
    """Pure-PyTorch Polar Express / Turbo-Muon in `dtype` (float32 or float64): tests and the CPU path."""
    return _polar_loop(G, turbo, dtype, _TORCH_OPS, buffers=False)


def polar_express(G: Tensor, turbo: bool = False) -> Tensor:
    """Approximate polar factor of every matrix in G (..., rows, cols); same shape as G.
    CUDA: bf16, Triton kernels when the matrices are large enough (else bf16 torch matmuls).  CPU: float32.
    Turbo-Muon (turbo=True): AOL row scaling instead of Frobenius normalisation, 4 iterations instead of 5.
    No data-dependent control flow: compiles with torch.compile(dynamic=False, fullgraph=True)."""
    if not G.is_cuda:
        return polar_express_reference(G, turbo, torch.float32)
    if min(G.shape[-2:]) < KERNEL_MIN_DIM:
        # gates (6x12, 1x12): launch-bound, so fp32 costs nothing and avoids bf16 rounding of A and B (the torch
        # ops round each product to bf16, unlike the kernels' fp32 epilogues: ~8 % vs ~1 % deviation from fp32)
        return polar_express_reference(G, turbo, torch.float32).bfloat16()
    use_kernels = ORTHO_USE_TRITON and _kernels_usable(G) and G.dim() in (2, 3)
    return _polar_loop(G, turbo, torch.bfloat16, _TRITON_OPS if use_kernels else _TORCH_OPS, buffers=use_kernels)
