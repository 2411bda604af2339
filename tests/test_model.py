"""Model: init loss, YaRN, rotary, reference attention, parameter table, layer map, gradients."""
import math

import pytest
import torch
import torch.nn.functional as F

import train_gpt as tg
from interpreter import run_in_triton_interpreter

SMOKE = tg.Hyperparameters(**tg.SMOKE_PRESET)
VOCAB_PADDED = 50304


def make_model(world_size=1, max_seq_len=1024, seed=0, args=SMOKE):
    torch.manual_seed(seed)
    return tg.GPT(args, max_seq_len=max_seq_len, world_size=world_size)


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


# ----------------------------------------------------------------------------------------------------
# init loss
# ----------------------------------------------------------------------------------------------------

def test_init_loss_eval_is_mean_ln_vocab(model):
    inputs, targets, cu = random_batch(256)
    model.eval()
    with torch.no_grad():
        loss = model(inputs, targets, cu, 1, 3, 256)
    model.train()
    assert loss.ndim == 0 and loss.dtype == torch.float32
    assert loss.item() == pytest.approx(math.log(VOCAB_PADDED), abs=1e-4)  # 10.8258
    assert round(loss.item(), 4) == 10.8258


def test_init_loss_train_is_sum(model):
    T = 256
    inputs, targets, cu = random_batch(T, seed=1)
    model.train()
    with torch.no_grad():
        loss = model(inputs, targets, cu, 1, 3, 256)
    # Training keeps bf16 logits (as the record does) but sums the per-token losses in fp32
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(T * math.log(VOCAB_PADDED), rel=1e-5)
    assert loss.float().item() > 100  # clearly a sum, not a mean


def test_all_logits_15_at_init(model):
    # lm_head is zero-initialised -> logits 0 -> softcap 30*sigmoid(0) = 15 for every class
    assert torch.count_nonzero(model.lm_head.weight) == 0


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
    out = y.rotate(x)
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


def test_rotary_direction():
    # y1 = x1 cos + x2 sin, y2 = -x1 sin + x2 cos (half-truncated rotary)
    y = tg.Yarn(8, 4)
    x = torch.zeros(4, 1, 8)
    x[:, 0, 0] = 1.0  # x1 of pair 0 (frequency 1)
    out = y.rotate(x)
    for t in range(4):
        c, s = y.cos[t, 0].float(), y.sin[t, 0].float()
        assert out[t, 0, 0].item() == pytest.approx(c.item())
        assert out[t, 0, 4].item() == pytest.approx(-s.item())


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


def attn_params(scale, window, short_window=None):
    """The CPU tensor GPT.attention_params builds: rows [scale, window] for the short (0) and long (1) window."""
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
    out = tg.attention_reference(q, k, v, cu, max(lengths), attn_params(0.37, window), 1)
    assert out.dtype == torch.float64 and out.shape == q.shape
    # attention_reference computes in fp32 (`.float()`) whatever the input dtype, so fp32-level tolerance
    torch.testing.assert_close(out, dense_reference(q, k, v, cu, 0.37, window), rtol=1e-5, atol=1e-5)


def test_attention_reference_no_cross_document_leak():
    torch.manual_seed(0)
    T, H, D = 32, 2, 8
    q, k, v = (torch.randn(T, H, D, dtype=torch.float64) for _ in range(3))
    cu = tg.pack_cu_seqlens([10, 22], T, 8)
    out = tg.attention_reference(q, k, v, cu, 22, attn_params(0.5, 100), 0)
    v2 = v.clone()
    v2[:10] += 100.0  # changing document 0 must not change document 1's output
    out2 = tg.attention_reference(q, k, v2, cu, 22, attn_params(0.5, 100), 0)
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


