"""NorMuon's update in float64, written out from its definition, and the errors of a rank's shard update against it
(tests/test_optimizers.py on the CPU, tests/gpu/test_gpu_checks.py at the 8-GPU shard on a GPU)."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import train_gpt as tg

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import bench  # noqa: E402


def normuon_steps_float64(P, grads, beta, beta2, lr_eff, wd_eff, is_attn, dim, turbo):
    """One group's shard P (n, rows, cols) after one step per gradient stack in `grads`; lr_eff, wd_eff per matrix.
    Momentum, Nesterov mix, the orthogonalizer's float64 iteration, the per-row or per-column second moment (each
    matrix keeps its Frobenius norm), cautious weight decay."""
    P = P.double().clone()
    n, rows, cols = P.shape
    M, S = torch.zeros_like(P), None
    for g in grads:
        g = g.double()
        M = beta * M + (1 - beta) * g
        u = (1 - beta) * g + beta * M
        v = tg.polar_express_reference(u.view(4 * n, rows // 4, cols) if is_attn else u, turbo=turbo)
        mean_sq = v.square().mean(dim=dim, keepdim=True)
        S = (1 - beta2) * mean_sq if S is None else beta2 * S + (1 - beta2) * mean_sq
        vn = v * S.clamp_min(1e-10).rsqrt()
        v = (vn * v.norm(dim=(-2, -1), keepdim=True) / vn.norm(dim=(-2, -1), keepdim=True)).view(n, rows, cols)
        for i in range(n):
            decay = (v[i] * P[i] >= 0).double()
            P[i] = P[i] - lr_eff[i] * (v[i] + wd_eff[i] * decay * P[i])
    return P


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def shard_update_errors(rank: int, world_size: int, orthogonalizer: str, flags: list, device: str, compiled: bool,
                        steps: int = 3) -> dict:
    """In this process as rank `rank` of `world_size` (torch's fake process group, removed again at the end): the
    trainer's model (its flags), NorMuon as the trainer builds it, `steps` shard updates of every group from Gaussian
    gradients; per group the rank updates, its matrices, param dtype and the relative error of the parameters'
    change against normuon_steps_float64."""
    bench.emulate_rank(rank, world_size)
    try:
        args = tg.parse_args([*flags, "--orthogonalizer", orthogonalizer])
        torch.manual_seed(rank)
        model = tg.GPT(args, max_seq_len=128).to(device)
        _, muon = tg.build_optimizers(model, args)
        if compiled:
            muon.compile_helpers()
        gen = torch.Generator(device=device).manual_seed(rank)
        out = {}
        for group, layout in zip(muon.param_groups, muon._layout):
            n = layout["hi"] - layout["lo"]
            if n == 0:
                continue
            group["lr"], group["momentum"] = group["initial_lr"], args.muon_momentum_warmup[1]
            local = group["params"][layout["lo"]:layout["hi"]]
            before = torch.stack([p.detach().clone() for p in local])
            shard = layout["shard"][:n]
            grads = [(torch.randn(shard.shape, device=device, generator=gen) * 1e-3).to(shard.dtype)
                     for _ in range(steps)]
            with torch.no_grad():
                for g in grads:
                    shard.copy_(g)
                    muon._update_shard(group, layout, shard)
            after = torch.stack([p.detach() for p in local]).double()
            lr_eff = [group["lr"] * tg.normuon_lr_factor(p) for p in local]
            wd_eff = [group["lr"] * group["weight_decay"] * float(getattr(p, "wd_mul", 1.0)) for p in local]
            ref = normuon_steps_float64(before, grads, group["momentum"], group["beta2"], lr_eff, wd_eff,
                                        layout["is_attn"], layout["reduce_dim"], orthogonalizer == "turbo")
            out[group["label"]] = dict(matrices=n, dtype=str(before.dtype),
                                       update_rel_err=rel(after - before.double(), ref - before.double()))
        return out
    finally:
        dist.destroy_process_group()
