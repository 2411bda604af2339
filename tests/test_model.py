"""Model: init loss, YaRN, rotary, reference attention, parameter table, layer map, gradients, compiled regions, the
plain lm_head_loss, and the fused attention (its Triton q/k norm + rotary pass, FlashAttention-4 stood in) against the
plain `attention`."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
from interpreter import interpreted, run_scripts_in_triton_interpreter

SMOKE = tg.Hyperparameters(**tg.SMOKE_PRESET)
TINY = dataclasses.replace(SMOKE, model_dim=32, num_heads=2, head_dim=16)  # cheaper GEMMs, the same graphs
VOCAB_PADDED = 50304
PLAIN = {name: kernel.plain for name, kernel in tg.FUSED_KERNELS.items()}


def make_model(max_seq_len=1024, seed=0, args=SMOKE, kernels=None):
    torch.manual_seed(seed)
    return tg.GPT(args, max_seq_len=max_seq_len, kernels=kernels)


@pytest.fixture(scope="module")
def model():
    return make_model()


def random_batch(T, num_docs=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 50256, (T + 1,), generator=g)
    starts = sorted(set([0] + torch.randint(1, T, (num_docs - 1,), generator=g).tolist()))
    for s in starts:
        ids[s] = tg.BOS_ID
    cu = tg.pack_cu_seqlens([b - a for a, b in zip(starts, starts[1:] + [T])], T, tg.max_num_docs_for(T))
    return ids[:-1].to(torch.int32), ids[1:].to(torch.int64), cu


def traceable_attention(qkv, ve, gate, cos, sin, cu_seqlens, max_seqlen, window_table, window_row):
    """A stand-in for `attention` that torch.compile can trace (the CPU's reference attention loops over documents in
    Python): the plain q/k norm and rotary, v (+ ve), the window table's row used as data, as the real kernels use
    it, and the gate. No mixing across tokens: these tests are about graphs, not attention."""
    q, k, v = qkv.chunk(3, dim=1)
    q, k = tg.rotary(tg.norm(q), cos, sin), tg.rotary(tg.norm(k), cos, sin)
    if ve is not None:
        v = v + ve
    y = v * (window_table[window_row, 0] * window_table[window_row, 1]).to(v.dtype) + q * k
    return y * torch.sigmoid(gate)[..., None]


TRACEABLE = dict(PLAIN, attention=traceable_attention)


# ----------------------------------------------------------------------------------------------------
# init loss
# ----------------------------------------------------------------------------------------------------

def test_init_loss_eval_is_mean_ln_vocab(model):
    inputs, targets, cu = random_batch(256)
    model.eval()
    with torch.no_grad(), tg.bf16_gemms_in_fp32():  # as the CPU trainer runs where bf16 GEMMs are slow
        loss = model(inputs, targets, cu, 1, 3, 256)
    model.train()
    assert loss.ndim == 0 and loss.dtype == torch.float32
    assert loss.item() == pytest.approx(math.log(VOCAB_PADDED), abs=1e-4)  # 10.8258
    assert round(loss.item(), 4) == 10.8258


def test_init_loss_train_is_sum(model):
    T = 256
    inputs, targets, cu = random_batch(T, seed=1)
    model.train()
    with torch.no_grad(), tg.bf16_gemms_in_fp32():
        loss = model(inputs, targets, cu, 1, 3, 256)
    # Training keeps bf16 logits (as the record does) but sums the per-token losses in fp32
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(T * math.log(VOCAB_PADDED), rel=1e-5)
    assert loss.float().item() > 100  # clearly a sum, not a mean


def test_all_logits_15_at_init(model):
    # lm_head is zero-initialised -> logits 0 -> softcap 30*sigmoid(0) = 15 for every class
    assert torch.count_nonzero(model.lm_head.weight) == 0


def test_evaluation_runs_the_head_in_chunks_and_returns_the_mean_of_the_whole_batch(monkeypatch):
    """Evaluation sums the head's loss over EVAL_HEAD_CHUNK-token chunks (a ragged last one included) and divides by
    every token: the mean the unchunked head gives."""
    m = make_model(seed=2, max_seq_len=256, args=TINY)
    with torch.no_grad():
        m.lm_head.weight.normal_(0, 0.05)
    inputs, targets, cu = random_batch(256, seed=3)
    m.eval()
    with torch.no_grad(), tg.bf16_gemms_in_fp32():
        x = m.trunk(inputs, cu, m.window_table(1, 3), 256)
        whole = tg.lm_head_loss(x, m.lm_head.weight, targets, fp8=False) / 256
        sizes = []
        real_head = m._head
        m._head = lambda x, t: sizes.append(len(t)) or real_head(x, t)
        monkeypatch.setattr(tg, "EVAL_HEAD_CHUNK", 100)
        chunked = m(inputs, targets, cu, 1, 3, 256)
    m.train()
    assert sizes == [100, 100, 56]
    torch.testing.assert_close(chunked, whole, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------------------
# YaRN / rotary
# ----------------------------------------------------------------------------------------------------

def test_yarn_base_frequencies():
    y = tg.Yarn(128, 64)
    k = torch.arange(32, dtype=torch.float64)
    expected = torch.cat([(1 / 1024) ** (k / 31), torch.zeros(32, dtype=torch.float64)])
    assert y.freqs.shape == (64,)
    torch.testing.assert_close(y.freqs.double(), expected, rtol=1e-6, atol=0)
    assert y.attn_scale == 0.1
    assert y.cos.dtype == torch.bfloat16 and y.sin.dtype == torch.bfloat16
    assert y.cos.shape == (64, 64)
    pos = torch.arange(64, dtype=torch.float64)[:, None]
    torch.testing.assert_close(y.cos.double(), torch.cos(pos * expected), atol=8e-3, rtol=0)
    torch.testing.assert_close(y.sin.double(), torch.sin(pos * expected), atol=8e-3, rtol=0)


def test_yarn_set_window_stretches_only_on_a_change_and_follows_direct_stretches():
    y = tg.Yarn(128, 256)
    y.set_window(3)  # the first call only records the window
    assert y.attn_scale == 0.1 and y.window == 3
    y.set_window(3)
    assert y.attn_scale == 0.1
    y.stretch(3, 7)
    scale = y.attn_scale
    y.set_window(7)  # already there: a direct stretch moved the window too
    assert y.attn_scale == scale and y.window == 7
    y.set_window(11)
    assert y.attn_scale > scale and y.window == 11


def test_yarn_attn_scale_sequence_and_reset():
    y = tg.Yarn(128, 256)
    fresh = (y.freqs.clone(), y.cos.clone(), y.sin.clone())
    scales = [y.attn_scale]
    for old, new in [(3, 7), (7, 11), (11, 13)]:
        y.stretch(old, new)
        scales.append(y.attn_scale)
    assert scales == pytest.approx([0.1, 0.116946, 0.127518, 0.131778], abs=1e-6)
    assert not torch.equal(y.freqs, fresh[0])
    assert not torch.equal(y.cos, fresh[1])
    cos_buf = y.cos
    y.reset()
    assert y.attn_scale == 0.1
    assert torch.equal(y.freqs, fresh[0])
    assert torch.equal(y.cos, fresh[1]) and torch.equal(y.sin, fresh[2])
    assert y.cos is cos_buf  # tables rewritten in place (compiled graphs keep the same buffer)


def test_yarn_stretch_formula():
    y = tg.Yarn(128, 32)
    f0 = y.freqs.double().clone()
    y.stretch(3, 7)
    r = 128 * 3 * f0 / (2 * math.pi)
    gamma = ((r - 1) / (32 - 1)).clamp(0, 1)
    rho = 3 / 7
    expected = f0 * (rho + gamma * (1 - rho))
    torch.testing.assert_close(y.freqs.double(), expected, rtol=1e-6, atol=0)
    # the fastest frequency (1 rad/token, 61 turns per 384 tokens) is kept, the slowest is interpolated by 3/7
    assert y.freqs[0].item() == pytest.approx(1.0)
    assert y.freqs[31].item() == pytest.approx(f0[31].item() * 3 / 7, rel=1e-6)
    assert torch.count_nonzero(y.freqs[32:]) == 0


def test_yarn_buffers_not_in_state_dict(model):
    keys = model.state_dict().keys()
    assert not any("cos" in k or "sin" in k for k in keys)


def test_rotary_zero_frequency_half_unchanged_and_norm_preserved():
    y = tg.Yarn(128, 512)
    y.stretch(3, 7)
    torch.manual_seed(0)
    x = torch.randn(512, 3, 128)
    out = tg.rotary(x, y.cos, y.sin)
    assert out.shape == x.shape
    # pairs 32..63 have zero frequency: dims 32..63 (x1) and 96..127 (x2) pass through exactly
    assert torch.equal(out[..., 32:64], x[..., 32:64])
    assert torch.equal(out[..., 96:128], x[..., 96:128])
    # position 0: cos=1, sin=0 -> identity
    assert torch.equal(out[0], x[0])
    # rotation preserves each (x1, x2) pair's norm, up to the bf16 tables' rounding
    pair_in = x[..., :64] ** 2 + x[..., 64:] ** 2
    pair_out = out[..., :64] ** 2 + out[..., 64:] ** 2
    torch.testing.assert_close(pair_out, pair_in, rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=5e-3, atol=0)


def test_rotary_direction_and_the_first_rows_of_longer_tables():
    # y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos (half-truncated rotary); token t reads row t of tables that may be
    # longer than the sequence (the model's cover its longest micro-batch)
    y = tg.Yarn(8, 16)
    x = torch.zeros(4, 1, 8)
    x[:, 0, 0] = 1.0  # x1 of pair 0 (frequency 1)
    out = tg.rotary(x, y.cos, y.sin)
    assert out.shape == x.shape
    for t in range(4):
        c, s = y.cos[t, 0].float(), y.sin[t, 0].float()
        assert out[t, 0, 0].item() == pytest.approx(c.item())
        assert out[t, 0, 4].item() == pytest.approx(-s.item())
    assert out[1, 0, 0].item() == pytest.approx(math.cos(1.0), abs=4e-3)  # one radian at token 1


# ----------------------------------------------------------------------------------------------------
# reference attention vs a dense masked SDPA over the whole packed sequence
# ----------------------------------------------------------------------------------------------------

def dense_mask(cu, T, window):
    """(T, T) bool: query i may see key j (same document, causal, at most `window` tokens back)."""
    doc = torch.full((T,), -1, dtype=torch.long)
    bounds = cu.tolist()
    for d, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        doc[a:b] = d
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    return (doc[:, None] == doc[None, :]) & (j <= i) & (i - j <= window)


def dense_reference(q, k, v, cu, scale, window):
    mask = dense_mask(cu, q.size(0), window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         attn_mask=mask, scale=scale)
    return out.transpose(0, 1)


def window_table(scale, window, short_window=None):
    """The CPU tensor GPT.window_table builds: rows [scale, window in tokens] of the short (0) and long (1) window."""
    short = window if short_window is None else short_window
    return torch.tensor([[scale, short], [scale, window]], dtype=torch.float64)


@pytest.mark.parametrize("window", [0, 1, 5, 17, 64, 1000])
def test_attention_reference_matches_dense_sdpa(window):
    torch.manual_seed(window)
    T, H, D = 96, 3, 16
    q, k, v = (torch.randn(T, H, D, dtype=torch.float64) for _ in range(3))
    lengths = [1, 30, 7, 40, 18]  # includes a one-token document; window 1000 >= every length
    assert sum(lengths) == T
    cu = tg.pack_cu_seqlens(lengths, T, 16)  # padded with T: zero-length tail entries
    assert cu.tolist()[-3:] == [T, T, T]
    out = tg.attention_reference(q, k, v, cu, max(lengths), window_table(0.37, window), 1)
    assert out.dtype == torch.float64 and out.shape == q.shape
    # attention_reference computes in fp32 (`.float()`) whatever the input dtype, so fp32-level tolerance
    torch.testing.assert_close(out, dense_reference(q, k, v, cu, 0.37, window), rtol=1e-5, atol=1e-5)


def test_attention_reference_no_cross_document_leak():
    torch.manual_seed(0)
    T, H, D = 32, 2, 8
    q, k, v = (torch.randn(T, H, D, dtype=torch.float64) for _ in range(3))
    cu = tg.pack_cu_seqlens([10, 22], T, 8)
    out = tg.attention_reference(q, k, v, cu, 22, window_table(0.5, 100), 0)
    v2 = v.clone()
    v2[:10] += 100.0  # changing document 0 must not change document 1's output
    out2 = tg.attention_reference(q, k, v2, cu, 22, window_table(0.5, 100), 0)
    assert torch.equal(out[10:], out2[10:])
    # the first token of each document attends only to itself
    torch.testing.assert_close(out[10], v[10])


# ----------------------------------------------------------------------------------------------------
# the record's parameter table, scalars layout and layer map
# ----------------------------------------------------------------------------------------------------

def test_layer_map(model):
    attn = [i for i, b in enumerate(model.blocks) if b.attn is not None]
    mlp = [i for i, b in enumerate(model.blocks) if b.mlp is not None]
    assert len(model.blocks) == 12
    assert attn == [1, 2, 3, 4, 5, 6, 8, 9, 10, 11]
    assert mlp == list(range(1, 12))
    assert len(model.value_embeds) == 3
    assert model.layers == tg.layer_map(12)


def test_the_layer_map_of_12_layers_is_the_records():
    m = tg.layer_map(12)
    assert m.num_layers == 12
    assert m.no_attention == (0, 7) and m.no_mlp == (0,)
    assert m.long_window == (4, 11)
    assert dict(m.value_embeds) == {1: 1, 2: 2, 9: 0, 10: 1, 11: 2} and len(m.value_embeds) == 5
    assert (m.skip_from, m.skip_to, m.backout_from) == (4, 7, 8)
    assert m.skip_weight == 1  # the record's skip reads scalars[1]
    assert m.num_scalars == 62
    assert m.line() == ("layers: 12 blocks; no attention in [0, 7], no MLP in [0]; long window in [4, 11]; value "
                        "embeddings 1<-1, 2<-2, 9<-0, 10<-1, 11<-2; skip 4 -> 7; backout from 8; 62 scalars")


@pytest.mark.parametrize("layers", [11, 16])
def test_other_layer_counts_build_from_their_layer_map_and_run_a_forward_on_the_cpu(layers):
    args = dataclasses.replace(TINY, num_layers=layers)
    m = make_model(max_seq_len=128, args=args)
    lm = m.layers
    assert lm == tg.layer_map(layers) and len(m.blocks) == layers
    assert [i for i, b in enumerate(m.blocks) if b.attn is None] == list(lm.no_attention)
    assert [i for i, b in enumerate(m.blocks) if b.mlp is None] == list(lm.no_mlp)
    assert all(m.blocks[b].attn is not None for b, _ in lm.value_embeds)
    assert m.scalars.shape == (lm.num_scalars,) == (5 * layers + 2,)
    assert 1 <= lm.skip_from < lm.skip_to < layers and 1 <= lm.backout_from < layers
    inputs, targets, cu = random_batch(128, seed=layers)
    with torch.no_grad(), tg.bf16_gemms_in_fp32():
        loss = m(inputs, targets, cu, 1, 3, 128)
    assert loss.ndim == 0 and loss.item() == pytest.approx(128 * math.log(VOCAB_PADDED), rel=1e-5)  # lm_head is 0


def test_fewer_than_9_layers_are_refused_at_parse_time_naming_layer_map():
    tg.parse_args(["--num-layers", "9"])  # the rule's smallest count
    with pytest.raises(tg.ConfigError) as e:
        tg.parse_args(["--num-layers", "8"])
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith("--num-layers 8: the layer map cannot work (")
    assert "edit layer_map() (its rule covers 9 layers or more), or pick another --num-layers" in message


@pytest.mark.parametrize("edit,problem", [
    (dict(long_window=(4, 7)), "long_window names block 7, which has no attention"),
    (dict(value_embeds=((7, 0),)), "value_embeds gives block 7 table 0, but block 7 has no attention or table 0 "
                                   "is not one of 0, 1, 2"),
    (dict(skip_from=7, skip_to=4), "the skip 7 -> 4 and the backout from 8 must be blocks 1..11, the skip forward"),
    (dict(no_mlp=(0, 12)), "no_mlp names block 12, not one of 0..11")])
def test_a_layer_map_that_cannot_work_is_one_line_naming_its_problem_and_layer_map(edit, problem):
    with pytest.raises(tg.ConfigError) as e:
        dataclasses.replace(tg.layer_map(12), **edit).check()
    assert str(e.value) == (f"--num-layers 12: the layer map cannot work ({problem}): edit layer_map() (its rule "
                            "covers 9 layers or more), or pick another --num-layers")


def test_parameter_table(model):
    d = SMOKE.model_dim
    V = VOCAB_PADDED
    rows = {}
    for name, p in model.named_parameters():
        rows[name] = (tuple(p.shape), p.label, p.treatment, p.lr_mul, p.dtype)
    expect = {
        "embed.weight": ((V, d), "embed", "adam", 75.0, torch.bfloat16),
        "smear_gate.weight": ((1, 12), "smear_gate", "gate", 1.0, torch.bfloat16),
        "lm_head.weight": ((V, d), "lm_head", "adam", 1.0, torch.bfloat16),
        "scalars": ((62,), "scalars", "adam", 5.0, torch.float32),
    }
    for k in range(3):
        expect[f"value_embeds.{k}.weight"] = ((V, d), "value_embed", "adam", 75.0, torch.bfloat16)
    for i in range(12):
        if i not in (0, 7):
            expect[f"blocks.{i}.attn.qkvo_w"] = ((4 * d, d), "attn", "qkvo", 1.0, torch.float32)
            expect[f"blocks.{i}.attn.attn_gate.weight"] = ((SMOKE.num_heads, 12), "attn_gate", "gate", 1.0,
                                                           torch.bfloat16)
        if i != 0:
            expect[f"blocks.{i}.mlp.c_fc"] = ((4 * d, d), "mlp", "matrix", 1.0, torch.float32)
            expect[f"blocks.{i}.mlp.c_proj"] = ((4 * d, d), "mlp", "matrix", 2.0, torch.float32)
    assert rows == expect
    assert tg.GATE_INPUTS == 12
    tg.check_optimizer_labels(model)  # the record's labels work at 1, 2, 4 and 8 processes


def test_parameter_table_full_size_counts():
    # the record's parameter counts at its dims, built on the meta device (no memory)
    with torch.device("meta"):
        m = tg.GPT(tg.Hyperparameters(), max_seq_len=16)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes["embed.weight"] == (50304, 768)
    assert shapes["blocks.1.attn.qkvo_w"] == (3072, 768)
    assert shapes["blocks.1.mlp.c_fc"] == (3072, 768)
    assert shapes["blocks.1.mlp.c_proj"] == (3072, 768)
    assert shapes["blocks.1.attn.attn_gate.weight"] == (6, 12)
    assert shapes["scalars"] == (62,)  # DistAdam pads them to 64 on 8 GPUs, in its own buffers
    total = sum(p.numel() for p in m.parameters())
    # embed + 3 value embeds + lm_head, 10 qkvo + 11 c_fc + 11 c_proj, smear gate, 10 attn gates, scalars
    assert total == 5 * 38_633_472 + 32 * 2_359_296 + 12 + 10 * 72 + 62
    assert round(total / 1e6, 1) == 268.7


@pytest.mark.parametrize("layers", [9, 11, 12, 16])
def test_the_scalars_follow_the_layer_count(layers):
    with torch.device("meta"):
        m = tg.GPT(dataclasses.replace(SMOKE, num_layers=layers), max_seq_len=16)
    assert m.scalars.shape == (5 * layers + 2,) == (m.layers.num_scalars,)


def test_scalars_init(model):
    s = model.scalars.detach()
    assert torch.all(s[0:12] == -1.5)
    assert torch.allclose(s[12:36].view(12, 2), torch.tensor([1.1, 0.0]).expand(12, 2))
    assert torch.allclose(s[36:60].view(12, 2), torch.tensor([0.5, 1.0]).expand(12, 2))  # SA lambdas (0.5, 1.0), as in the record
    assert s[60].item() == 0.0 and s[61].item() == 0.5


def test_init_values(model):
    d = SMOKE.model_dim
    bound = math.sqrt(3) * 0.5 * d ** -0.5
    for i, b in enumerate(model.blocks):
        if b.attn is not None:
            w = b.attn.qkvo_w.detach()
            assert w[:3 * d].abs().max() <= bound and w[:3 * d].std() > bound / 2
            assert torch.count_nonzero(w[3 * d:]) == 0
            assert torch.count_nonzero(b.attn.attn_gate.weight) == 0
        if b.mlp is not None:
            assert b.mlp.c_fc.detach().abs().max() <= bound
            assert torch.count_nonzero(b.mlp.c_proj) == 0
    assert torch.count_nonzero(model.smear_gate.weight) == 0
    assert model.embed.weight.float().std().item() == pytest.approx(1.0, abs=0.02)
    for ve in model.value_embeds:
        assert ve.weight.float().std().item() == pytest.approx(1.0, abs=0.02)
    assert math.sqrt(3) * 0.5 * 768 ** -0.5 == pytest.approx(1 / 32)


# ----------------------------------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------------------------------

def test_forward_backward_grads_for_all_params():
    m = make_model(seed=3, max_seq_len=256, args=TINY)
    with torch.no_grad():  # make the zero-initialised parameters non-zero so every gradient path is live
        for name, p in m.named_parameters():
            if "lm_head" in name or "c_proj" in name or "gate" in name:
                p.copy_(torch.randn_like(p.float()).mul(0.02).to(p.dtype))
            if name.endswith("qkvo_w"):
                d = p.size(1)
                p[3 * d:] = torch.randn_like(p[3 * d:]) * 0.02
        m.scalars[60] = 0.3  # smear lambda (0 at init would zero the smear gate's gradient)
    inputs, targets, cu = random_batch(128, seed=5)
    with tg.bf16_gemms_in_fp32():  # as the CPU trainer runs where bf16 GEMMs are slow
        loss = m(inputs, targets, cu, 1, 3, 128)
        loss.backward()
    for name, p in m.named_parameters():
        assert p.grad is not None, name
        assert p.grad.shape == p.shape and p.grad.dtype == p.dtype, name
        assert torch.isfinite(p.grad.float()).all(), name
        assert p.grad.float().abs().sum() > 0, name
    # unused scalars: block-0 lambdas and SA lambdas of layers 0 and 7, skip weights other than index 1
    g = m.scalars.grad
    assert torch.all(g[[0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]] == 0)
    assert g[1] != 0
    assert torch.all(g[12:14] == 0) and torch.all(g[36:38] == 0) and torch.all(g[36 + 14:36 + 16] == 0)


def test_bf16_cpu_gemms_run_in_fp32_rounded_once_inside_the_context_and_on_atens_kernels_after_it(monkeypatch):
    """Inside bf16_gemms_in_fp32() each GEMM op (mm, addmm, bmm, baddbmm; the backward's too) is an fp32 GEMM of the
    widened bf16 operands rounded once, an fp32 GEMM is ATen's as it was; after it no GEMM reaches those kernels."""
    calls = []
    made = tg.gemm_in_fp32
    monkeypatch.setattr(tg, "gemm_in_fp32", lambda op: lambda *a, **k: calls.append(op.name()) or made(op)(*a, **k))
    g = torch.Generator().manual_seed(0)
    a, b, bias = torch.randn(2, 48, 64, generator=g), torch.randn(2, 64, 40, generator=g), torch.randn(40, generator=g)
    a16, b16, bias16 = a.bfloat16(), b.bfloat16(), bias.bfloat16()
    x = a16[0].clone().requires_grad_()
    w = b16[0].t().contiguous().requires_grad_()
    gy = torch.randn(48, 40, generator=g).bfloat16()
    with tg.bf16_gemms_in_fp32():
        got = [torch.mm(a16[0], b16[0]), torch.addmm(bias16, a16[0], b16[0]), torch.bmm(a16, b16),
               torch.baddbmm(bias16, a16, b16), torch.mm(a[0], b[0])]
        F.linear(x, w).backward(gy)
    wide = [t.float() for t in (a16, b16, bias16)]
    expected = [torch.mm(wide[0][0], wide[1][0]).bfloat16(), torch.addmm(wide[2], wide[0][0], wide[1][0]).bfloat16(),
                torch.bmm(wide[0], wide[1]).bfloat16(), torch.baddbmm(wide[2], wide[0], wide[1]).bfloat16(),
                torch.mm(a[0], b[0])]
    for name, mine, theirs in zip(("mm", "addmm", "bmm", "baddbmm", "fp32 mm"), got, expected):
        assert mine.dtype == theirs.dtype and torch.equal(mine, theirs), name
    assert torch.equal(x.grad, gy.float().mm(w.float()).bfloat16())
    assert torch.equal(w.grad, x.float().t().mm(gy.float()).t().bfloat16())
    assert {"aten::mm.out", "aten::addmm.out", "aten::bmm.out", "aten::baddbmm.out"} == set(calls)
    seen = len(calls)
    torch.mm(a16[0], b16[0]), torch.bmm(a, b)
    F.linear(x, w).backward(gy)
    assert len(calls) == seen


def test_gpt_supports_module_apply():
    m = make_model(max_seq_len=16)
    seen = []
    m.apply(lambda mod: seen.append(type(mod).__name__))
    assert "Yarn" in seen and "GPT" in seen


def test_the_model_calls_the_functions_it_is_given_and_the_plain_ones_by_default():
    assert make_model(max_seq_len=16).kernels == PLAIN
    assert make_model(max_seq_len=16).lm_head.loss_fn is tg.lm_head_loss
    calls = []

    def recording(name):
        def call(*args):
            calls.append(name)
            return PLAIN[name](*args)
        return call

    m = make_model(max_seq_len=128, kernels={name: recording(name) for name in PLAIN}, args=TINY)
    m(*random_batch(128, seed=2), 1, 3, 128)
    # 10 attention layers, 11 MLPs, one head
    assert sorted(set(calls)) == sorted(PLAIN) and calls.count("attention") == calls.count("attention_output") == 10
    assert calls.count("mlp") == 11 and calls.count("lm_head_loss") == 1


# ----------------------------------------------------------------------------------------------------
# compiled regions: one graph for every stage (symbolic token dimension, windows and YaRN scale as data), the same
# numbers as eager, lm_head's backward first
# ----------------------------------------------------------------------------------------------------

def _compiled_backward_nodes(loss):
    """Autograd nodes reachable from loss, in root-first BFS order, with their AccumulateGrad children."""
    seen, order, queue = set(), [], [loss.grad_fn]
    while queue:
        node = queue.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        order.append(node)
        queue.extend(fn for fn, _ in node.next_functions)
    return [n for n in order if "CompiledFunction" in type(n).__name__]


def model_pair(seed, max_seq_len, head_seed, kernels=TRACEABLE, output_projections=False, args=TINY):
    """Two identical models (an eager one and one to compile) with a non-zero lm_head, so gradients flow;
    output_projections: non-zero attention output projections too, so the attention inputs, gates and value
    embeddings get gradients."""
    pair = tuple(make_model(seed=seed, max_seq_len=max_seq_len, kernels=kernels, args=args) for _ in range(2))
    head = torch.randn(pair[0].lm_head.weight.shape, generator=torch.Generator().manual_seed(head_seed)).mul(0.02)
    for m in pair:
        g = torch.Generator().manual_seed(head_seed + 1)
        with torch.no_grad():
            m.lm_head.weight.copy_(head.bfloat16())
            for block in m.blocks if output_projections else ():
                if block.attn is not None:
                    d = block.attn.dim
                    block.attn.qkvo_w[3 * d:].copy_(torch.randn(d, d, generator=g) * 0.05)
    return pair


def pair_losses(pair, T=128, seed=7):
    """Both models' training losses on one random batch, backward done (gradients in .grad)."""
    inputs, targets, cu = random_batch(T, seed=seed)
    losses = [m(inputs, targets, cu, 1, 3, T) for m in pair]
    for loss in losses:
        loss.backward()
    return losses


@pytest.fixture(scope="module")
def compiled_pair():
    """An eager model and its twin compiled per region (aot_eager), shared by the tests below: each compilation of
    the 12 blocks costs tens of CPU seconds."""
    eager, compiled = model_pair(seed=11, max_seq_len=512, head_seed=2, output_projections=True)
    compiled.compile_regions(backend="aot_eager", dynamic=False, fullgraph=True)
    yield eager, compiled
    torch._dynamo.reset()


@pytest.fixture
def pair(compiled_pair):
    """The shared pair with no gradients and fresh YaRN tables, before and after the test."""
    def fresh():
        for m in compiled_pair:
            m.zero_grad(set_to_none=True)
            m.yarn.reset()
    fresh()
    yield compiled_pair
    fresh()


def test_only_a_compiled_model_marks_the_token_dimension_dynamic(pair):
    """Compiled, the batch tensors' token dimension is marked dynamic (one graph for every micro-batch length);
    eager, the inputs are left as they are."""
    eager, compiled = pair
    inputs, targets, cu = random_batch(128, seed=6)
    eager(inputs, targets, cu, 1, 3, 128)
    assert not any(hasattr(t, "_dynamo_dynamic_indices") for t in (inputs, targets, cu))
    compiled(inputs, targets, cu, 1, 3, 128)
    assert all(0 in t._dynamo_dynamic_indices for t in (inputs, targets, cu))


def test_compiled_regions_compute_the_same_loss_and_grads_as_eager(pair):
    losses = pair_losses(pair)
    assert torch.equal(losses[0], losses[1])
    eager, compiled = pair
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        assert p.grad is None or torch.equal(p.grad, q.grad), name


def test_compiled_regions_give_lm_head_its_own_backward_graph_that_runs_before_the_trunk(pair):
    """DistAdam's lm_head reduce-scatter can only overlap the trunk's backward if lm_head's gradient comes out of a
    separate, earlier backward graph (a whole-model compile would release every gradient at the very end)."""
    _, m = pair
    trunk_params = [p for n, p in m.named_parameters() if "lm_head" not in n]
    seen_when_lm_head_ready = []
    handle = m.lm_head.weight.register_post_accumulate_grad_hook(
        lambda p: seen_when_lm_head_ready.append(sum(q.grad is not None for q in trunk_params)))
    inputs, targets, cu = random_batch(128, seed=6)
    loss = m(inputs, targets, cu, 1, 3, 128)
    nodes = _compiled_backward_nodes(loss)
    assert len(nodes) == 2, "expected one backward graph for the head and one for the trunk"
    head_leaves = {id(fn.variable) for fn, _ in nodes[0].next_functions if hasattr(fn, "variable")}
    assert id(m.lm_head.weight) in head_leaves and not head_leaves & {id(p) for p in trunk_params}
    loss.backward()
    handle.remove()
    assert seen_when_lm_head_ready == [0]  # no trunk gradient existed yet when lm_head's hook fired
    assert all(p.grad is not None for p in trunk_params)


def test_one_compiled_graph_serves_every_batch_size_window_and_yarn_scale(pair):
    """A compiled model marks the token dimension dynamic, so the warm-up's first graph must serve all later stages:
    a new micro-batch length, new windows and a YaRN-stretched table and scale run under fail_on_recompile and give
    the eager model's loss/grads."""
    eager, compiled = pair
    inputs, targets, cu = random_batch(128, seed=12)
    compiled(inputs, targets, cu, 1, 3, 128).backward()  # "warm-up": the only compilation (if no test made it yet)
    compiled.zero_grad(set_to_none=True)
    for m in (eager, compiled):
        m.yarn.stretch(3, 7)
    inputs, targets, cu = random_batch(384, num_docs=9, seed=13)
    cu = torch.cat([cu, torch.full((128,), 384, dtype=cu.dtype)])  # a longer cu_seqlens too (next stage)
    with tg.no_compiles_allowed(True):
        loss_c = compiled(inputs, targets, cu, 3, 7, 128)
        loss_c.backward()
    loss_e = eager(inputs, targets, cu, 3, 7, 128)
    loss_e.backward()
    assert torch.equal(loss_c, loss_e)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_window_table_is_a_fresh_cpu_tensor_of_scale_and_windows_in_tokens(model):
    model.yarn.reset()
    table = model.window_table(3, 7)
    assert table.device.type == "cpu" and table.dtype == torch.float64
    assert table.tolist() == [[0.1, 3 * 128], [0.1, 7 * 128]]
    assert model.window_table(3, 7) is not table  # saved for the backward: never mutated in place
    assert tg.scale_and_window(table, 1) == (0.1, 896)
    assert tg.scale_and_window(model.window_table(5, 11), 0) == (0.1, 640)
    assert all(type(v) is t for v, t in zip(tg.scale_and_window(table, 0), (float, int)))


def test_no_compiles_allowed_raises_on_a_new_graph_and_lets_warmed_ones_run():
    f = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False, fullgraph=True)
    f(torch.ones(4))  # "warm-up"
    with tg.no_compiles_allowed(True):
        assert torch.equal(f(torch.ones(4)), torch.full((4,), 3.0))
        with pytest.raises(RuntimeError, match="recompile"):
            f(torch.ones(5))  # new shape: dynamic=False needs a new graph
    with tg.no_compiles_allowed(False):
        assert f(torch.ones(6)).shape == (6,)
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------------------------
# the plain head: lm_head_loss
# ----------------------------------------------------------------------------------------------------

