"""NorMuon and DistAdam: math on known shapes, state handling, and sharded (gloo) runs vs one process."""
import copy
import math

import pytest
import torch
from torch import nn

import train_gpt as tg
from optimizer_plans import optimizer_plan
from dist_utils import run_gloo

BETA, BETA2 = 0.95, 0.95
LRS = (0.02, 0.03, 0.025, 0.01)          # per-step lr, like a schedule (group["lr"] set by the trainer)
MOMENTA = (0.85, 0.9, 0.95, 0.95)


# ------------------------------------------------------------------ model builders (deterministic)

# The record's labels and the treatment each has there (set_optimizer_label in the model).
RECORD_TREATMENTS = {"attn": "qkvo", "mlp": "matrix", "attn_gate": "gate", "smear_gate": "gate",
                     "lm_head": "adam", "scalars": "adam", "value_embed": "adam", "embed": "adam"}


def _param(shape, label, name, gen, dtype=torch.float32, lr_mul=None, wd_mul=None, scale=0.05, treatment=None):
    """A parameter as the model makes one: `label` with its record treatment (or `treatment`); label None: neither."""
    p = nn.Parameter((torch.randn(shape, generator=gen) * scale).to(dtype))
    p.label, p.pname = label, name
    if label is not None:
        p.treatment = treatment or RECORD_TREATMENTS[label]
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


def adam_params(seed=0, dtype=torch.float32, padded_for=None):
    """Labelled Adam parameters and an unlabelled one; padded_for=W adds two DistAdam pads at W ranks: a (2W+1, 4)
    matrix under a label of its own and a 0-D scalar."""
    gen = torch.Generator().manual_seed(seed)
    params = [_param((8, 6), "embed", "embed", gen, dtype=dtype, lr_mul=3.0, scale=1.0),
              _param((8,), "scalars", "scalars", gen, dtype=dtype, lr_mul=5.0, scale=1.0),
              _param((8, 6), "lm_head", "lm_head", gen, dtype=dtype, scale=1.0),
              _param((8, 6), "value_embed", "ve0", gen, dtype=dtype, lr_mul=3.0, scale=1.0),
              _param((8, 6), "value_embed", "ve1", gen, dtype=dtype, lr_mul=3.0, scale=1.0)]
    if padded_for is not None:
        params += [_param((2 * padded_for + 1, 4), "odd_rows", "odd_rows", gen, dtype=dtype, lr_mul=2.0, scale=1.0,
                          treatment="adam"),
                   _param((), "scalars", "zero_d", gen, dtype=dtype, lr_mul=5.0, scale=1.0)]
    return params + [_param((8, 3), None, "unlabeled", gen, dtype=dtype, wd_mul=2.0, scale=1.0)]


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
                 local_labels=[p.label for p in g["params"][lay["lo"]:lay["hi"]]],
                 local_treatments=[p.treatment for p in g["params"][lay["lo"]:lay["hi"]]], chunk=lay["chunk"],
                 is_attn=lay["is_attn"], reduce_dim=lay["reduce_dim"])
            for g, lay in zip(opt.param_groups, opt._layout)]


def _worker_generic(rank, world_size):
    """NorMuon (generic grouping) and DistAdam on `world_size` gloo ranks."""
    out = {}
    params = muon_params_generic()
    opt = run_normuon(params, world_size, rank)
    out["muon_params"] = {p.pname: p.detach().clone() for p in params}
    out["muon_layout"] = _normuon_layout(opt)
    aparams = adam_params(padded_for=world_size)
    aopt = run_distadam_like_trainer(aparams, world_size, rank)
    out["adam_params"] = {p.pname: p.detach().clone() for p in aparams}
    out["adam_shapes"] = {p.pname: tuple(p.shape) for p in aparams}
    out["adam_state_rows"] = {p.pname: (aopt.state[p]["exp_avg"].shape[0], aopt.state[p]["exp_avg_sq"].shape[0],
                                       aopt.state[p]["step"]) for p in aparams}
    out["adam_groups"] = [g["label"] for g in aopt.param_groups]
    out["adam_padded"] = sorted(p.pname for p in aopt._padded)
    out["adam_pending_after_step"] = len(aopt._pending)
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
    # ownership: contiguous chunks of ceil(size/W), every param owned exactly once, no attn/mlp mixing; a rank's
    # stack is split into Q, K, V and O exactly where it holds qkvo matrices only
    for gi, g in enumerate(results[0]["muon_layout"]):
        owned = [n for res in results for n in res["muon_layout"][gi]["local"]]
        assert len(owned) == len(set(owned))
        for res in results:
            lay = res["muon_layout"][gi]
            assert len(lay["local"]) <= lay["chunk"]
            assert not ("attn" in lay["local_labels"] and "mlp" in lay["local_labels"])
            assert lay["is_attn"] == (g["name"] == "attn")
    sizes = {g["name"]: sum(len(res["muon_layout"][gi]["local"]) for res in results)
             for gi, g in enumerate(results[0]["muon_layout"])}
    assert sizes == {"smear_gate": 1, "attn": 3, "attn_gate": 3, "mlp": 5}  # first-appearance order kept
    assert [g["name"] for g in results[0]["muon_layout"]] == ["smear_gate", "attn", "attn_gate", "mlp"]