def test_parameter_table(model):
    d = SMOKE.model_dim
    V = VOCAB_PADDED
    rows = {}
    for name, p in model.named_parameters():
        rows[name] = (tuple(p.shape), p.label, p.lr_mul, p.dtype)
    expect = {
        "embed.weight": ((V, d), "embed", 75.0, torch.bfloat16),
        "smear_gate.weight": ((1, 12), "smear_gate", 1.0, torch.bfloat16),
        "lm_head.weight": ((V, d), "lm_head", 1.0, torch.bfloat16),
        "scalars": ((62,), "scalars", 5.0, torch.float32),
    }
    for k in range(3):
        expect[f"value_embeds.{k}.weight"] = ((V, d), "value_embed", 75.0, torch.bfloat16)
    for i in range(12):
        if i not in (0, 7):
            expect[f"blocks.{i}.attn.qkvo_w"] = ((4 * d, d), "attn", 1.0, torch.float32)
            expect[f"blocks.{i}.attn.attn_gate.weight"] = ((SMOKE.num_heads, 12), "attn_gate", 1.0, torch.bfloat16)
        if i != 0:
            expect[f"blocks.{i}.mlp.c_fc"] = ((4 * d, d), "mlp", 1.0, torch.float32)
            expect[f"blocks.{i}.mlp.c_proj"] = ((4 * d, d), "mlp", 2.0, torch.float32)
    assert rows == expect


def test_parameter_table_full_size_counts():
    # the record's parameter counts at its dims, built on the meta device (no memory)
    with torch.device("meta"):
        m = tg.GPT(tg.Hyperparameters(), max_seq_len=16, world_size=8)
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes["embed.weight"] == (50304, 768)
    assert shapes["blocks.1.attn.qkvo_w"] == (3072, 768)
    assert shapes["blocks.1.mlp.c_fc"] == (3072, 768)
    assert shapes["blocks.1.mlp.c_proj"] == (3072, 768)
    assert shapes["blocks.1.attn.attn_gate.weight"] == (6, 12)
    assert shapes["scalars"] == (64,)
    total = sum(p.numel() for p in m.parameters())
    # embed + 3 value embeds + lm_head, 10 qkvo + 11 c_fc + 11 c_proj, smear gate, 10 attn gates, scalars
    assert total == 5 * 38_633_472 + 32 * 2_359_296 + 12 + 10 * 72 + 64
    assert round(total / 1e6, 1) == 268.7


@pytest.mark.parametrize("world_size,length", [(1, 62), (2, 62), (4, 64), (8, 64), (3, 63)])
def test_scalars_padding(world_size, length):
    m = make_model(world_size=world_size, max_seq_len=16)
    assert m.scalars.shape == (length,)
    assert m.scalars.shape[0] % world_size == 0
    assert torch.all(m.scalars[62:] == 1.0)


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
    m = make_model(seed=3, max_seq_len=256)
    with torch.no_grad():  # make the zero-initialised parameters non-zero so every gradient path is live
        for name, p in m.named_parameters():
            if "lm_head" in name or "c_proj" in name or "gate" in name:
                p.copy_(torch.randn_like(p.float()).mul(0.02).to(p.dtype))
            if name.endswith("qkvo_w"):
                d = p.size(1)
                p[3 * d:] = torch.randn_like(p[3 * d:]) * 0.02
        m.scalars[60] = 0.3  # smear lambda (0 at init would zero the smear gate's gradient)
    inputs, targets, cu = random_batch(128, seed=5)
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


def test_gpt_supports_module_apply():
    m = make_model(max_seq_len=16)
    seen = []
    m.apply(lambda mod: seen.append(type(mod).__name__))
    assert "Yarn" in seen and "GPT" in seen


def _value_passthrough_attention(q, k, v, cu_seqlens, max_seqlen, params, which):
    return v  # traceable stand-in: these tests are about graph structure, not attention


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


def test_only_a_compiled_model_marks_the_token_dimension_dynamic():
    """Compiled, the batch tensors' token dimension is marked dynamic (one graph for every micro-batch length);
    eager, the inputs are left as they are."""
    m = make_model(seed=4, max_seq_len=128)
    m.attn_fn = _value_passthrough_attention
    inputs, targets, cu = random_batch(128, seed=6)
    m(inputs, targets, cu, 1, 3, 128)
    assert not any(hasattr(t, "_dynamo_dynamic_indices") for t in (inputs, targets, cu))
    m.compile_regions(backend="aot_eager", dynamic=False, fullgraph=True)
    m(inputs, targets, cu, 1, 3, 128)
    torch._dynamo.reset()
    assert all(0 in t._dynamo_dynamic_indices for t in (inputs, targets, cu))