def head_inputs(seed, T=64, V=1000, D=64, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    x = tg.norm(torch.randn(T, D, generator=g)).bfloat16().requires_grad_()
    w = (torch.randn(V, D, generator=g) * spread).bfloat16().requires_grad_()
    return x, w, torch.randint(0, V, (T,), generator=g)


def textbook_loss(x, w, targets):
    """The record's loss in float64: cross-entropy summed over tokens of 30·sigmoid(logits / 7.5)."""
    return F.cross_entropy(30 * torch.sigmoid((x @ w.T) / 7.5), targets, reduction="sum")


def test_softcap_squashes_every_logit_into_zero_to_thirty_around_fifteen():
    z = torch.tensor([-1e4, -7.5, 0.0, 7.5, 1e4], dtype=torch.float64)
    s = 1 / (1 + math.exp(-1))
    torch.testing.assert_close(tg.softcap(z), torch.tensor([0.0, 30 * (1 - s), 15.0, 30 * s, 30.0],
                                                           dtype=torch.float64))
    assert (tg.SOFTCAP, tg.SOFTCAP_WIDTH) == (30.0, 7.5)


def test_lm_head_loss_is_the_textbook_loss_with_autograds_gradient():
    """lm_head_loss (bf16 logits, fp32 softcap and cross-entropy) against the float64 textbook loss, logits large
    enough to saturate the softcap; its gradients, in the parameters' bf16, are float64 autograd's to bf16 rounding."""
    x, w, targets = head_inputs(8, spread=3.0)
    loss = tg.lm_head_loss(x, w, targets, fp8=False)
    loss.backward()
    xd, wd = (t.detach().double().requires_grad_() for t in (x, w))
    ref = textbook_loss(xd, wd, targets)
    ref.backward()
    assert (x @ w.T).abs().max() > 60  # saturated: |logit| / 7.5 > 8
    assert loss.ndim == 0 and loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref.item(), rel=1e-4)  # the bf16 logits' rounding
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    for got, exact in ((x.grad, xd.grad), (w.grad, wd.grad)):
        assert ((got.double() - exact).norm() / exact.norm()).item() < 1e-2