@pytest.mark.slow
@pytest.mark.parametrize("W", [2, 4])
def test_distadam_sharded_matches_single_process_and_pads_rows_that_do_not_divide_by_w(generic_runs, W):
    """ZeRO-1 over W gloo ranks equals one process, a (2W+1, 4) and a 0-D parameter included: DistAdam pads them in
    its own buffers (the parameters keep their shapes) and each rank keeps ceil(rows / W) rows of Adam's state."""
    results = generic_runs[W]
    ref_params = adam_params(padded_for=W)
    ref_opt = run_distadam_like_trainer(ref_params, W, rank=None)
    ref = {p.pname: p.detach() for p in ref_params}
    assert {n: tuple(p.shape) for n, p in ref.items()}["odd_rows"] == (2 * W + 1, 4)
    for r, res in enumerate(results):
        _assert_params_close(res["adam_params"], ref)
        assert res["adam_shapes"] == {n: tuple(p.shape) for n, p in ref.items()}
        for name in ref:
            assert torch.equal(res["adam_params"][name], results[0]["adam_params"][name]), (r, name)
        for p in ref_params:  # ZeRO-1: each rank holds ceil(rows / W) rows; 3 Adam steps in 6 training steps
            rows = -(-(p.shape[0] if p.dim() else 1) // W)
            assert rows == tg.rows_per_rank(p, W)
            assert res["adam_state_rows"][p.pname] == (rows, rows, 3), p.pname
        assert res["adam_state_rows"]["odd_rows"][0] == 3 and res["adam_state_rows"]["zero_d"][0] == 1  # ceil
        assert res["adam_padded"] == ["odd_rows", "zero_d"]  # only those whose rows do not divide by W
        # the record's labels in its order, then a new label, then the unlabelled ones
        assert res["adam_groups"] == ["lm_head", "scalars", "value_embed", "embed", "odd_rows", "other"]
        assert res["adam_pending_after_step"] == 0
    assert all(ref_opt.state[p]["step"] == 3 for p in ref_params)
    assert not ref_opt._padded  # one process pads nothing


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
        p.label, p.treatment = label, RECORD_TREATMENTS[label]
        if lr_mul is not None:
            p.lr_mul = lr_mul
        return p
    assert tg.normuon_lr_factor(meta((4 * d, d), "attn")) == 2.0
    assert tg.normuon_lr_factor(meta((4 * d, d), "mlp", 1.0)) == 2.0   # c_fc
    assert tg.normuon_lr_factor(meta((4 * d, d), "mlp", 2.0)) == 4.0   # c_proj
    assert tg.normuon_lr_factor(meta((6, 12), "attn_gate")) == 1.0
    assert tg.normuon_lr_factor(meta((1, 12), "smear_gate")) == 1.0
    assert tg.normuon_lr_factor(meta((d, 4 * d), "mlp")) == 1.0       # wide: no shape boost


def test_the_second_moment_axis_follows_the_treatment_and_the_shape():
    assert tg.normuon_reduce_dim("qkvo", (3072, 768)) == -1
    assert tg.normuon_reduce_dim("matrix", (3072, 768)) == -1
    assert tg.normuon_reduce_dim("matrix", (768, 768)) == -1     # square: per row
    assert tg.normuon_reduce_dim("gate", (6, 12)) == -1          # a gate: per row whatever its shape, as in the record
    assert tg.normuon_reduce_dim("gate", (1, 12)) == -1
    assert tg.normuon_reduce_dim("matrix", (768, 3072)) == -2    # wide matrix: per column
    assert tg.normuon_reduce_dim("matrix", (6, 12)) == -2        # a gate's shape treated as a matrix: per column


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


def _one_muon(shape, label, lr_mul=None, seed=0, treatment=None):
    gen = torch.Generator().manual_seed(seed)
    p = _param(shape, label, label, gen, lr_mul=lr_mul, treatment=treatment)
    g = torch.randn(shape, generator=gen)
    return p, g


@pytest.mark.parametrize("label,treatment,shape,lr_mul,factor", [
    ("attn", "qkvo", (64, 16), None, 2.0), ("mlp", "matrix", (64, 16), 1.0, 2.0),
    ("mlp", "matrix", (64, 16), 2.0, 4.0), ("attn_gate", "gate", (2, 12), None, 1.0),
    ("smear_gate", "gate", (1, 12), None, 1.0),
    ("wide", "matrix", (16, 64), None, 1.0),        # wider than tall: one statistic per column, no lr boost
    ("value_gate", "matrix", (2, 12), None, 1.0),   # a gate's name and shape, treated as a matrix: per column
    ("w", "gate", (2, 12), None, 1.0),              # any name treated as a gate: per row
    (None, None, (64, 16), None, 2.0),              # no treatment: a matrix, orthogonalised whole (not as qkvo)
    (None, None, (2, 12), None, 1.0)])
def test_normuon_first_step_by_hand_follows_the_declared_treatment(label, treatment, shape, lr_mul, factor):
    p, g = _one_muon(shape, label, lr_mul, treatment=treatment)
    assert getattr(p, "treatment", None) == (treatment or (RECORD_TREATMENTS.get(label) if label else None))
    treatment = getattr(p, "treatment", "matrix")
    p0 = p.detach().clone()
    lr, wd = 0.02, 1.2
    opt = tg.NorMuon([p], lr=lr, weight_decay=wd, momentum=BETA, beta2=BETA2)
    p.grad = g
    opt.step()
    u = (1 - BETA) * g + BETA * (1 - BETA) * g
    u = u.view(4, shape[1], shape[1]) if treatment == "qkvo" else u.unsqueeze(0)
    v = tg.polar_express(u).float()
    dim = -1 if treatment == "gate" or shape[0] >= shape[1] else -2   # per row, or per column where wide
    s = (1 - BETA2) * v.square().mean(dim, keepdim=True)
    vn = v / s.sqrt()
    vn = (vn * v.norm(dim=(-2, -1), keepdim=True) / vn.norm(dim=(-2, -1), keepdim=True)).reshape(shape)
    if shape[0] == 1:                                              # one row: NorMuon is a no-op
        torch.testing.assert_close(vn, v.reshape(shape))
    mask = (vn * p0 >= 0).float()
    expected = p0 - lr * factor * (vn + lr * wd * mask * p0)
    torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-7)
    S = opt.param_groups[0]["second_momentum_buffer"]
    assert S.dtype == p.dtype
    assert tuple(S.shape) == ((4, shape[1], 1) if treatment == "qkvo" else
                              (1, shape[0], 1) if dim == -1 else (1, 1, shape[1]))
    assert opt._layout[0]["is_attn"] == (treatment == "qkvo") and opt._layout[0]["reduce_dim"] == dim
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
    for k in ("label", "treatment", "pname", "lr_mul", "wd_mul"):
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