def test_compiled_regions_give_lm_head_its_own_backward_graph_that_runs_before_the_trunk():
    """DistAdam's lm_head reduce-scatter can only overlap the trunk's backward if lm_head's gradient comes out of a
    separate, earlier backward graph (a whole-model compile would release every gradient at the very end)."""
    m = make_model(seed=4, max_seq_len=128)
    with torch.no_grad():
        m.lm_head.weight.normal_(0, 0.02)
    m.attn_fn = _value_passthrough_attention
    m.compile_regions(backend="aot_eager", dynamic=False, fullgraph=True)
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
    torch._dynamo.reset()
    assert seen_when_lm_head_ready == [0]  # no trunk gradient existed yet when lm_head's hook fired
    assert all(p.grad is not None for p in trunk_params)


def model_pair(seed, max_seq_len, head_seed, attn_fn, output_projections=False):
    """Two identical models (an eager one and one to compile) with a non-zero lm_head, so gradients flow;
    output_projections: non-zero attention output projections too, so the attention inputs, gates and value
    embeddings get gradients."""
    pair = make_model(seed=seed, max_seq_len=max_seq_len), make_model(seed=seed, max_seq_len=max_seq_len)
    head = torch.randn(pair[0].lm_head.weight.shape, generator=torch.Generator().manual_seed(head_seed)).mul(0.02)
    for m in pair:
        g = torch.Generator().manual_seed(head_seed + 1)
        with torch.no_grad():
            m.lm_head.weight.copy_(head.bfloat16())
            for block in m.blocks if output_projections else ():
                if block.attn is not None:
                    d = block.attn.dim
                    block.attn.qkvo_w[3 * d:].copy_(torch.randn(d, d, generator=g) * 0.05)
        m.attn_fn = attn_fn
    return pair


def pair_losses(pair, T=128, seed=7):
    """Both models' training losses on one random batch, backward done (gradients in .grad)."""
    inputs, targets, cu = random_batch(T, seed=seed)
    losses = [m(inputs, targets, cu, 1, 3, T) for m in pair]
    for loss in losses:
        loss.backward()
    torch._dynamo.reset()
    return losses


def test_compiled_regions_compute_the_same_loss_and_grads_as_eager():
    eager, compiled = model_pair(seed=5, max_seq_len=128, head_seed=1, attn_fn=_value_passthrough_attention)
    compiled.compile_regions(backend="aot_eager", dynamic=False, fullgraph=True)
    losses = pair_losses((eager, compiled))
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_residual_linear_op_computes_the_residual_plus_projection_and_its_gradients():
    """speedrun::residual_linear against residual + y wᵀ under autograd, in float64 (the CPU path), and
    torch.library's checks of its fake and autograd registrations."""
    g = torch.Generator().manual_seed(4)
    inputs = [torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True)
              for shape in ((32, 24), (32, 16), (24, 16))]
    plain = [t.detach().clone().requires_grad_() for t in inputs]
    out = torch.ops.speedrun.residual_linear(*inputs)
    ref = plain[0] + plain[1] @ plain[2].t()
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(grad)
    ref.backward(grad)
    for a, b in zip(inputs, plain):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)
    torch.library.opcheck(torch.ops.speedrun.residual_linear, [t.detach().requires_grad_() for t in inputs])


def test_residual_linear_model_matches_the_plain_residual_addition_eager_and_compiled():
    """With quack's MLP kernel the model's attention output projections go through residual_linear (CPU path: one
    addmm, fp32 sum of the residual and the product, one rounding); against residual + F.linear (rounds the product
    first): the same loss and gradients up to bf16 rounding, eager and compiled (aot_eager)."""
    wired = tg.GPT(SMOKE, max_seq_len=128, mlp_kernel="quack")
    assert all(b.attn.fused_residual for b in wired.blocks if b.attn is not None)
    assert not any(b.attn.fused_residual for b in make_model(max_seq_len=128).blocks if b.attn is not None)
    for compiled in (False, True):
        plain, fused = model_pair(seed=5, max_seq_len=128, head_seed=1, attn_fn=_value_passthrough_attention,
                                  output_projections=True)
        for block in fused.blocks:
            if block.attn is not None:
                block.attn.fused_residual = True
        if compiled:
            fused.compile_regions(backend="aot_eager", dynamic=False, fullgraph=True)
        losses = pair_losses((plain, fused))
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-3, atol=0)
        for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
            assert (p.grad is None) == (q.grad is None), name
            if p.grad is not None:
                scale = p.grad.float().abs().max().clamp_min(1e-30)
                assert (p.grad.float() - q.grad.float()).abs().max() <= 0.05 * scale, name


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