def test_lm_head_loss_compiled_matches_eager():
    x, w, targets = head_inputs(9, T=32, V=50304)
    eager = tg.lm_head_loss(x, w, targets, False)
    eager.backward()
    grads = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    compiled = torch.compile(tg.lm_head_loss, dynamic=False, fullgraph=True)(x, w, targets, False)
    compiled.backward()
    torch._dynamo.reset()
    assert compiled.item() == pytest.approx(eager.item(), rel=1e-5)
    for got, ref in zip((x.grad, w.grad), grads):
        assert ((got.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-2


def test_flash_varlen_op_runs_forward_and_backward_on_meta_tensors():
    """The FlashAttention custom op's fake kernels and autograd plumbing (the real kernels need CUDA): shapes and
    dtypes of out/lse and of dq/dk/dv, with the window and scale passed as a CPU tensor."""
    q, k, v = (torch.empty(256, 6, 128, dtype=torch.bfloat16, device="meta", requires_grad=True) for _ in range(3))
    cu = torch.empty(128, dtype=torch.int32, device="meta")
    table = torch.empty(2, 2, dtype=torch.float64)
    out, lse, rng = torch.ops.speedrun.flash_varlen(q, k, v, cu, 2048, table, 1)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert lse.shape == (6, 256) and lse.dtype == torch.float32
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert dq.shape == dk.shape == dv.shape == q.shape and dq.dtype == torch.bfloat16


def test_varlen_attention_op_autograd_wiring_traces_with_its_fakes():
    """Forward and backward of the varlen attention op under FakeTensorMode (what torch.compile traces): the
    autograd registration must hand the backward op its arguments in its schema's order."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k, v = (torch.randn(40, 2, 8, requires_grad=True) for _ in range(3))
        cu = torch.zeros(8, dtype=torch.int32)
        out = tg.attention_varlen(q, k, v, cu, 40, window_table(0.5, 16), 1)
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert out.shape == q.shape and dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_attention_on_the_cpu_is_the_reference_on_normed_rotated_q_and_k():
    """The plain `attention` from raw projections: rotary(norm(.)) of q and k, v + ve, then the CPU's reference
    attention, each head scaled by its gate's sigmoid, against the same lines written out over the dense masked SDPA
    (float64)."""
    torch.manual_seed(0)
    T, H, D = 64, 2, 16
    yarn = tg.Yarn(D, 128)
    yarn.stretch(3, 7)
    cos, sin = yarn.cos.double(), yarn.sin.double()
    qkv, ve = torch.randn(T, 3 * H, D, dtype=torch.float64), torch.randn(T, H, D, dtype=torch.float64)
    cu = tg.pack_cu_seqlens([20, 31, 13], T, 8)
    gate = torch.randn(T, H, dtype=torch.float64)
    out = tg.attention(qkv, ve, gate, cos, sin, cu, 31, window_table(0.3, 9, short_window=4), 0)
    q, k, v = qkv.view(T, 3, H, D).unbind(1)
    ref = dense_reference(tg.rotary(tg.norm(q), cos, sin), tg.rotary(tg.norm(k), cos, sin), v + ve, cu, 0.3, 4)
    ref = ref * torch.sigmoid(gate).unsqueeze(-1)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------
# the fused attention: FlashAttention-4 (a stand-in here) with the q/k norm and rotary in one Triton pass
# ----------------------------------------------------------------------------------------------------

class ReferenceFA4:
    """The two internal entry points of flash_attn.cute.interface the op calls, computed with dense_reference (the
    backward written out by hand: custom op bodies run below autograd), recording the arguments they were given."""
    calls = []

    @classmethod
    def _flash_attn_fwd(cls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                        window_size_left, window_size_right, return_lse):
        cls.calls.append(["fwd", softmax_scale, causal, window_size_left, window_size_right, return_lse,
                          max_seqlen_q, cu_seqlens_q is cu_seqlens_k])
        out = dense_reference(q, k, v, cu_seqlens_q, softmax_scale, window_size_left)
        lse = torch.zeros(q.size(1), q.size(0), dtype=torch.float32)  # (heads, tokens), unused by this stand-in
        return out, lse, None, None, None

    @classmethod
    def _flash_attn_bwd(cls, q, k, v, out, dout, lse, softmax_scale, causal, softcap, window_size_left,
                        window_size_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dq, dk, dv):
        """Writes into the dq, dk, dv buffers it is handed (FA4's out arguments, which fa4_gated_qkv uses to put dv
        straight into the qkv gradient)."""
        cls.calls.append(["bwd", softmax_scale, causal, window_size_left, window_size_right, softcap])
        mask = dense_mask(cu_seqlens_q, q.size(0), window_size_left)
        qh, kh, vh, dh = (t.transpose(0, 1) for t in (q, k, v, dout))          # (heads, T, D)
        p = (softmax_scale * qh @ kh.transpose(1, 2)).masked_fill(~mask, float("-inf")).softmax(-1)
        dp = dh @ vh.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        grads = softmax_scale * ds @ kh, softmax_scale * ds.transpose(1, 2) @ qh, p.transpose(1, 2) @ dh
        for buf, g in zip((dq, dk, dv), grads):
            buf.copy_(g.transpose(0, 1))
        return dq, dk, dv


def test_fa4_is_imported_with_its_kernel_cache_on_and_refused_before_hopper(monkeypatch):
    """With flash_attn.cute importable (faked here), fa4_interface() is that module and FA4's on-disk kernel cache is
    switched on (unless the user set the variable); the fused attention's check refuses GPUs before Hopper."""
    import sys
    import types
    fake = types.ModuleType("flash_attn.cute.interface")
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", fake)
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert tg.fa4_on_this_gpu() is fake and tg.fa4_interface() is fake
    assert tg.os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))  # an A100
    with pytest.raises(RuntimeError, match="compute capability 9.0"):
        tg.fa4_on_this_gpu()


