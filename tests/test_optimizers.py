"""NorMuon and DistAdam: math on known shapes, state handling, and sharded (gloo) runs vs one process."""
import copy
import math

import pytest
import torch
from torch import nn

import train_gpt as tg
from dist_utils import run_gloo

BETA, BETA2 = 0.95, 0.95
LRS = (0.02, 0.03, 0.025, 0.01)          # per-step lr, like a schedule (group["lr"] set by the trainer)
MOMENTA = (0.85, 0.9, 0.95, 0.95)


# ------------------------------------------------------------------ model builders (deterministic)

def _param(shape, label, name, gen, dtype=torch.float32, lr_mul=None, wd_mul=None, scale=0.05):
    p = nn.Parameter((torch.randn(shape, generator=gen) * scale).to(dtype))
    p.label, p.pname = label, name
    if lr_mul is not None:
        p.lr_mul = lr_mul
    if wd_mul is not None:
        p.wd_mul = wd_mul
    return p


def muon_params_generic(d=16, seed=0):
    """Counts that don't divide 2 or 4: 1 smear gate, 3 attn gates, 3 attn (4d x d), 5 mlp (4d x d)."""
    gen = torch.Generator().manual_seed(seed)
    ps = [_param((1, 12), "smear_gate", "smear", gen)]
    for b in range(3):
        ps.append(_param((4 * d, d), "attn", f"attn{b}", gen))
        ps.append(_param((2, 12), "attn_gate", f"gate{b}", gen, wd_mul=0.5 if b == 1 else None))
    for b in range(5):
        ps.append(_param((4 * d, d), "mlp", f"c_fc{b}" if b % 2 == 0 else f"c_proj{b}", gen,
                         lr_mul=1.0 if b % 2 == 0 else 2.0))
    return ps


def muon_params_record(d=16, heads=2, seed=0):
    """The record's NorMuon set with tiny dims, in the trainer's order: hidden matrices (blocks 1..11, block 7 has
    no attention), then smear gate and attn gates."""
    gen = torch.Generator().manual_seed(seed)
    hidden, gates = [], [_param((1, 12), "smear_gate", "smear", gen)]
    for b in range(1, 12):
        if b != 7:
            hidden.append(_param((4 * d, d), "attn", f"attn{b}", gen))
            gates.append(_param((heads, 12), "attn_gate", f"gate{b}", gen))
        hidden.append(_param((4 * d, d), "mlp", f"c_fc{b}", gen, lr_mul=1.0))
        hidden.append(_param((4 * d, d), "mlp", f"c_proj{b}", gen, lr_mul=2.0))
    return hidden + gates


def muon_grad(p_index, shape, rank, step):
    gen = torch.Generator().manual_seed(1000 * step + 37 * rank + p_index + 1)
    return torch.randn(shape, generator=gen)


def run_normuon(params, world_size, rank, steps=len(LRS), **kw):
    """Feed rank `rank`'s grads (or, with rank=None, the average over `world_size` ranks) for a few steps."""
    opt = tg.NorMuon(params, **kw)
    for s in range(steps):
        for i, p in enumerate(params):
            if rank is None:
                p.grad = torch.stack([muon_grad(i, p.shape, r, s) for r in range(world_size)]).mean(0).to(p.dtype)
            else:
                p.grad = muon_grad(i, p.shape, rank, s).to(p.dtype)
        for g in opt.param_groups:
            g["lr"], g["momentum"] = LRS[s], MOMENTA[s]
        opt.step()
    return opt