def test_normuon_refuses_an_empty_parameter_list_and_an_unknown_orthogonalizer():
    with pytest.raises(ValueError, match="empty parameter list"):
        tg.NorMuon([])
    with pytest.raises(ValueError, match="orthogonalizer must be 'polar' or 'turbo', got 'newton'"):
        tg.NorMuon(muon_params_generic(), orthogonalizer="newton")


def test_distadam_on_one_process_steps_a_0d_and_an_odd_rowed_parameter_as_torch_adam_does():
    gen = torch.Generator().manual_seed(5)
    params = [_param((), "scalars", "zero_d", gen, scale=1.0), _param((5, 3), "odd", "odd", gen, scale=1.0,
                                                                        treatment="adam")]
    opt = tg.DistAdam(params, lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    assert [g["label"] for g in opt.param_groups] == ["scalars", "odd"]
    ref = [nn.Parameter(p.detach().clone()) for p in params]
    ref_opt = torch.optim.Adam(ref, lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    for s in range(3):
        g = torch.Generator().manual_seed(100 + s)
        for p, q in zip(params, ref):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        opt.step()
        ref_opt.step()
    for p, q in zip(params, ref):
        assert p.shape == q.shape
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)
    assert [tuple(opt.state[p]["exp_avg"].shape) for p in params] == [(1,), (5, 3)] and not opt._padded


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


def test_a_parameter_without_a_label_is_one_line_naming_it_and_every_treatment(small_gpt_args):
    model = tg.GPT(small_gpt_args, max_seq_len=64)
    model.stray = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(tg.ConfigError) as e:
        tg.build_optimizers(model, small_gpt_args)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("parameter stray has no optimizer label: give it both where it is made, "
                              "set_optimizer_label(p, LABEL, TREATMENT)")
    for treatment, what in tg.TREATMENTS.items():
        assert f"{treatment} ({what})" in message, treatment
    assert set(tg.TREATMENTS) == {"matrix", "qkvo", "gate", "adam"}


def test_a_parameter_with_a_label_but_no_treatment_is_one_line_naming_it(small_gpt_args):
    model = tg.GPT(small_gpt_args, max_seq_len=64)
    model.stray = nn.Parameter(torch.zeros(4, 4))
    model.stray.label = "bias"  # set by hand, not with set_optimizer_label
    with pytest.raises(tg.ConfigError, match="^parameter stray has label 'bias' but no treatment: give it both "):
        tg.check_optimizer_labels(model)


def test_set_optimizer_label_refuses_a_treatment_it_does_not_know_naming_every_one():
    with pytest.raises(tg.ConfigError) as e:
        tg.set_optimizer_label(nn.Parameter(torch.zeros(2, 12)), "value_gate", "row_norm")
    message = str(e.value)
    assert "\n" not in message and message.startswith("set_optimizer_label(..., 'value_gate', 'row_norm')")
    assert all(f"{treatment} ({what})" in message for treatment, what in tg.TREATMENTS.items())
    p = tg.set_optimizer_label(nn.Parameter(torch.zeros(2, 12)), "value_gate", "gate", lr_mul=0.5)
    assert (p.label, p.treatment, p.lr_mul) == ("value_gate", "gate", 0.5)


def test_a_label_used_with_two_treatments_is_one_line_naming_the_parameter(small_gpt_args):
    """A new gate under the attention matrices' label, as a gate: one line naming it and the parameter that has the
    label otherwise. It asks for a label of its own, never for a table edit that would make attn (or mlp) gates."""
    model = tg.GPT(small_gpt_args, max_seq_len=64)
    model.value_gate = tg.set_optimizer_label(nn.Parameter(torch.zeros(2, 12)), "attn", "gate")
    with pytest.raises(tg.ConfigError) as e:
        tg.build_optimizers(model, small_gpt_args)
    message = str(e.value)
    assert "\n" not in message
    # the root module's own parameters come first in named_parameters(): value_gate is met before the blocks
    assert message == ("parameter blocks.1.attn.qkvo_w has label 'attn' as qkvo, but value_gate has it as gate: a "
                       "label is one group with one treatment; give one of them another label")
    for advice in ("NORMUON_GATE_LABELS", "looks like a gate", "add it there"):
        assert advice not in message


@pytest.mark.parametrize("shape,treatment,words", [
    ((4,), "matrix", "parameter extra of shape (4,) is treated as matrix, but NorMuon takes 2-D matrices"),
    ((2, 3, 4), "gate", "parameter extra of shape (2, 3, 4) is treated as gate, but NorMuon takes 2-D matrices"),
    ((64, 64), "qkvo", "parameter extra is treated as qkvo, but its shape (64, 64) is not (4d, d)")])
def test_a_parameter_normuon_cannot_take_as_treated_is_one_line_naming_it(small_gpt_args, shape, treatment, words):
    model = tg.GPT(small_gpt_args, max_seq_len=64)
    model.extra = tg.set_optimizer_label(nn.Parameter(torch.zeros(shape)), "extra", treatment)
    with pytest.raises(tg.ConfigError) as e:
        tg.build_optimizers(model, small_gpt_args)
    assert "\n" not in str(e.value) and str(e.value).startswith(words), str(e.value)
    model.extra = tg.set_optimizer_label(nn.Parameter(torch.zeros(shape)), "extra", "adam")  # Adam takes any shape
    tg.check_optimizer_labels(model)


def test_a_normuon_rank_that_would_stack_qkvo_with_other_matrices_is_one_line_naming_it_and_the_world_size(
        small_gpt_args, monkeypatch):
    """Record sizing edited so that, on 8 processes, rank 3 of attn+mlp (10 attn, 7 mlp, chunks of 3) would hold the
    last attention stack beside two MLP matrices: refused before anything is built, naming the parameter."""
    model = tg.GPT(small_gpt_args, max_seq_len=64)
    monkeypatch.setattr(tg, "NORMUON_RECORD_GROUP_SIZES", (1, 10, 17, 15))
    tg.check_optimizer_labels(model, world_sizes=(1, 2, 4))  # no record sizing there
    with pytest.raises(tg.ConfigError) as e:
        tg.check_optimizer_labels(model)
    assert str(e.value) == ("on 8 processes, NorMuon's rank 3 would stack parameter blocks.11.attn.qkvo_w (qkvo) with "
                            "matrices of another treatment in group attn+mlp: give them labels of their own")


@pytest.mark.parametrize("world_size", [1, 8])
def test_the_optimizer_plan_names_each_parameters_group_and_how_its_update_is_normalised(small_gpt_args,
                                                                                         world_size):
    model = tg.GPT(small_gpt_args, max_seq_len=64)
    plan = optimizer_plan(model, world_size)
    assert set(plan) == {name for name, _ in model.named_parameters()}
    assert plan["blocks.1.attn.qkvo_w"] == ("NorMuon " + ("attn+mlp" if world_size == 8 else "attn"),
                                            "qkvo, second moment per row")
    assert plan["blocks.11.mlp.c_proj"] == ("NorMuon mlp", "matrix, second moment per row")
    assert plan["blocks.1.attn.attn_gate.weight"] == ("NorMuon attn_gate", "gate, second moment per row")
    assert plan["smear_gate.weight"] == ("NorMuon smear_gate", "gate, second moment per row")
    assert plan["scalars"] == ("DistAdam scalars", f"adam, {-(-62 // world_size)} rows per rank")  # 62 or 8 (64)
    assert plan["embed.weight"] == ("DistAdam embed", f"adam, {50304 // world_size} rows per rank")
    assert plan["value_embeds.2.weight"][0] == "DistAdam value_embed" and plan["lm_head.weight"][0] == "DistAdam lm_head"
    if world_size == 1:  # the plan is what build_optimizers makes: NorMuon's groups and statistics, DistAdam's params
        adam, muon = tg.build_optimizers(model, small_gpt_args)
        names = {id(p): n for n, p in model.named_parameters()}
        built = {names[id(p)]: (f"NorMuon {group['label']}", "per row" if layout["reduce_dim"] == -1 else "per column")
                 for group, layout in zip(muon.param_groups, muon._layout) for p in group["params"]}
        built.update({names[id(p)]: (f"DistAdam {p.label}", None) for g in adam.param_groups for p in g["params"]})
        assert built == {n: (g, s.split("second moment ")[1] if g.startswith("NorMuon") else None)
                         for n, (g, s) in plan.items()}


def test_treatment_not_a_parameters_name_decides_how_normuon_normalises_it(small_gpt_args):
    """A gate-named matrix declared a matrix gets one statistic per column (it is wide); a parameter named like none
    of the gates, declared a gate, one per row; both train in groups of their own labels."""
    model = tg.GPT(small_gpt_args, max_seq_len=64)
    model.value_gate = tg.set_optimizer_label(nn.Parameter(torch.zeros(2, 12)), "value_gate", "matrix")
    model.mixer = tg.set_optimizer_label(nn.Parameter(torch.zeros(2, 12)), "mixer", "gate")
    plan = optimizer_plan(model, 1)
    assert plan["value_gate"] == ("NorMuon value_gate", "matrix, second moment per column")
    assert plan["mixer"] == ("NorMuon mixer", "gate, second moment per row")
    adam, muon = tg.build_optimizers(model, small_gpt_args)
    dims = {group["label"]: layout["reduce_dim"] for group, layout in zip(muon.param_groups, muon._layout)}
    assert dims["value_gate"] == -2 and dims["mixer"] == -1 and dims["attn_gate"] == -1


@pytest.mark.parametrize("orthogonalizer", ["polar", "turbo"])
@pytest.mark.parametrize("rank", [0, 7])
def test_normuons_shard_update_on_a_rank_of_8_follows_its_float64_definition(rank, orthogonalizer):
    """The float64 reference the GPU check holds the 8-GPU shard to (tests/normuon_reference.py) is NorMuon's own
    math: on the CPU (fp32 throughout) the shard of ranks 0 and 7 follows it to rounding; the bf16 gates to their
    own rounding."""
    from normuon_reference import shard_update_errors
    errors = shard_update_errors(rank, 8, orthogonalizer, ["--model-dim", "64", "--num-heads", "2", "--head-dim", "32"],
                                 device="cpu", compiled=False)
    assert set(errors) == ({"smear_gate", "attn_gate", "attn+mlp", "mlp"} if rank == 0 else {"attn+mlp", "mlp"})
    for label, e in errors.items():
        assert e["update_rel_err"] < (1e-4 if e["dtype"] == "torch.float32" else 2e-2), errors