def test_fused_attention_op_fakes_trace_forward_and_backward():
    """What torch.compile traces: the fakes' shapes for both ops, with and without the value embedding."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    yarn = tg.Yarn(8, 64)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for ve in (None, torch.randn(40, 2, 8, requires_grad=True)):
            qkv, gate = torch.randn(40, 6, 8, requires_grad=True), torch.randn(40, 2, requires_grad=True)
            args = (qkv, ve, gate, yarn.cos, yarn.sin, torch.zeros(8, dtype=torch.int32), 40, window_table(0.5, 16), 1)
            y, out, lse, qk, v_used, rstd = torch.ops.speedrun.fa4_gated_qkv(*args)
            assert [tuple(t.shape) for t in (y, out, lse, qk, rstd)] == [(40, 2, 8), (40, 2, 8), (2, 40), (40, 4, 8),
                                                                          (40, 4)]
            assert tuple(v_used.shape) == ((40, 2, 8) if ve is not None else (0,))
            assert tuple(tg.fused_attention(*args).shape) == (40, 2, 8)
            grads = torch.autograd.grad(y.sum(), (qkv, gate) if ve is None else (qkv, ve, gate))
            ve_grad = [(40, 2, 8)] if ve is not None else []
            assert [tuple(g.shape) for g in grads] == [(40, 6, 8)] + ve_grad + [(40, 2)]


@pytest.fixture(scope="module")
def interpreter_runs():
    """The Triton-interpreter scripts of this module (below), run together in one fresh process."""
    return run_scripts_in_triton_interpreter(dict(fused_attention=FUSED_ATTENTION_SCRIPT,
                                                  qk_norm_rope=QK_NORM_ROPE_SCRIPT,
                                                  value_embedding=VALUE_EMBEDDING_SCRIPT,
                                                  fa4_preprocess=FA4_PREPROCESS_SCRIPT))


FUSED_ATTENTION_SCRIPT = """
import json, sys, torch
sys.path.insert(0, "tests")
import train_gpt as tg
from test_model import ReferenceFA4, window_table
assert tg._TRITON_INTERPRET
tg.fa4_interface = lambda: ReferenceFA4
out = []
for T, H, D, lengths in [(64, 2, 16, [20, 31, 13]), (37, 3, 32, [1, 26, 10])]:
    for with_ve in (False, True):
        torch.manual_seed(T)
        yarn = tg.Yarn(D, 128)
        yarn.stretch(3, 7)
        cos, sin = yarn.cos.float(), yarn.sin.float()
        cu = tg.pack_cu_seqlens(lengths, T, 8)
        table = window_table(0.3, 9, short_window=4)
        qkv0, ve0, gate0 = torch.randn(T, 3 * H, D) * 2, torch.randn(T, H, D), torch.randn(T, H)
        dout = torch.randn(T, H, D)
        results = []
        for attend in (tg.fused_attention, tg.attention):
            ReferenceFA4.calls = []
            qkv, ve, gate = qkv0.clone().requires_grad_(), ve0.clone().requires_grad_(), gate0.clone().requires_grad_()
            y = attend(qkv, ve if with_ve else None, gate, cos, sin, cu, max(lengths), table, 0)
            grads = torch.autograd.grad(y, (qkv, ve, gate) if with_ve else (qkv, gate), dout)
            results.append((y, grads, ReferenceFA4.calls))
        (y, grads, calls), (ref, ref_grads, _) = results
        rel = lambda a, b: ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()
        out.append(dict(case=[T, H, D, with_ve], max_seqlen=max(lengths), calls=calls, out_rel_err=rel(y, ref),
                        grad_rel_errs=[rel(g, r) for g, r in zip(grads, ref_grads)]))