def adam_params(seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [_param((8, 6), "embed", "embed", gen, dtype=dtype, lr_mul=3.0, scale=1.0),
            _param((8,), "scalars", "scalars", gen, dtype=dtype, lr_mul=5.0, scale=1.0),
            _param((8, 6), "lm_head", "lm_head", gen, dtype=dtype, scale=1.0),
            _param((8, 6), "value_embed", "ve0", gen, dtype=dtype, lr_mul=3.0, scale=1.0),
            _param((8, 6), "value_embed", "ve1", gen, dtype=dtype, lr_mul=3.0, scale=1.0),
            _param((8, 3), None, "unlabeled", gen, dtype=dtype, wd_mul=2.0, scale=1.0)]


def adam_loss(params, rank, step, micro):
    gen = torch.Generator().manual_seed(500 * step + 71 * rank + 13 * micro + 7)
    return sum((p * torch.randn(p.shape, generator=gen)).sum() + 0.1 * p.square().sum() for p in params)


def run_distadam_like_trainer(params, world_size, rank, steps=6, micro_batches=2):
    """Trainer protocol: should_sync only before the last micro-batch backward of odd steps; Adam steps on odd
    steps only (it sees the grads of two steps). rank=None: one process with the ranks' mean loss."""
    opt = tg.DistAdam(params, lr=0.01)
    for s in range(steps):
        for m in range(micro_batches):
            if s % 2 == 1 and m == micro_batches - 1:
                opt.should_sync = True
            if rank is None:
                loss = sum(adam_loss(params, r, s, m) for r in range(world_size)) / world_size
            else:
                loss = adam_loss(params, rank, s, m)
            loss.backward()
        if s % 2 == 1:
            opt.step()
            opt.zero_grad(set_to_none=True)
            opt.should_sync = False
    return opt


# ------------------------------------------------------------------ workers (run in gloo processes)

def _normuon_layout(opt):
    return [dict(name=g["label"], local=[p.pname for p in g["params"][lay["lo"]:lay["hi"]]],
                 local_labels=[p.label for p in g["params"][lay["lo"]:lay["hi"]]], chunk=lay["chunk"])
            for g, lay in zip(opt.param_groups, opt._layout)]


def _worker_generic(rank, world_size):
    """NorMuon (generic grouping) and DistAdam on `world_size` gloo ranks."""
    out = {}
    params = muon_params_generic()
    opt = run_normuon(params, world_size, rank)
    out["muon_params"] = {p.pname: p.detach().clone() for p in params}
    out["muon_layout"] = _normuon_layout(opt)
    aparams = adam_params()
    aopt = run_distadam_like_trainer(aparams, world_size, rank)
    out["adam_params"] = {p.pname: p.detach().clone() for p in aparams}
    out["adam_state_rows"] = {p.pname: (aopt.state[p]["exp_avg"].shape[0], aopt.state[p]["exp_avg_sq"].shape[0],
                                       aopt.state[p]["step"]) for p in aparams}
    out["adam_pending_after_step"] = len(aopt._pending)
    try:
        tg.DistAdam([nn.Parameter(torch.zeros(2 * world_size + 1, 4))])
        out["adam_bad_shape_error"] = None
    except ValueError as e:
        out["adam_bad_shape_error"] = str(e)
    return out


def _worker_record(rank, world_size):
    params = muon_params_record()
    opt = run_normuon(params, world_size, rank)
    return dict(muon_params={p.pname: p.detach().clone() for p in params}, muon_layout=_normuon_layout(opt),
                groups=[(g["label"], len(g["params"])) for g in opt.param_groups])


@pytest.fixture(scope="module")
def generic_runs():
    return {W: run_gloo(_worker_generic, W) for W in (2, 4)}


@pytest.fixture(scope="module")
def record_run():
    return run_gloo(_worker_record, 8)


def _assert_params_close(got, ref, rtol=1e-5, atol=1e-6):
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# ------------------------------------------------------------------ distributed tests

@pytest.mark.slow
@pytest.mark.parametrize("W", [2, 4])
def test_normuon_sharded_matches_single_process(generic_runs, W):
    results = generic_runs[W]
    ref_params = muon_params_generic()
    run_normuon(ref_params, W, rank=None)
    ref = {p.pname: p.detach() for p in ref_params}
    for r, res in enumerate(results):
        _assert_params_close(res["muon_params"], ref)
        for name in ref:  # bit-identical on every rank (padding rows never leak: sizes 1, 3, 5 don't divide W)
            assert torch.equal(res["muon_params"][name], results[0]["muon_params"][name]), (r, name)
    # ownership: contiguous chunks of ceil(size/W), every param owned exactly once, no attn/mlp mixing
    for gi, g in enumerate(results[0]["muon_layout"]):
        owned = [n for res in results for n in res["muon_layout"][gi]["local"]]
        assert len(owned) == len(set(owned))
        for res in results:
            lay = res["muon_layout"][gi]
            assert len(lay["local"]) <= lay["chunk"]
            assert not ("attn" in lay["local_labels"] and "mlp" in lay["local_labels"])
    sizes = {g["name"]: sum(len(res["muon_layout"][gi]["local"]) for res in results)
             for gi, g in enumerate(results[0]["muon_layout"])}
    assert sizes == {"smear_gate": 1, "attn": 3, "attn_gate": 3, "mlp": 5}  # first-appearance order kept
    assert [g["name"] for g in results[0]["muon_layout"]] == ["smear_gate", "attn", "attn_gate", "mlp"]


@pytest.mark.slow
@pytest.mark.parametrize("W", [2, 4])
def test_distadam_sharded_matches_single_process(generic_runs, W):
    results = generic_runs[W]
    ref_params = adam_params()
    ref_opt = run_distadam_like_trainer(ref_params, W, rank=None)
    ref = {p.pname: p.detach() for p in ref_params}
    for r, res in enumerate(results):
        _assert_params_close(res["adam_params"], ref)
        for name in ref:
            assert torch.equal(res["adam_params"][name], results[0]["adam_params"][name]), (r, name)
        for p in ref_params:  # ZeRO-1: each rank holds 1/W of dim 0; 3 Adam steps in 6 training steps
            assert res["adam_state_rows"][p.pname] == (p.shape[0] // W, p.shape[0] // W, 3)
        assert res["adam_pending_after_step"] == 0
        assert "divisible by" in res["adam_bad_shape_error"] and str(W) in res["adam_bad_shape_error"]
    assert all(ref_opt.state[p]["step"] == 3 for p in ref_params)


@pytest.mark.slow
def test_normuon_record_grouping_on_8_ranks(record_run):
    results = record_run
    assert results[0]["groups"] == [("smear_gate", 1), ("attn_gate", 10), ("attn+mlp", 16), ("mlp", 16)]
    attn_blocks = [b for b in range(1, 12) if b != 7]
    mlp_names = [n for b in range(1, 12) for n in (f"c_fc{b}", f"c_proj{b}")]
    expected = {g: [[] for _ in range(8)] for g in range(4)}
    expected[0][0] = ["smear"]
    for r in range(5):
        expected[1][r] = [f"gate{b}" for b in attn_blocks[2 * r:2 * r + 2]]
        expected[2][r] = [f"attn{b}" for b in attn_blocks[2 * r:2 * r + 2]]
    for r in range(5, 8):
        expected[2][r] = mlp_names[2 * (r - 5):2 * (r - 5) + 2]  # c_fc/c_proj of blocks 1-3
    for r in range(8):
        expected[3][r] = mlp_names[6 + 2 * r:6 + 2 * r + 2]
    for r, res in enumerate(results):
        for g in range(4):
            assert res["muon_layout"][g]["local"] == expected[g][r], (r, g)
            assert res["muon_layout"][g]["chunk"] == (1 if g == 0 else 2)
            labels = set(res["muon_layout"][g]["local_labels"])
            assert not ({"attn", "mlp"} <= labels), (r, g)
    ref_params = muon_params_record()
    run_normuon(ref_params, 8, rank=None)  # one process: generic grouping, same math per param
    ref = {p.pname: p.detach() for p in ref_params}
    for r, res in enumerate(results):
        _assert_params_close(res["muon_params"], ref)
        for name in ref:
            assert torch.equal(res["muon_params"][name], results[0]["muon_params"][name]), (r, name)


# ------------------------------------------------------------------ single-process unit tests

def test_lr_factor_record_shapes():
    d = 768
    def meta(shape, label, lr_mul=None):
        p = nn.Parameter(torch.empty(shape, device="meta"))
        p.label = label
        if lr_mul is not None:
            p.lr_mul = lr_mul
        return p
    assert tg.normuon_lr_factor(meta((4 * d, d), "attn")) == 2.0
    assert tg.normuon_lr_factor(meta((4 * d, d), "mlp", 1.0)) == 2.0   # c_fc
    assert tg.normuon_lr_factor(meta((4 * d, d), "mlp", 2.0)) == 4.0   # c_proj
    assert tg.normuon_lr_factor(meta((6, 12), "attn_gate")) == 1.0
    assert tg.normuon_lr_factor(meta((1, 12), "smear_gate")) == 1.0
    assert tg.normuon_lr_factor(meta((d, 4 * d), "mlp")) == 1.0       # wide: no shape boost


def test_reduce_dim_rules():
    assert tg.normuon_reduce_dim("attn", (3072, 768)) == -1
    assert tg.normuon_reduce_dim("mlp", (3072, 768)) == -1
    assert tg.normuon_reduce_dim("attn_gate", (6, 12)) == -1    # gates special-cased, as in the record
    assert tg.normuon_reduce_dim("smear_gate", (1, 12)) == -1
    assert tg.normuon_reduce_dim("mlp", (768, 3072)) == -2      # wide non-gate: per column


@pytest.mark.parametrize("dim", [-1, -2])
def test_second_moment_math(dim):
    gen = torch.Generator().manual_seed(0)
    v = torch.randn(3, 8, 5, generator=gen) * torch.linspace(0.1, 2.0, 8).view(1, 8, 1) \
        * torch.linspace(0.5, 3.0, 5).view(1, 1, 5)
    S = torch.zeros_like(v[..., :1] if dim == -1 else v[..., :1, :])
    out = tg.normuon_second_moment(v, S, BETA2, dim)
    torch.testing.assert_close(S, (1 - BETA2) * v.square().mean(dim, keepdim=True))
    torch.testing.assert_close(out.norm(dim=(-2, -1)), v.norm(dim=(-2, -1)))      # Frobenius kept per matrix
    rms = out.square().mean(dim)                                                    # equalised along the other axis
    torch.testing.assert_close(rms, rms[..., :1].expand_as(rms))
    # second call: running average, S <- b2 S + (1-b2) s
    S_before = S.clone()
    tg.normuon_second_moment(2 * v, S, BETA2, dim)
    torch.testing.assert_close(S, BETA2 * S_before + (1 - BETA2) * (2 * v).square().mean(dim, keepdim=True))


def test_cautious_weight_decay_mask():
    p = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.0]])
    v = torch.tensor([[0.5, 0.5, -0.5, -0.5, 0.3]])
    lr, wd = torch.tensor(0.1), torch.tensor(0.2)
    tg.cautious_update(p, v, lr, wd)
    mask = torch.tensor([[1.0, 0.0, 0.0, 1.0, 1.0]])     # decay only where v*p >= 0 (update shrinks |p|)
    p0 = torch.tensor([[1.0, -1.0, 2.0, -2.0, 0.0]])
    torch.testing.assert_close(p, p0 - 0.1 * (v + 0.2 * mask * p0))


