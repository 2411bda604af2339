# TEMPORARY: exec'd into train_gpt.py's globals (uses math, torch, Tensor, dist, polar_express); inlined later.
#
# Two optimizers, both sharded over the ranks of the default process group (or local when there is none):
#   NorMuon   for the 43 hidden matrices and gates: reduce-scatter grads -> per-shard update -> all-gather params
#   DistAdam  for embeddings, lm_head and scalars: ZeRO-1 over dim 0, grads reduce-scattered from a grad hook
#
# Parameter metadata (set by the model on each nn.Parameter; all optional):
#   p.label   NorMuon: smear_gate | attn_gate | attn | mlp      DistAdam: lm_head | scalars | value_embed | embed
#   p.lr_mul  per-parameter learning-rate multiplier (default 1.0)
#   p.wd_mul  per-parameter weight-decay multiplier (default 1.0)

NORMUON_LABEL_ORDER = ("smear_gate", "attn_gate", "attn", "mlp")
NORMUON_RECORD_COUNTS = {"smear_gate": 1, "attn_gate": 10, "attn": 10, "mlp": 22}
NORMUON_RECORD_GROUP_SIZES = (1, 10, 16, 16)   # 8 GPUs: G3 = 10 attn + 6 mlp, G4 = 16 mlp
NORMUON_GATE_LABELS = ("smear_gate", "attn_gate")
DISTADAM_LABEL_ORDER = ("lm_head", "scalars", "value_embed", "embed")


def _dist_world() -> tuple[int, int]:
    """(world_size, rank) of the default process group, or (1, 0) when there is none."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


# ---- NorMuon per-shard math: small pure functions the trainer may torch.compile (dynamic=False) ----

def normuon_second_moment(v: Tensor, second_moment: Tensor, beta2: float, dim: int) -> Tensor:
    """NorMuon step 4: per-row (dim=-1) or per-column (dim=-2) RMS normalisation of the orthogonalized update.

    v: (..., rows, cols) orthogonalized update (bf16 on CUDA). second_moment: running mean of v**2 along `dim`,
    shape v.shape with `dim` reduced to 1, fp32, updated in place. Returns the normalised update in v's dtype;
    each matrix keeps its Frobenius norm.
    """
    vf = v.float()
    second_moment.lerp_(vf.square().mean(dim=dim, keepdim=True), 1.0 - beta2)
    vn = vf * second_moment.clamp_min(1e-10).rsqrt()
    scale = vf.norm(dim=(-2, -1), keepdim=True) / vn.norm(dim=(-2, -1), keepdim=True).clamp_min(1e-10)
    return (vn * scale).to(v.dtype)


def cautious_update(p: Tensor, v: Tensor, lr_eff: Tensor, wd_eff: Tensor) -> None:
    """In place: p <- p - lr_eff * (v + wd_eff * [v*p >= 0] * p), computed in fp32.

    lr_eff, wd_eff: 0-D CPU float32 tensors (changing values never trigger a recompile).
    The decay only acts on entries whose update already shrinks |p| (cautious weight decay).
    """
    pf = p.float()
    vf = v.float()
    mask = (vf * pf >= 0).to(torch.float32)
    p.copy_(pf - lr_eff * (vf + wd_eff * mask * pf))


def normuon_lr_factor(p: Tensor) -> float:
    """sqrt(max(1, rows/cols)) * lr_mul from the parameter's own stored 2-D shape (Δ168: attn 2, c_fc 2, c_proj 4)."""
    rows, cols = p.shape[-2], p.shape[-1]
    return math.sqrt(max(1.0, rows / cols)) * float(getattr(p, "lr_mul", 1.0))


def normuon_reduce_dim(label: str, shape) -> int:
    """Axis of the NorMuon second moment, from the stored (un-reshaped) shape: gates and tall/square matrices
    get one statistic per row (-1); wide non-gate matrices one per column (-2)."""
    if label in NORMUON_GATE_LABELS or shape[-2] >= shape[-1]:
        return -1
    return -2