print(json.dumps(out))
"""


def test_fused_attention_equals_the_plain_attention_forward_and_backward(interpreter_runs):
    """fused_attention (the Triton q/k norm + rotary pass, v + ve, FlashAttention-4 stood in by dense attention; dv
    written into the qkv gradient, ve's gradient = dv; the gate's Triton passes) against the plain `attention` and
    autograd of it, fp32 in the
    Triton interpreter, YaRN-stretched tables, with and without the value embedding; FA4 gets the short window and
    the scale of the table's row 0, causal, in both passes."""
    rows = interpreted(interpreter_runs, "fused_attention")
    assert len(rows) == 4
    for row in rows:
        assert row["calls"] == [["fwd", 0.3, True, 4, 0, True, row["max_seqlen"], True],
                                ["bwd", 0.3, True, 4, 0, 0.0]], row
        assert row["out_rel_err"] < 1e-5, row
        assert len(row["grad_rel_errs"]) == (3 if row["case"][3] else 2) and max(row["grad_rel_errs"]) < 1e-5, row


QK_NORM_ROPE_SCRIPT = """
import json, torch
import train_gpt as tg
assert tg._TRITON_INTERPRET
out = []
for T, H, D in [(37, 2, 16), (64, 3, 32), (5, 1, 8)]:  # T*2H rows: ragged against the 32-row tile
    torch.manual_seed(T)
    yarn = tg.Yarn(D, 128)
    yarn.stretch(3, 7)  # stretched (YaRN) tables, as after a window change
    qkv = (torch.randn(T, 3 * H, D) * 2).float()
    cos, sin = yarn.cos.float(), yarn.sin.float()
    qk, rstd = tg.qk_norm_rope(qkv, cos, sin)  # the kernel (interpreter), fp32
    x = qkv.double().view(T, 3, H, D)[:, :2].reshape(T, 2 * H, D).requires_grad_(True)
    ref = tg.rotary(tg.norm(x), cos.double(), sin.double())  # the plain functions, float64
    d_qk = torch.randn(T, 2 * H, D)
    d_qkv = torch.full_like(qkv, float("nan"))  # the v heads must stay untouched
    tg.qk_norm_rope_backward(d_qk, qkv, rstd, cos, sin, d_qkv)
    ref_grad = torch.autograd.grad(ref, x, d_qk.double())[0]
    out.append(dict(shape=[T, H, D],
                    fwd_rel_err=((qk.double() - ref).abs().max() / ref.abs().max()).item(),
                    rstd_rel_err=((rstd.double() - x.square().mean(-1).add(1.1920929e-07).rsqrt())
                                  .abs().max() / rstd.double().abs().max()).item(),
                    bwd_rel_err=((d_qkv[:, :2 * H].double() - ref_grad).abs().max() / ref_grad.abs().max()).item(),
                    v_untouched=bool(d_qkv[:, 2 * H:].isnan().all()),
                    qk_all_written=not bool(d_qkv[:, :2 * H].isnan().any())))
print(json.dumps(out))
"""