def _one_muon(shape, label, lr_mul=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p = _param(shape, label, label, gen, lr_mul=lr_mul)
    g = torch.randn(shape, generator=gen)
    return p, g


@pytest.mark.parametrize("label,shape,lr_mul,factor", [
    ("attn", (64, 16), None, 2.0), ("mlp", (64, 16), 1.0, 2.0), ("mlp", (64, 16), 2.0, 4.0),
    ("attn_gate", (2, 12), None, 1.0), ("smear_gate", (1, 12), None, 1.0)])
def test_normuon_first_step_by_hand(label, shape, lr_mul, factor):
    p, g = _one_muon(shape, label, lr_mul)
    p0 = p.detach().clone()
    lr, wd = 0.02, 1.2
    opt = tg.NorMuon([p], lr=lr, weight_decay=wd, momentum=BETA, beta2=BETA2)
    p.grad = g
    opt.step()
    u = (1 - BETA) * g + BETA * (1 - BETA) * g
    u = u.view(4, shape[1], shape[1]) if label == "attn" else u.unsqueeze(0)
    v = tg.polar_express(u).float()
    s = (1 - BETA2) * v.square().mean(-1, keepdim=True)           # per row for every label here, as in the record
    vn = v / s.sqrt()
    vn = (vn * v.norm(dim=(-2, -1), keepdim=True) / vn.norm(dim=(-2, -1), keepdim=True)).reshape(shape)
    if label == "smear_gate":                                      # one row: NorMuon is a no-op
        torch.testing.assert_close(vn, v.reshape(shape))
    mask = (vn * p0 >= 0).float()
    expected = p0 - lr * factor * (vn + lr * wd * mask * p0)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-7)
    S = opt.param_groups[0]["second_momentum_buffer"]
    assert S.dtype == p.dtype
    assert tuple(S.shape) == ((4, shape[1], 1) if label == "attn" else (1, shape[0], 1))
    assert opt.param_groups[0]["momentum_buffer"].dtype == p.dtype
    lr_eff = opt.param_groups[0]["lr_eff"][0]
    assert lr_eff.device.type == "cpu" and lr_eff.dim() == 0 and lr_eff.dtype == torch.float32
    assert lr_eff.item() == pytest.approx(lr * factor)