class NorMuon(torch.optim.Optimizer):
    """Muon with Polar Express orthogonalization, NorMuon row normalisation and cautious weight decay (PR #168).

    Params are grouped (see `_make_groups`) and every group is split into W contiguous chunks of
    ceil(size/W) params; rank r updates only its chunk. step(): reduce-scatter(AVG) the stacked grads of every
    group, update the local shard, all-gather the updated params. Without a process group it runs locally.

    Group keys: params, lr, weight_decay, momentum, beta2, label (group name), plus what the trainer adds
    (initial_lr). Lazily created, per group: momentum_buffer (param dtype, local shard stacked),
    second_momentum_buffer (fp32), lr_eff / wd_eff (lists of 0-D CPU fp32 tensors, one per local param).
    They disappear with load_state_dict of a state saved before the first step and are re-created as zeros.
    """

    def __init__(self, params, lr=0.023, weight_decay=1.2, momentum=0.95, beta2=0.95, custom_sizing=True,
                 orthogonalizer="polar"):
        if orthogonalizer not in ("polar", "turbo"):
            raise ValueError(f"orthogonalizer must be 'polar' or 'turbo', got {orthogonalizer!r}")
        params = [p for p in params]
        if not params:
            raise ValueError("NorMuon got an empty parameter list")
        for p in params:
            if p.dim() != 2:
                raise ValueError(f"NorMuon needs 2-D params, got shape {tuple(p.shape)} (label {getattr(p, 'label', None)!r})")
        self.world_size, self.rank = _dist_world()
        self.turbo = orthogonalizer == "turbo"
        self.custom_sizing = custom_sizing
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, beta2=beta2)
        groups = [dict(params=ps, label=name) for name, ps in self._make_groups(params)]
        super().__init__(groups, defaults)
        self._orthogonalize_fn = polar_express
        self._second_moment_fn = normuon_second_moment
        self._cautious_update_fn = cautious_update
        # Static sharding layout, parallel to self.param_groups (param lists never change, also not on reload).
        W, r = self.world_size, self.rank
        self._layout = []
        for group in self.param_groups:
            ps = group["params"]
            shape, dtype = ps[0].shape, ps[0].dtype
            for p in ps:
                assert p.shape == shape and p.dtype == dtype, \
                    f"NorMuon group {group['label']!r} mixes shapes/dtypes: {tuple(p.shape)} {p.dtype} vs {tuple(shape)} {dtype}"
            size = len(ps)
            chunk = -(-size // W)
            lo, hi = min(size, r * chunk), min(size, r * chunk + chunk)
            local_labels = {getattr(p, "label", None) for p in ps[lo:hi]}
            assert not ("attn" in local_labels and len(local_labels) > 1), \
                f"NorMuon rank {r} would mix attn with {sorted(map(str, local_labels - {'attn'}))} in group {group['label']!r}"
            is_attn = local_labels == {"attn"}
            if is_attn:
                assert shape[0] == 4 * shape[1], f"attn params must be (4d, d) = [QKV; Wo], got {tuple(shape)}"
            local_label = next(iter(local_labels)) if len(local_labels) == 1 else None
            self._layout.append(dict(size=size, chunk=chunk, lo=lo, hi=hi, is_attn=is_attn,
                                     reduce_dim=normuon_reduce_dim(local_label, shape)))

    def _make_groups(self, params):
        """[(name, params)]: the record's 8-GPU sizing [1, 10, 16, 16], or one group per (label, shape, dtype)."""
        labels = [getattr(p, "label", None) for p in params]
        counts = {}
        for lab in labels:
            counts[lab] = counts.get(lab, 0) + 1
        if self.world_size == 8 and self.custom_sizing and counts == NORMUON_RECORD_COUNTS:
            ordered = sorted(params, key=lambda p: NORMUON_LABEL_ORDER.index(p.label))  # stable
            groups, start = [], 0
            for name, size in zip(("smear_gate", "attn_gate", "attn+mlp", "mlp"), NORMUON_RECORD_GROUP_SIZES):
                groups.append((name, ordered[start:start + size]))
                start += size
            return groups
        keyed = {}
        for p, lab in zip(params, labels):
            keyed.setdefault((lab, tuple(p.shape), p.dtype), []).append(p)
        names = [lab if lab is not None else "unlabeled" for (lab, _, _) in keyed]
        out = []
        for (key, ps), name in zip(keyed.items(), names):
            if names.count(name) > 1:  # same label with several shapes/dtypes: disambiguate the name
                name = f"{name}:{'x'.join(map(str, key[1]))}:{str(key[2]).replace('torch.', '')}"
            out.append((name, ps))
        return out

    def compile_helpers(self, enabled: bool = True):
        """Route the per-shard math through torch.compile(dynamic=False) (CUDA); compilation happens on first use."""
        if enabled:
            self._orthogonalize_fn = torch.compile(polar_express, dynamic=False, fullgraph=True)
            self._second_moment_fn = torch.compile(normuon_second_moment, dynamic=False, fullgraph=True)
            self._cautious_update_fn = torch.compile(cautious_update, dynamic=False, fullgraph=True)
        else:
            self._orthogonalize_fn = polar_express
            self._second_moment_fn, self._cautious_update_fn = normuon_second_moment, cautious_update
        return self

    @torch.no_grad()
    def reset(self):
        """Zero all momentum and second-moment buffers (after the kernel warm-up)."""
        for group in self.param_groups:
            for key in ("momentum_buffer", "second_momentum_buffer"):
                if key in group:
                    group[key].zero_()

    def _update_shard(self, group, layout, grads: Tensor):
        """Update the rank's params group["params"][lo:hi] in place from their averaged grads (n, rows, cols)."""
        local = group["params"][layout["lo"]:layout["hi"]]
        n = len(local)
        rows, cols = grads.shape[-2:]
        beta = group["momentum"]
        if "momentum_buffer" not in group:
            group["momentum_buffer"] = torch.zeros_like(grads)
        buf = group["momentum_buffer"]
        buf.lerp_(grads, 1.0 - beta)
        u = grads.lerp(buf, beta)                        # (1-beta) g + beta M  (Nesterov-style)
        if layout["is_attn"]:
            u = u.view(4 * n, rows // 4, cols)           # Wq, Wk, Wv, Wo separately
        v = self._orthogonalize_fn(u, turbo=self.turbo)
        dim = layout["reduce_dim"]
        if "second_momentum_buffer" not in group:
            stat_shape = list(v.shape)
            stat_shape[dim] = 1
            group["second_momentum_buffer"] = torch.zeros(stat_shape, dtype=torch.float32, device=v.device)
        v = self._second_moment_fn(v, group["second_momentum_buffer"], group["beta2"], dim)
        v = v.view(n, rows, cols)
        if "lr_eff" not in group:
            group["lr_eff"] = [torch.zeros((), dtype=torch.float32) for _ in range(n)]
            group["wd_eff"] = [torch.zeros((), dtype=torch.float32) for _ in range(n)]
        lr, wd = group["lr"], group["weight_decay"]
        for i, p in enumerate(local):
            group["lr_eff"][i].fill_(lr * normuon_lr_factor(p))
            group["wd_eff"][i].fill_(lr * wd * float(getattr(p, "wd_mul", 1.0)))
            self._cautious_update_fn(p, v[i], group["lr_eff"][i], group["wd_eff"][i])

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        W = self.world_size
        if W == 1:  # no process group (or a group of one): no collectives
            for group, layout in zip(self.param_groups, self._layout):
                ps = group["params"]
                grads = torch.stack([p.grad if p.grad is not None else torch.zeros_like(p) for p in ps])
                self._update_shard(group, layout, grads)
            return loss
        # (1) launch every group's reduce-scatter, gate groups first
        scatters = []
        for group, layout in zip(self.param_groups, self._layout):
            ps, size, chunk = group["params"], layout["size"], layout["chunk"]
            p0 = ps[0]
            stacked = torch.empty((chunk * W, *p0.shape), dtype=p0.dtype, device=p0.device)
            for i, p in enumerate(ps):
                if p.grad is None:
                    stacked[i].zero_()
                else:
                    stacked[i].copy_(p.grad)
            stacked[size:].zero_()
            shard = torch.empty((chunk, *p0.shape), dtype=p0.dtype, device=p0.device)
            scatters.append((dist.reduce_scatter_tensor(shard, stacked, op=dist.ReduceOp.AVG, async_op=True), shard))
        # (2) per group: wait, update the local shard, launch the all-gather of the updated params
        gathers = []
        for group, layout, (work, shard) in zip(self.param_groups, self._layout, scatters):
            work.wait()
            ps, lo, hi, chunk = group["params"], layout["lo"], layout["hi"], layout["chunk"]
            n = hi - lo
            if n > 0:
                self._update_shard(group, layout, shard[:n])
            send = torch.empty_like(shard)
            for i, p in enumerate(ps[lo:hi]):
                send[i].copy_(p)
            send[n:].zero_()
            full = torch.empty((chunk * W, *shard.shape[1:]), dtype=shard.dtype, device=shard.device)
            gathers.append((dist.all_gather_into_tensor(full, send, async_op=True), full))
        # (3) copy the gathered params back (only the `size` real slices; padding is dropped)
        for group, (work, full) in zip(self.param_groups, gathers):
            work.wait()
            for i, p in enumerate(group["params"]):
                p.copy_(full[i])
        return loss


class DistAdam(torch.optim.Optimizer):
    """ZeRO-1 Adam: every param is split along dim 0 into W equal slices; rank r keeps the Adam state of, and
    updates, rows [r*n/W, (r+1)*n/W), then all-gathers the param.

    Gradients are reduce-scattered (AVG) by a post-accumulate-grad hook, but only while `self.should_sync` is
    True (the trainer sets it before the last micro-batch backward of the steps on which it calls step()).
    step() updates exactly the params with a pending reduce-scatter. Without a process group (or W == 1) there
    are no collectives: step() uses p.grad of every param that has one.

    Groups by label in the order lm_head, scalars, value_embed, embed, then everything else. Group keys:
    params, lr, betas, eps, weight_decay, label (+ the trainer's initial_lr). State per param: step (int),
    exp_avg, exp_avg_sq (slice shape, param dtype).
    """

    def __init__(self, params, lr=0.008, betas=(0.65, 0.95), eps=1e-8, weight_decay=0.0):
        params = [p for p in params]
        if not params:
            raise ValueError("DistAdam got an empty parameter list")
        self.world_size, self.rank = _dist_world()
        W = self.world_size
        for p in params:
            label = getattr(p, "label", None)
            if p.dim() == 0 or p.shape[0] % W != 0:
                raise ValueError(f"DistAdam shards dim 0 over {W} ranks, but param {label!r} of shape "
                                 f"{tuple(p.shape)} has a dim 0 not divisible by {W}: pad it to a multiple of {W}")
        buckets = {}
        for p in params:
            label = getattr(p, "label", None)
            buckets.setdefault(label if label in DISTADAM_LABEL_ORDER else None, []).append(p)
        groups = [dict(params=buckets[lab], label=lab) for lab in DISTADAM_LABEL_ORDER if lab in buckets]
        if None in buckets:
            groups.append(dict(params=buckets[None], label="other"))
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(groups, defaults)
        self.should_sync = False
        self._pending = {}  # param -> (async work, averaged grad slice)
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_hook) for p in params]

    def _slice_rows(self, p: Tensor) -> tuple[int, int]:
        rows = p.shape[0] // self.world_size
        return self.rank * rows, (self.rank + 1) * rows

    @torch.no_grad()
    def _grad_hook(self, p: Tensor):
        if not self.should_sync or self.world_size == 1 or p.grad is None:
            return
        lo, hi = self._slice_rows(p)
        g_slice = torch.empty((hi - lo, *p.shape[1:]), dtype=p.grad.dtype, device=p.grad.device)
        work = dist.reduce_scatter_tensor(g_slice, p.grad, op=dist.ReduceOp.AVG, async_op=True)
        self._pending[p] = (work, g_slice)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        distributed = self.world_size > 1
        gathers = []
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if distributed:
                    entry = self._pending.pop(p, None)
                    if entry is None:
                        continue
                    work, g = entry
                    work.wait()
                else:
                    g = p.grad
                    if g is None:
                        continue
                lo, hi = self._slice_rows(p)
                p_slice = p[lo:hi]
                lr_p = lr * float(getattr(p, "lr_mul", 1.0))
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p_slice)
                    state["exp_avg_sq"] = torch.zeros_like(p_slice)
                if wd != 0:
                    p_slice.mul_(1.0 - lr_p * wd * float(getattr(p, "wd_mul", 1.0)))
                state["step"] += 1
                t = state["step"]
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                exp_avg.mul_(beta1).add_(g, alpha=1.0 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
                step_size = lr_p * math.sqrt(1.0 - beta2 ** t) / (1.0 - beta1 ** t)
                p_slice.addcdiv_(exp_avg, exp_avg_sq.sqrt().add_(eps), value=-step_size)
                if distributed:
                    gathers.append(dist.all_gather_into_tensor(p, p_slice, async_op=True))
        for work in gathers:
            work.wait()
        self._pending.clear()
        return loss