def test_qk_norm_rope_kernels_compute_rotary_of_norm_and_its_gradient(interpreter_runs):
    """The Triton copy of the rotary math, pinned against the plain functions: qk_norm_rope's forward against
    rotary(norm(x)) in float64 (YaRN-stretched tables, ragged last tile), its backward against float64 autograd of
    the same, written into the q and k heads of the qkv gradient only (the v heads are FlashAttention-4's to write).
    An edit of `rotary` or `norm` changes the fused attention's fingerprint (resolve_kernels refuses it); this test
    is what says the kernel computes the functions that fingerprint was taken of."""
    rows = interpreted(interpreter_runs, "qk_norm_rope")
    assert len(rows) == 3
    for row in rows:
        assert row["fwd_rel_err"] < 1e-6 and row["rstd_rel_err"] < 1e-6 and row["bwd_rel_err"] < 1e-5, row
        assert row["v_untouched"] and row["qk_all_written"], row


VALUE_EMBEDDING_SCRIPT = """
import json, torch
import train_gpt as tg
assert tg._TRITON_INTERPRET
out = []
for dtype in (torch.float32, torch.float16):
    for T, H, D in [(37, 6, 128), (1, 2, 64), (129, 3, 32)]:  # ragged against the 8-token tile; 768, 128, 96 wide
        g = torch.Generator().manual_seed(T)
        qkv = torch.randn(T, 3 * H, D, generator=g).to(dtype)
        ve = torch.randn(T, H, D, generator=g).to(dtype)
        v = tg.add_value_embedding(qkv, ve)
        out.append(dict(case=[T, H, D, str(dtype)], equal=torch.equal(v, qkv.chunk(3, dim=1)[2] + ve),
                        contiguous=v.is_contiguous(), shape=list(v.shape)))
print(json.dumps(out))
"""