def test_softcapped_cross_entropy_sum_equals_the_textbook_loss_and_gradient():
    g = torch.Generator().manual_seed(8)
    logits = (torch.randn(64, 1000, generator=g) * 20).bfloat16().requires_grad_()  # saturates the softcap too
    targets = torch.randint(0, 1000, (64,), generator=g)
    loss = tg.softcapped_cross_entropy_sum(logits, targets)
    loss.backward()
    ref_logits = logits.detach().double().requires_grad_()
    ref = F.cross_entropy(30 * torch.sigmoid(ref_logits / 7.5), targets, reduction="sum")
    ref.backward()
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref.item(), rel=1e-6)
    assert logits.grad.dtype == torch.bfloat16
    assert ((logits.grad.double() - ref_logits.grad).norm() / ref_logits.grad.norm()).item() < 1e-2  # bf16 grad


def test_softcapped_cross_entropy_sum_compiled_matches_eager():
    g = torch.Generator().manual_seed(9)
    logits = (torch.randn(32, 50304, generator=g) * 5).bfloat16().requires_grad_()
    targets = torch.randint(0, 50304, (32,), generator=g)
    eager = tg.softcapped_cross_entropy_sum(logits, targets)
    eager.backward()
    grad = logits.grad.clone()
    logits.grad = None
    compiled = torch.compile(tg.softcapped_cross_entropy_sum, dynamic=False, fullgraph=True)(logits, targets)
    compiled.backward()
    torch._dynamo.reset()
    assert compiled.item() == pytest.approx(eager.item(), rel=1e-5)
    assert ((logits.grad.float() - grad.float()).norm() / grad.float().norm()).item() < 1e-2


# ----------------------------------------------------------------------------------------------------
# one compiled graph for every stage: symbolic token dimension, windows and YaRN scale as data
# ----------------------------------------------------------------------------------------------------

def _params_dependent_attention(q, k, v, cu_seqlens, max_seqlen, params, which):
    """Traceable stand-in that uses the scale and the window as data (as the real kernels do)."""
    return v * (params[which, 0] * params[which, 1]).to(v.dtype)


def test_attention_params_are_a_fresh_cpu_tensor_of_scale_and_windows_in_tokens(model):
    model.yarn.reset()
    params = model.attention_params(3, 7)
    assert params.device.type == "cpu" and params.dtype == torch.float64
    assert params.tolist() == [[0.1, 3 * 128], [0.1, 7 * 128]]
    assert model.attention_params(3, 7) is not params  # saved for the backward: never mutated in place
    assert tg.attention_scalars(params, 1) == (0.1, 896)
    assert tg.attention_scalars(model.attention_params(5, 11), 0) == (0.1, 640)


def test_one_compiled_graph_serves_every_batch_size_window_and_yarn_scale():
    """A compiled model marks the token dimension dynamic, so the warm-up's first graph must serve all later stages:
    a new micro-batch length, new windows and a YaRN-updated scale run under fail_on_recompile and give the eager
    model's loss/grads."""
    eager, compiled = model_pair(seed=11, max_seq_len=512, head_seed=2, attn_fn=_params_dependent_attention)
    compiled.compile_regions(backend="aot_eager", dynamic=False, fullgraph=True)
    inputs, targets, cu = random_batch(128, seed=12)
    compiled(inputs, targets, cu, 1, 3, 128).backward()  # "warm-up": the only compilation
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
    torch._dynamo.reset()
    assert torch.equal(loss_c, loss_e)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_flash_varlen_op_runs_forward_and_backward_on_meta_tensors():
    """The FlashAttention custom op's fake kernels and autograd plumbing (the real kernels need CUDA): shapes and
    dtypes of out/lse and of dq/dk/dv, with the window and scale passed as a CPU tensor."""
    q, k, v = (torch.empty(256, 6, 128, dtype=torch.bfloat16, device="meta", requires_grad=True) for _ in range(3))
    cu = torch.empty(128, dtype=torch.int32, device="meta")
    params = torch.empty(2, 2, dtype=torch.float64)
    out, lse, rng = torch.ops.speedrun.flash_varlen(q, k, v, cu, 2048, params, 1)
    assert out.shape == q.shape and out.dtype == torch.bfloat16
    assert lse.shape == (6, 256) and lse.dtype == torch.float32
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.empty_like(out))
    assert dq.shape == dk.shape == dv.shape == q.shape and dq.dtype == torch.bfloat16