def test_normuon_bf16_gate_stays_bf16():
    gen = torch.Generator().manual_seed(3)
    p = _param((2, 12), "attn_gate", "g", gen, dtype=torch.bfloat16)
    opt = tg.NorMuon([p])
    p.grad = torch.randn(2, 12, generator=gen).bfloat16()
    before = p.detach().clone()
    opt.step()
    assert p.dtype == torch.bfloat16 and not torch.equal(p, before)
    assert opt.param_groups[0]["second_momentum_buffer"].dtype == torch.bfloat16  # the record's buffer dtype
    assert opt.param_groups[0]["momentum_buffer"].dtype == torch.bfloat16


def test_normuon_reset_and_state_dict_round_trip():
    params = muon_params_generic()
    opt = tg.NorMuon(params)
    for g in opt.param_groups:
        g["initial_lr"] = g["lr"]
    initial = copy.deepcopy(opt.state_dict())
    run_steps = lambda o, ps, s0, n: [_feed_and_step(o, ps, s) for s in range(s0, s0 + n)]
    run_steps(opt, params, 0, 2)
    bufs = [g[k] for g in opt.param_groups for k in ("momentum_buffer", "second_momentum_buffer")]
    assert all(b.abs().sum() > 0 for b in bufs)
    # mid-run round trip: a fresh optimizer loaded from the state continues identically
    saved = copy.deepcopy(opt.state_dict())
    clones = [_clone_param(p) for p in params]
    opt2 = tg.NorMuon(clones)
    opt2.load_state_dict(saved)
    run_steps(opt, params, 2, 2)
    run_steps(opt2, clones, 2, 2)
    for a, b in zip(params, clones):
        assert torch.equal(a, b)
    # reset() zeroes every buffer
    opt.reset()
    assert all(g[k].abs().sum() == 0 for g in opt.param_groups for k in ("momentum_buffer", "second_momentum_buffer"))
    # trainer's warm-up protocol: reset + reload the initial state -> buffers and lr caches gone, re-created lazily
    opt.load_state_dict(initial)
    assert all(k not in g for g in opt.param_groups for k in ("momentum_buffer", "second_momentum_buffer", "lr_eff"))
    assert all(g["initial_lr"] == g["lr"] for g in opt.param_groups)
    clones = [_clone_param(p) for p in params]
    fresh = tg.NorMuon(clones)
    run_steps(opt, params, 7, 1)
    run_steps(fresh, clones, 7, 1)
    for a, b in zip(params, clones):
        assert torch.equal(a, b)