def test_value_embedding_pass_equals_the_plain_addition_of_the_strided_v_heads(interpreter_runs):
    """The Triton pass adding ve to qkv's v heads (interpreter; fp32 and fp16: the interpreter's cast to bf16
    truncates where GPUs round): bit-identical to the plain attention's `v + ve` on the strided view, written
    contiguous."""
    rows = interpreted(interpreter_runs, "value_embedding")
    assert len(rows) == 6
    for row in rows:
        assert row["equal"] and row["contiguous"] and row["shape"] == row["case"][:3], row


# FlashAttention-4 4.0.0b36's backward preprocess on sm90 (bench/notes/fa4_backward_sm90.md), written out: per head,
# document b's rows from the padded row cu[b] + 64·b - cu[b] % 64 on, in whole 64-row tiles; dpsum = the row sums of
# dout·out (0 past the document), lse_log2 = lse·log2(e) (0 for -inf, +inf past the document), and each tile's
# 64 x head_dim floats of the dQ accumulator zeroed. Rows between documents are not FA4's to write: NaN here.
FA4_PREPROCESS_SCRIPT = """
import json, math, sys, torch
sys.path.insert(0, "tests")
import train_gpt as tg
from test_model import ReferenceFA4, window_table
assert tg._TRITON_INTERPRET


def reference_preprocess(out, dout, lse, cu, padded_rows):
    T, H, D = out.shape
    dpsum, lse_log2 = torch.full((H, padded_rows), float("nan")), torch.full((H, padded_rows), float("nan"))
    accum = torch.full((H, padded_rows * D), float("nan"))
    for b in range(cu.numel() - 1):
        start, length = int(cu[b]), int(cu[b + 1] - cu[b])
        padded, rows = start + 64 * b - start % 64, (length + 63) // 64 * 64
        sums = (dout[start:start + length].float() * out[start:start + length].float()).sum(-1).t()
        dpsum[:, padded:padded + rows] = 0.0
        dpsum[:, padded:padded + length] = sums
        lse_log2[:, padded:padded + rows] = float("inf")
        tokens = lse[:, start:start + length]
        lse_log2[:, padded:padded + length] = torch.where(tokens == float("-inf"), 0.0, tokens * math.log2(math.e))
        accum[:, padded * D:(padded + rows) * D] = 0.0
    return dpsum, lse_log2, accum


class PreprocessingFA4(ReferenceFA4):
    # Hands its preprocess FA4's buffers (NaN-filled), as FA4's backward does, and keeps what was written there.
    lse = None

    @classmethod
    def _flash_attn_fwd(cls, q, *args, **kwargs):
        out, _, *rest = super()._flash_attn_fwd(q, *args, **kwargs)
        return (out, cls.lse, *rest)

    @classmethod
    def _bwd_preprocess(cls, out, dout, dpsum, lse, lse_log2, dq_accum, cu_seqlens_q, seqused_q, dlse, dtype,
                        head_dim, head_dim_v, m_block_size, row_max=None, scale_p=None, use_padded_offsets=True,
                        nheads_major=False, pack_gqa=False, qhead_per_kvhead=1, nheads_kv=1, softmax_scale=1.0,
                        cu_total_m_blocks=None, hdim_multiple_of=32, o_lo=None, *, fake_mode=False):
        cls.own_preprocess_ran = True
        for buf, value in zip((dpsum, lse_log2, dq_accum), reference_preprocess(out, dout, lse, cu_seqlens_q,
                                                                                dpsum.size(1))):
            buf.copy_(value)

    @classmethod
    def _flash_attn_bwd(cls, q, k, v, out, dout, lse, softmax_scale, causal, softcap, window_size_left,
                        window_size_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dq, dk, dv):
        T, H, D = q.shape
        docs = cu_seqlens_q.numel() - 1
        padded_rows = (T + 64 * docs + 63) // 64 * 64
        bufs = [torch.full((H, padded_rows), float("nan")), torch.full((H, padded_rows), float("nan")),
                torch.full((H, padded_rows * D), float("nan"))]
        cls._bwd_preprocess(out, dout, bufs[0], lse, bufs[1], bufs[2], cu_seqlens_q, None, None, torch.bfloat16, D, D,
                            64)
        cls.buffers, cls.expected = bufs, reference_preprocess(out, dout, lse, cu_seqlens_q, padded_rows)
        return super()._flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale, causal, softcap, window_size_left,
                                       window_size_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dq,
                                       dk, dv)


tg.fa4_interface = lambda: PreprocessingFA4
out = []
for T, H, lengths in [(200, 2, [64, 1, 70, 65]), (100, 1, [37])]:
    torch.manual_seed(T)
    D = 128
    cu = tg.pack_cu_seqlens(lengths, T, 8)
    yarn = tg.Yarn(D, 256)
    cos, sin = yarn.cos.float(), yarn.sin.float()
    qkv0, gate0, dy = torch.randn(T, 3 * H, D), torch.randn(T, H), torch.randn(T, H, D)
    PreprocessingFA4.lse = torch.randn(H, T) * 3
    PreprocessingFA4.lse[0, 5] = float("-inf")
    results = {}
    for replaceable in (True, False):
        tg.fa4_preprocess_replaceable = lambda: replaceable
        PreprocessingFA4.own_preprocess_ran = False
        qkv, gate = qkv0.clone().requires_grad_(), gate0.clone().requires_grad_()
        y = tg.fused_attention(qkv, None, gate, cos, sin, cu, max(lengths), window_table(0.125, 300), 0)
        grads = torch.autograd.grad(y, (qkv, gate), dy)
        results[replaceable] = (y, grads, PreprocessingFA4.own_preprocess_ran,
                                [b.clone() for b in PreprocessingFA4.buffers], PreprocessingFA4.expected)
    y, grads, own, bufs, expected = results[True]
    same_nan = [bool(torch.equal(b.isnan(), e.isnan())) for b, e in zip(bufs, expected)]
    out.append(dict(case=[T, H, lengths], own_preprocess_ran={str(k): v[2] for k, v in results.items()},
                    same_written=same_nan,
                    dpsum_rel_err=((bufs[0] - expected[0]).nan_to_num().abs().max()
                                   / expected[0].nan_to_num().abs().max()).item(),
                    lse_log2_equal=bool(torch.equal(bufs[1].nan_to_num(), expected[1].nan_to_num())),
                    accum_zeros=bool(torch.equal(bufs[2].nan_to_num(), expected[2].nan_to_num())),
                    grads_equal=[bool(torch.equal(a, b)) for a, b in zip(grads, results[False][1])],
                    y_equal=bool(torch.equal(y, results[False][0]))))
print(json.dumps(out))
"""