def test_fused_fp8_head_gives_the_unfused_heads_loss_and_gradients():
    """LMHead with fp8: the fused FP8LMHeadCrossEntropySum and lm_head_fp8 + softcapped CE agree exactly."""
    results = []
    for fused in (True, False):
        m = make_model(seed=21, max_seq_len=256)
        with torch.no_grad():
            m.lm_head.weight.normal_(0, 0.05)
        m.lm_head.fp8, m.lm_head.fused = True, fused
        loss = m(*random_batch(256, seed=22), 1, 3, 256)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1].keys() == results[1][1].keys()
    for name, g in results[0][1].items():
        assert torch.equal(g, results[1][1][name]), name


# ----------------------------------------------------------------------------------------------------
# the FA4 backend's plumbing, with a stand-in for flash_attn.cute.interface (FA4 itself needs a Hopper GPU)
# ----------------------------------------------------------------------------------------------------

class _ReferenceFA4:
    """The two internal entry points the op calls, computed with dense_reference (float64 autograd for the
    backward), recording the arguments they were given."""
    calls = []

    @classmethod
    def _flash_attn_fwd(cls, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal,
                        window_size_left, window_size_right, return_lse):
        cls.calls.append(("fwd", softmax_scale, causal, window_size_left, window_size_right, return_lse,
                          max_seqlen_q, cu_seqlens_q is cu_seqlens_k))
        out = dense_reference(q, k, v, cu_seqlens_q, softmax_scale, window_size_left)
        lse = torch.zeros(q.size(1), q.size(0), dtype=torch.float32)  # (heads, tokens), unused by this stand-in
        return out, lse, None, None, None

    @classmethod
    def _flash_attn_bwd(cls, q, k, v, out, dout, lse, softmax_scale, causal, softcap, window_size_left,
                        window_size_right, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dq, dk, dv):
        """Writes into the dq, dk, dv buffers it is handed (FA4's out arguments, which fa4_qkv uses to put dv
        straight into the qkv gradient)."""
        cls.calls.append(("bwd", softmax_scale, causal, window_size_left, window_size_right, softcap))
        # custom op bodies run below the autograd dispatch key: the attention backward written out by hand
        mask = dense_mask(cu_seqlens_q, q.size(0), window_size_left)
        qh, kh, vh, dh = (t.transpose(0, 1) for t in (q, k, v, dout))          # (heads, T, D)
        p = (softmax_scale * qh @ kh.transpose(1, 2)).masked_fill(~mask, float("-inf")).softmax(-1)
        dp = dh @ vh.transpose(1, 2)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        grads = softmax_scale * ds @ kh, softmax_scale * ds.transpose(1, 2) @ qh, p.transpose(1, 2) @ dh
        for buf, g in zip((dq, dk, dv), grads):
            buf.copy_(g.transpose(0, 1))
        return dq, dk, dv


def test_auto_backend_on_cpu_is_the_reference_and_fa4_on_cpu_is_a_one_line_error():
    assert tg.resolve_attention_backend("auto", "cpu") == "reference"
    with pytest.raises(tg.ConfigError, match="needs a CUDA GPU"):
        tg.resolve_attention_backend("fa4", "cpu")


