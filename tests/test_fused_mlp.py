"""The MLP with ReLU² in the GEMM epilogues (relu2_mlp): the Triton kernel in the interpreter against float64,
the autograd function against the unfused MLP, and its compiled graph against eager."""
import pytest
import torch

import train_gpt as tg
from interpreter import run_in_triton_interpreter

KERNEL_SCRIPT = r"""
import json, torch, train_gpt as tg
assert tg._TRITON_INTERPRET
g = torch.Generator().manual_seed(0)
rows = []
SMALL = (16, 32, 16, 2, 1, 1)
for dtype in (torch.float32, torch.float16):
    # (M, N, K, config): ragged M and N against the blocks, and the default (GPU) tile on a K of 64
    for M, N, K, cfg in ((37, 70, 48, SMALL), (64, 96, 32, SMALL), (130, 300, 64, None)):
        x = torch.randn(M, K, generator=g, dtype=torch.float64).to(dtype)
        w = (torch.randn(N, K, generator=g, dtype=torch.float64) / K ** 0.5).to(dtype)
        gout = torch.randn(M, K, generator=g, dtype=torch.float64).to(dtype)
        wp = (torch.randn(N, K, generator=g, dtype=torch.float64) / K ** 0.5).to(dtype)
        pre_ref = x.double() @ w.double().T
        big = torch.full((M + 3, N + 5), float("nan"), dtype=dtype)   # strided outputs in a NaN buffer
        pre, h = big[:M, :N], torch.full((M, N), float("nan"), dtype=dtype)
        tg.launch_linear_relu2(x, w, pre, h, backward=False, config=cfg)
        # the epilogue squares the *rounded* pre: compare h with the float64 square of the kernel's own pre
        h_ref = pre.double().clamp_min(0) ** 2
        h2 = torch.full((M, N), float("nan"), dtype=dtype)
        tg.launch_linear_relu2(x, w, h2, h2, backward=False, store_pre=False, config=cfg)
        pre_c = pre.contiguous()
        grad = torch.full((M, N), float("nan"), dtype=dtype)
        tg.launch_linear_relu2(gout, wp, pre_c, grad, backward=True, config=cfg)
        gh = (gout.double() @ wp.double().T).to(dtype).double()     # the GEMM result, rounded, then the epilogue
        grad_ref = gh * 2 * pre_c.double().clamp_min(0)
        def err(a, b):
            return ((a.double() - b).abs().max() / b.abs().max()).item()
        rows.append(dict(dtype=str(dtype), shape=[M, N, K], cfg=str(cfg), pre_err=err(pre, pre_ref),
                         h_err=err(h, h_ref), h_no_pre_equal=bool(torch.equal(h2, h)), grad_err=err(grad, grad_ref),
                         nan=int(torch.isnan(big[:M, :N]).sum() + torch.isnan(h).sum() + torch.isnan(grad).sum()),
                         outside=int((~torch.isnan(big[M:])).sum() + (~torch.isnan(big[:M, N:])).sum())))
# the autograd function end to end through the kernels (fp32) vs the unfused MLP in float64
x = torch.randn(45, 64, generator=g).requires_grad_()
w_fc = (torch.randn(96, 64, generator=g) / 8).requires_grad_()
w_proj = (torch.randn(96, 64, generator=g) / 8).requires_grad_()
out = tg.relu2_mlp(x, w_fc, w_proj)
gout = torch.randn(45, 64, generator=g)
grads = torch.autograd.grad(out, (x, w_fc, w_proj), gout)
xd, wd, pd = (t.detach().double().requires_grad_() for t in (x, w_fc, w_proj))
ref = torch.relu(xd @ wd.T).square() @ pd
ref_grads = torch.autograd.grad(ref, (xd, wd, pd), gout.double())
rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
rows.append(dict(autograd=True, out_err=rel(out, ref), grad_errs=[rel(a, b) for a, b in zip(grads, ref_grads)]))
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def kernel_rows():
    return run_in_triton_interpreter(KERNEL_SCRIPT)


def test_linear_relu2_kernel_matches_float64_forward_and_backward(kernel_rows):
    rows = [r for r in kernel_rows if "dtype" in r]
    assert len(rows) == 6
    for r in rows:
        tol = 2e-6 if r["dtype"] == "torch.float32" else 1.5e-3  # fp16: one rounding of the output (2^-11)
        assert r["nan"] == 0 and r["outside"] == 0, r
        assert r["pre_err"] < tol and r["h_err"] < tol and r["grad_err"] < tol, r
        assert r["h_no_pre_equal"], r  # eval mode (pre not stored) computes the same h


def test_relu2_mlp_autograd_through_the_kernel_matches_float64(kernel_rows):
    (r,) = [r for r in kernel_rows if r.get("autograd")]
    assert r["out_err"] < 1e-5 and max(r["grad_errs"]) < 1e-5, r


def _mlp_inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(40, 32, generator=g).to(dtype).requires_grad_()
    w_fc = (torch.randn(128, 32, generator=g) / 6).to(dtype).requires_grad_()
    w_proj = (torch.randn(128, 32, generator=g) / 6).to(dtype).requires_grad_()
    return x, w_fc, w_proj


def test_relu2_mlp_equals_the_unfused_mlp_and_its_gradients():
    x, w_fc, w_proj = _mlp_inputs()
    gout = torch.randn(40, 32, generator=torch.Generator().manual_seed(1))
    fused = tg.relu2_mlp(x, w_fc, w_proj)
    fused_grads = torch.autograd.grad(fused, (x, w_fc, w_proj), gout)
    unfused = torch.relu(torch.nn.functional.linear(x, w_fc)).square() @ w_proj
    unfused_grads = torch.autograd.grad(unfused, (x, w_fc, w_proj), gout)
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-6)
    for a, b in zip(fused_grads, unfused_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_relu2_mlp_without_grad_skips_storing_pre_and_gives_the_same_output():
    x, w_fc, w_proj = _mlp_inputs()
    with torch.no_grad():
        out = tg.relu2_mlp(x, w_fc, w_proj)
    pre, h = tg.linear_relu2(x.detach(), w_fc.detach(), False)
    assert pre.numel() == 0
    torch.testing.assert_close(out, tg.relu2_mlp(x, w_fc, w_proj).detach())


def test_relu2_mlp_compiled_equals_eager():
    """The custom ops' fakes and the autograd function trace under torch.compile(fullgraph=True)."""
    x, w_fc, w_proj = _mlp_inputs(seed=3)
    gout = torch.randn(40, 32, generator=torch.Generator().manual_seed(4))
    eager = tg.relu2_mlp(x, w_fc, w_proj)
    eager_grads = torch.autograd.grad(eager, (x, w_fc, w_proj), gout)
    compiled_fn = torch.compile(tg.relu2_mlp, fullgraph=True, dynamic=False)
    out = compiled_fn(x, w_fc, w_proj)
    grads = torch.autograd.grad(out, (x, w_fc, w_proj), gout)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_relu2_is_opt_in_and_used_only_on_gpus():
    """Off by default (slower than cuBLAS + Inductor on an H100); when asked for, CPU runs still keep Inductor's
    kernels (the CPU path of the op is plain torch)."""
    assert tg.Hyperparameters().fused_relu2 is False
    args = tg.Hyperparameters(fused_relu2=True)
    model, _, _ = tg.build_model_and_optimizers(args, "cpu", 1, "reference", use_compile=False, use_fp8=False)
    assert all(b.mlp.fused_relu2 is False for b in model.blocks if b.mlp is not None)
    assert tg.MLP(16).fused_relu2 is False