def test_the_gate_backward_does_fa4s_preprocess_in_its_buffers_where_fa4_is_the_pinned_version(interpreter_runs):
    """Where FA4 is the version whose buffers it knows (faked here with a stand-in that hands its preprocess
    NaN-filled buffers of FA4's sizes), the attention gate's backward pass writes FA4's dout and also what FA4's
    preprocess writes: the row sums of dout·out (to fp32 rounding), lse in log2 units with 0 for -inf and +inf past
    each document, the dQ accumulator's tiles zeroed, and nothing between documents; FA4's own preprocess does not
    run. Elsewhere FA4's own runs; the output and the qkv and gate gradients are the same either way."""
    rows = interpreted(interpreter_runs, "fa4_preprocess")
    assert len(rows) == 2
    for row in rows:
        assert row["own_preprocess_ran"] == {"True": False, "False": True}, row
        assert row["same_written"] == [True, True, True] and row["dpsum_rel_err"] < 1e-6, row
        assert row["lse_log2_equal"] and row["accum_zeros"], row
        assert row["grads_equal"] == [True, True] and row["y_equal"], row


def test_the_fa4_version_whose_preprocess_the_gate_does_is_the_one_requirements_gpu_pins():
    """A bumped pin without a look at FA4's new buffers would still train (its own preprocess runs, one log line
    says so) but lose the pass: the two move together."""
    from pathlib import Path
    pins = dict(line.split("==") for line in (Path(__file__).resolve().parents[1] / "requirements-gpu.txt")
                .read_text().splitlines() if "==" in line and not line.startswith("#"))
    assert pins["flash-attn-4"].strip() == tg.FA4_PREPROCESS_VERSION