def test_fa4_backend_is_picked_by_auto_when_installed_and_keeps_its_kernel_cache(monkeypatch):
    """With flash_attn.cute importable on a Hopper GPU (both faked here), auto picks FA4, and FA4's on-disk kernel cache is switched on (unless the user set the variable)."""
    import sys
    import types
    fake = types.ModuleType("flash_attn.cute.interface")
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", fake)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.delenv("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", raising=False)
    assert tg.resolve_attention_backend("auto", "cuda") == "fa4"
    assert tg.fa4_interface() is fake
    assert tg.os.environ["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] == "1"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))  # an A100: FA2 instead
    monkeypatch.setattr(tg, "varlen_available", lambda: True)
    assert tg.resolve_attention_backend("auto", "cuda") == "varlen"
    with pytest.raises(tg.ConfigError, match="compute capability 9.0"):
        tg.resolve_attention_backend("fa4", "cuda")


def test_varlen_attention_op_autograd_wiring_traces_with_its_fakes():
    """Forward and backward of the varlen attention op under FakeTensorMode (what torch.compile traces): the
    autograd registration must hand the backward op its arguments in its schema's order."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k, v = (torch.randn(40, 2, 8, requires_grad=True) for _ in range(3))
        cu = torch.zeros(8, dtype=torch.int32)
        out = tg.attention_varlen(q, k, v, cu, 40, attn_params(0.5, 16), 1)
        dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert out.shape == q.shape and dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


# ----------------------------------------------------------------------------------------------------
# the fa4 backend's q/k norm + rotary pass inside the FA4 op (fa4_qkv)
# ----------------------------------------------------------------------------------------------------

def qkv_case(T=64, H=2, D=16, seed=0):
    torch.manual_seed(seed)
    yarn = tg.Yarn(D, 128)
    yarn.cos, yarn.sin = yarn.cos.double(), yarn.sin.double()  # tables in float64 for an exact comparison
    qkv = torch.randn(T, 3 * H, D, dtype=torch.float64) * 2
    ve = torch.randn(T, H, D, dtype=torch.float64)
    return yarn, qkv, ve, tg.pack_cu_seqlens([20, 31, 13], T, 8), attn_params(0.3, 9, short_window=4)


@pytest.mark.parametrize("with_ve", [False, True])
def test_fa4_qkv_equals_norm_rotary_and_attention_forward_and_backward_with_the_step_window(monkeypatch, with_ve):
    """fa4_qkv (norm + rotary inside the op, dv written into the qkv gradient, ve's gradient = dv) against the
    model's own lines (norm, Yarn.rotate, v + ve) and dense attention, float64; FA4 gets the step's short window
    and scale, causal, in both passes."""
    monkeypatch.setattr(tg, "fa4_interface", lambda: _ReferenceFA4)
    _ReferenceFA4.calls = []
    yarn, qkv0, ve0, cu, params = qkv_case()
    T, H3, D = qkv0.shape
    H = H3 // 3
    qkv, ve = qkv0.clone().requires_grad_(), ve0.clone().requires_grad_()
    out = tg.attention_fa4_qkv(qkv, ve if with_ve else None, yarn, cu, 31, params, 0)  # `which` 0: the short window
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (qkv, ve) if with_ve else (qkv,), dout)
    assert _ReferenceFA4.calls == [("fwd", 0.3, True, 4, 0, True, 31, True), ("bwd", 0.3, True, 4, 0, 0.0)]

    qkv_r, ve_r = qkv0.clone().requires_grad_(), ve0.clone().requires_grad_()
    q, k, v = qkv_r.view(T, 3, H, D).unbind(1)
    q, k = yarn.rotate(tg.norm(q)), yarn.rotate(tg.norm(k))
    v = v + ve_r if with_ve else v
    ref = dense_reference(q, k, v, cu, 0.3, 4)
    ref_grads = torch.autograd.grad(ref, (qkv_r, ve_r) if with_ve else (qkv_r,), dout)
    # the only difference: the norm's eps is float32's in the fused op, float64's in F.rms_norm here
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-6)


def test_fused_qk_norm_rope_op_fakes_trace_forward_and_backward():
    """What torch.compile traces: the fakes' shapes for both ops, with and without the value embedding."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    yarn = tg.Yarn(8, 64)
    with FakeTensorMode(allow_non_fake_inputs=True):
        for ve in (None, torch.randn(40, 2, 8, requires_grad=True)):
            qkv = torch.randn(40, 6, 8, requires_grad=True)
            out, lse, qk, v_used, rstd = torch.ops.speedrun.fa4_qkv(qkv, ve, yarn.cos, yarn.sin,
                                                                    torch.zeros(8, dtype=torch.int32), 40,
                                                                    attn_params(0.5, 16), 1)
            assert [tuple(t.shape) for t in (out, lse, qk, rstd)] == [(40, 2, 8), (2, 40), (40, 4, 8), (40, 4)]
            assert tuple(v_used.shape) == ((40, 2, 8) if ve is not None else (0,))
            grads = torch.autograd.grad(out.sum(), (qkv,) if ve is None else (qkv, ve))
            assert [tuple(g.shape) for g in grads] == [(40, 6, 8)] + ([(40, 2, 8)] if ve is not None else [])


def test_the_fa4_backend_attends_through_fa4_qkv_with_or_without_triton(monkeypatch):
    """fa4 always takes the fused op (without Triton its passes fall back to PyTorch inside it); other backends
    attend from rotated q and k."""
    for triton in (tg.triton, None):
        monkeypatch.setattr(tg, "triton", triton)
        fa4 = tg.GPT(SMOKE, max_seq_len=128, attn_backend="fa4")
        assert fa4.qkv_attn_fn is tg.attention_fa4_qkv and fa4.attn_fn is None
        varlen = tg.GPT(SMOKE, max_seq_len=128, attn_backend="varlen")
        assert varlen.qkv_attn_fn is None and varlen.attn_fn is tg.attention_varlen


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
    qk, rstd = tg.qk_norm_rope(qkv, yarn.cos, yarn.sin)  # the kernel (interpreter), fp32
    x = qkv.double().view(T, 3, H, D)[:, :2].requires_grad_(True)
    c, s = yarn.cos.double(), yarn.sin.double()
    rot = lambda t: torch.cat([t.chunk(2, -1)[0] * c[:T, None, None] + t.chunk(2, -1)[1] * s[:T, None, None],
                               t.chunk(2, -1)[1] * c[:T, None, None] - t.chunk(2, -1)[0] * s[:T, None, None]], -1)
    ref = rot(torch.nn.functional.rms_norm(x, (D,), eps=torch.finfo(torch.float32).eps))  # the model: rotate(norm(x))
    d_qk = torch.randn(T, 2 * H, D)
    d_qkv = torch.full_like(qkv, float("nan"))  # the v heads must stay untouched
    tg.qk_norm_rope_backward(d_qk, qkv, rstd, yarn.cos, yarn.sin, d_qkv)
    ref_grad = torch.autograd.grad(ref, x, d_qk.double().view(T, 2, H, D))[0].reshape(T, 2 * H, D)
    out.append(dict(shape=[T, H, D],
                    fwd_rel_err=((qk.double() - ref.reshape(T, 2 * H, D)).abs().max() / ref.abs().max()).item(),
                    rstd_rel_err=((rstd.double() - x.square().mean(-1).add(1.1920929e-07).rsqrt().reshape(T, 2 * H))
                                  .abs().max() / rstd.double().abs().max()).item(),
                    bwd_rel_err=((d_qkv[:, :2 * H].double() - ref_grad).abs().max() / ref_grad.abs().max()).item(),
                    v_untouched=bool(d_qkv[:, 2 * H:].isnan().all()),
                    qk_all_written=not bool(d_qkv[:, :2 * H].isnan().any())))
print(json.dumps(out))
"""


def test_qk_norm_rope_kernels_match_float64_and_leave_the_v_heads_alone():
    """Both Triton passes in the interpreter (fp32): the forward against the model's rotate(norm(x)) in float64
    (YaRN-stretched tables, ragged last tile), the backward against float64 autograd, written into the q and k
    heads of the qkv gradient only (the v heads are FlashAttention-4's to write)."""
    rows = run_in_triton_interpreter(QK_NORM_ROPE_SCRIPT)
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
        out.append(dict(case=[T, H, D, str(dtype)], equal=torch.equal(v, qkv[:, 2 * H:] + ve),
                        contiguous=v.is_contiguous(), shape=list(v.shape)))
print(json.dumps(out))
"""


def test_value_embedding_pass_equals_pytorchs_strided_addition():
    """The Triton pass adding ve to qkv's v heads (interpreter, fp32 and fp16): bit-identical to PyTorch's addition
    of the strided view, written contiguous."""
    rows = run_in_triton_interpreter(VALUE_EMBEDDING_SCRIPT)
    assert len(rows) == 6
    for row in rows:
        assert row["equal"] and row["contiguous"] and row["shape"] == [row["case"][0], row["case"][1], row["case"][2]], row