def _clone_param(p):
    q = nn.Parameter(p.detach().clone())
    for k in ("label", "pname", "lr_mul", "wd_mul"):
        if hasattr(p, k):
            setattr(q, k, getattr(p, k))
    return q


def _feed_and_step(opt, params, s):
    for i, p in enumerate(params):
        p.grad = muon_grad(i, p.shape, 0, s)
    for g in opt.param_groups:
        g["lr"], g["momentum"] = LRS[s % len(LRS)], MOMENTA[s % len(MOMENTA)]
    opt.step()


def test_normuon_params_are_rows_of_a_stack_and_a_gradient_in_its_row_is_used_where_it_lies():
    params = muon_params_generic()
    clones = [_clone_param(p) for p in params]
    opt, ref = tg.NorMuon(params), tg.NorMuon(clones)
    for group, layout in zip(opt.param_groups, opt._layout):
        stack = layout["params"]
        assert stack.shape[0] == layout["chunk"] and all(p.data_ptr() == row.data_ptr()
                                                          for p, row in zip(group["params"], stack))
    for s in range(3):
        for i, (p, q) in enumerate(zip(params, clones)):
            g = muon_grad(i, p.shape, 0, s)
            if i % 2:  # where CUDA graphs accumulate it: the row of the gradient stack
                p.grad = opt.grad_buffers[p]
                p.grad.copy_(g)
            else:
                p.grad = g.clone()
            q.grad = g
        for o in (opt, ref):
            for group in o.param_groups:
                group["lr"], group["momentum"] = LRS[s], MOMENTA[s]
            o.step()
    assert all(torch.equal(p, q) for p, q in zip(params, clones))
    assert any(not torch.equal(p, q) for p, q in zip(params, muon_params_generic()))  # it did train


def test_normuon_rejects_bad_input():
    with pytest.raises(ValueError):
        tg.NorMuon([nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError):
        tg.NorMuon(muon_params_generic(), orthogonalizer="newton")


def test_distadam_groups_state_dtype_and_adam_math():
    params = adam_params()
    params[0].data = params[0].data.bfloat16()
    opt = tg.DistAdam(params, lr=0.01, betas=(0.65, 0.95), eps=1e-8)
    assert [g["label"] for g in opt.param_groups] == ["lm_head", "scalars", "value_embed", "embed", "other"]
    # reference: torch Adam (its eps sits inside the bias correction: negligible at eps=1e-8)
    ref = [nn.Parameter(p.detach().float().clone()) for p in params[1:]]
    ref_opt = [torch.optim.Adam([q], lr=0.01 * getattr(p, "lr_mul", 1.0), betas=(0.65, 0.95), eps=1e-8)
               for p, q in zip(params[1:], ref)]
    for s in range(3):
        gen = torch.Generator().manual_seed(s)
        for p, q in zip(params, [None] + ref):
            g = torch.randn(p.shape, generator=gen)
            p.grad = g.to(p.dtype)
            if q is not None:
                q.grad = g.clone()
        opt.step()
        for o in ref_opt:
            o.step()
    for p, q in zip(params[1:], ref):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    assert opt.state[params[0]]["exp_avg"].dtype == torch.bfloat16          # state in the param's dtype
    assert opt.state[params[1]]["exp_avg_sq"].dtype == torch.float32
    assert opt.state[params[0]]["step"] == 3


def test_distadam_state_dict_round_trip():
    params = adam_params()
    opt = tg.DistAdam(params, lr=0.01)
    params[5].grad = torch.randn(params[5].shape)     # one param steps first
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    clones = [_clone_param(p) for p in params]
    opt2 = tg.DistAdam(clones, lr=0.01)
    opt2.load_state_dict(saved)
    for ps, o in ((params, opt), (clones, opt2)):
        for s in range(2):
            gen = torch.Generator().manual_seed(10 + s)
            for p in ps:
                p.grad = torch.randn(p.shape, generator=gen)
            o.step()
    for a, b in zip(params, clones):
        assert torch.equal(a, b)
    assert opt2.state[clones[0]]["step"] == 2  # params without grad at step 1 started later


def test_distadam_local_ignores_sync_flag_but_uses_accumulated_grads():
    """One process: the hook launches nothing; two accumulated steps are seen as one summed grad."""
    params = adam_params()
    opt = run_distadam_like_trainer(params, 1, rank=0, steps=2)
    assert not opt._pending
    assert all(opt.state[p]["step"] == 1 for p in params)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adam_update_compiled_matches_eager_and_the_textbook_formula(dtype):
    g0 = torch.Generator().manual_seed(3)
    p = torch.randn(64, 48, generator=g0).to(dtype)
    grads = [torch.randn(64, 48, generator=g0).to(dtype) * 0.1 for _ in range(3)]
    ref_p, m, v = p.double(), torch.zeros(64, 48, dtype=torch.float64), torch.zeros(64, 48, dtype=torch.float64)
    eager = [p.clone(), torch.zeros_like(p), torch.zeros_like(p)]
    compiled = [p.clone(), torch.zeros_like(p), torch.zeros_like(p)]
    fn = torch.compile(tg.adam_update, dynamic=False, fullgraph=True)
    b1, b2, eps, lr = 0.65, 0.95, 1e-8, 0.01
    step_size = torch.zeros((), dtype=torch.float32)
    for t, g in enumerate(grads, start=1):
        m, v = b1 * m + (1 - b1) * g.double(), b2 * v + (1 - b2) * g.double() ** 2
        s = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        ref_p = ref_p - s * m / (v.sqrt() + eps)
        step_size.fill_(s)
        tg.adam_update(eager[0], g, eager[1], eager[2], step_size, b1, b2, eps)
        fn(compiled[0], g, compiled[1], compiled[2], step_size, b1, b2, eps)  # same 0-D CPU tensor refilled: no recompile needed
    torch._dynamo.reset()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for state in (eager, compiled):
        assert ((state[0].double() - ref_p).norm() / ref_p.norm()).item() < tol
    assert ((eager[0].double() - compiled[0].double()).norm() / ref_p.norm()).item() < tol


# ------------------------------------------------------------------ grouping and labels (what the log says)

def test_normuon_groups_use_the_records_sizing_on_8_ranks_and_say_nothing_for_the_records_matrices():
    params = muon_params_record()
    groups, note = tg.normuon_groups(params, 8)
    assert [(name, len(ps)) for name, ps in groups] == [("smear_gate", 1), ("attn_gate", 10), ("attn+mlp", 16),
                                                        ("mlp", 16)]
    assert note == ""
    groups, note = tg.normuon_groups(params, 2)  # fewer ranks: by label and shape, still the record's matrices
    assert [(name, len(ps)) for name, ps in groups] == [("attn", 10), ("mlp", 22), ("smear_gate", 1),
                                                        ("attn_gate", 10)]
    assert note == "" and tg.NorMuon(muon_params_record()).grouping_note == ""


@pytest.mark.parametrize("world_size", [1, 8])
def test_normuon_groups_of_other_matrices_are_named_in_a_note_for_the_log(world_size):
    params = muon_params_generic()
    params.append(_param((16, 16), "mlp", "square_mlp", torch.Generator().manual_seed(1)))  # a second mlp shape
    groups, note = tg.normuon_groups(params, world_size)
    names = [name for name, _ in groups]
    assert names == ["smear_gate", "attn", "attn_gate", "mlp:64x16:float32", "mlp:16x16:float32"]
    assert all(len({(p.label, p.shape) for p in ps}) == 1 for _, ps in groups)
    assert note.startswith("NorMuon: the matrices differ from the record's (attn 3, attn_gate 3, mlp 6, smear_gate 1 "
                           "here, attn 10, attn_gate 10, mlp 22, smear_gate 1 there), so they are grouped by label "
                           "and shape")
    assert ("instead of the record sizing (1, 10, 16, 16)" in note) == (world_size == 8)
    assert note.endswith(": smear_gate (1), attn (3), attn_gate (3), mlp:64x16:float32 (5), mlp:16x16:float32 (1)")


@pytest.fixture(scope="module")
def small_gpt_args():
    return tg.parse_args(["--smoke", "--model-dim", "64", "--num-heads", "1"])


def test_build_optimizers_gives_every_parameter_of_the_model_to_one_optimizer(small_gpt_args):
    model = tg.GPT(small_gpt_args, max_seq_len=64)
    adam, muon = tg.build_optimizers(model, small_gpt_args)
    in_adam = {id(p) for g in adam.param_groups for p in g["params"]}
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    assert not in_adam & in_muon and in_adam | in_muon == {id(p) for p in model.parameters()}
    assert muon.grouping_note == ""  # the record's layer map: the record's matrices


@pytest.mark.parametrize("label,words", [(None, ["parameter stray has no optimizer label"]),
                                         ("bias", ["parameter stray has label 'bias'"])])
def test_a_parameter_no_optimizer_takes_is_a_config_error_naming_it_and_the_label_tables(small_gpt_args, label,
                                                                                         words):
    model = tg.GPT(small_gpt_args, max_seq_len=64)
    model.stray = nn.Parameter(torch.zeros(4, 4))
    if label is not None:
        model.stray.label = label
    with pytest.raises(tg.ConfigError) as e:
        tg.build_optimizers(model, small_gpt_args)
    for w in [*words, "set_optimizer_label()", "NORMUON_LABEL_ORDER", "DISTADAM_LABEL_ORDER"]:
        assert w in str(e.value), (w, str(e.value))


def test_a_gate_labelled_as_a_matrix_is_a_config_error_naming_the_gate_labels(small_gpt_args):
    model = tg.GPT(small_gpt_args, max_seq_len=64)
    model.value_gate = tg.set_optimizer_label(nn.Parameter(torch.zeros(2, 12)), "attn")
    with pytest.raises(tg.ConfigError, match=r"parameter value_gate looks like a gate but its label 'attn' is not in "
                                             r"NORMUON_GATE_LABELS \('smear_gate', 'attn_gate'\)"):
        tg.build_optimizers(model, small_gpt_args)
