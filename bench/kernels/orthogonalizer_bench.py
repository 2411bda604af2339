"""Polar Express against Turbo-Muon on NorMuon's own stacks: accuracy against the exact polar factor, and speed (GPU).

    python3 bench/kernels/orthogonalizer_bench.py --out ortho.json                        # Gaussian stacks
    python3 bench/kernels/orthogonalizer_bench.py --out ortho.json --capture-steps 3,150,300 [--data-path data/proxy]
    compute-sanitizer --tool memcheck python3 bench/kernels/orthogonalizer_bench.py --shapes-only

Stacks come from train_gpt: the model on the meta device, normuon_groups and NorMuon's chunking (chunks of ceil(n/W)
matrices, a rank's shard its chunk, attention matrices as their four (d, d) blocks), each distinct one at W = 1, 2,
4, 8 with the ranks that hold it.
  * accuracy, W=1: polar_express as the trainer runs it on CUDA (bf16 Triton kernels; gates in fp32): relative
    Frobenius error against U Vᵀ of a float64 SVD, percentiles of the singular values of the output and of the input
    (each matrix over its largest), on Gaussian stacks and, with --capture-steps, on the momentum-mixed updates
    NorMuon orthogonalized at those steps of a proxy run (train_gpt's build and train_step; each stack's first
    --keep matrices, bf16 as the kernels read them, saved to <out>_capture_step<N>.pt). All-zero matrices are
    counted, not measured: the zero-initialised lm_head passes the trunk no gradient before its first update (step
    1), nor Wo and c_proj to Wq/Wk/Wv and c_fc before they leave zero (step 3).
  * speed: each shard shape, eagerly and compiled as NorMuon compiles it, triton.testing.do_bench median;
    `turbo_slower` lists where Turbo-Muon loses. --shapes-only runs each once per shape (compute-sanitizer).
"""
import argparse
import datetime
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
import train_gpt as tg  # noqa: E402
from bench import git_commit  # noqa: E402

WORLDS = (1, 2, 4, 8)
MODES = (("polar", False), ("turbo", True))
PERCENTILES = (0, 1, 5, 50, 95, 99, 100)
# A proxy run as bench/loss/proxy_runs.sh trains it, on a 300-step schedule (step 150 in stage 2, 300 in the
# extension). Flags after `--` are appended and win.
CAPTURE_FLAGS = ("--num-scheduled-iterations", "300", "--num-extension-iterations", "10", "--train-epochs", "100",
                 "--val-batch-size", "524288", "--val-tokens", "1572864", "--seed", "1")
QUESTION = "How close to the exact polar factor, and how fast, are Polar Express and Turbo-Muon on NorMuon's stacks?"


def normuon_params(world: int) -> list:
    """The record model's NorMuon parameters, in build_optimizers' order, on the meta device (no memory)."""
    with torch.device("meta"):
        model = tg.GPT(tg.Hyperparameters(), max_seq_len=128)
    params = [p for p in model.parameters() if p.treatment != "adam"]
    return sorted(params, key=lambda p: p.treatment == "gate")  # stable: matrices, then gates


def shard_shapes(params: list, world: int) -> list:
    """[{group, ranks, shape, dtype}]: each distinct shape NorMuon hands its orthogonalizer at `world` ranks."""
    rows = {}
    for name, ps in tg.normuon_groups(params, world)[0]:
        size, chunk = len(ps), math.ceil(len(ps) / world)
        r, c = ps[0].shape
        for rank in range(world):
            local = ps[min(size, rank * chunk):min(size, rank * chunk + chunk)]
            if not local:
                continue
            shape = (4 * len(local), r // 4, c) if {p.treatment for p in local} == {"qkvo"} else (len(local), r, c)
            row = rows.setdefault((name, shape), dict(group=name, ranks=[], shape=list(shape),
                                                      dtype=str(ps[0].dtype).removeprefix("torch.")))
            row["ranks"].append(rank)
    return list(rows.values())


def stack_name(group: str, shape) -> str:
    return f"{group} {'x'.join(map(str, shape))}"


def polar_factor(G: torch.Tensor) -> torch.Tensor:
    """U Vᵀ of each matrix of G, from a float64 SVD."""
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


def percentiles(values: torch.Tensor) -> dict:
    q = torch.tensor([p / 100 for p in PERCENTILES], dtype=torch.float64)
    return dict(zip((f"p{p}" for p in PERCENTILES), torch.quantile(values.double().flatten().cpu(), q).tolist()))


def accuracy(G: torch.Tensor, orthogonalize=tg.polar_express) -> dict:
    """Both orthogonalizers on the stack G (n, rows, cols), its all-zero matrices left out: relative error to the
    exact polar factor and the singular values of the output, beside those of the input over its largest."""
    nonzero = G.flatten(1).abs().amax(dim=1) > 0
    row = dict(matrices=int(nonzero.sum()), zero_matrices_skipped=int((~nonzero).sum()))
    G = G[nonzero]
    if not len(G):
        return row
    exact = polar_factor(G)
    sv = torch.linalg.svdvals(G.double())
    row["input_sv_over_largest"] = percentiles(sv / sv[..., :1])
    for mode, turbo in MODES:
        out = orthogonalize(G, turbo=turbo)
        row[mode] = dict(rel_err=((out.double() - exact).norm() / exact.norm()).item(),  # exact: rank >= 1
                         output_sv=percentiles(torch.linalg.svdvals(out.double())))
    return row


def speed_rows(shapes: dict, fns: dict, timer, device: str = "cuda") -> list:
    """Per W and distinct shard shape: each way of running (fns: name -> orthogonalizer) timed for polar and turbo."""
    rows, seen = [], {}
    for world, entries in shapes.items():
        for e in entries:
            key = (tuple(e["shape"]), e["dtype"])
            if key not in seen:
                G = torch.randn(e["shape"], device=device).to(getattr(torch, e["dtype"]))
                seen[key] = {}
                for how, fn in fns.items():
                    ms = {mode: timer(lambda fn=fn, turbo=turbo: fn(G, turbo=turbo)) for mode, turbo in MODES}
                    seen[key][f"{how}_ms"] = dict(ms, turbo_over_polar=ms["turbo"] / ms["polar"])
            row = dict(world_size=world, group=e["group"], ranks=e["ranks"], shape=e["shape"], dtype=e["dtype"],
                       **seen[key])
            row["turbo_slower"] = [how for how in fns if row[f"{how}_ms"]["turbo_over_polar"] > 1]
            rows.append(row)
    return rows


class Recorder:
    """Stands in for NorMuon's _orthogonalize_fn: at the chosen steps keeps the first `keep` matrices of each input
    (bf16, on the CPU) under its group's label, then calls the orthogonalizer it replaced."""

    def __init__(self, fn, labels: list, steps, keep: int):
        self.fn, self.labels, self.steps, self.keep = fn, labels, set(steps), keep
        self.step, self.captured = None, {}

    def __call__(self, u, turbo=False):
        if self.step in self.steps:
            stacks = self.captured.setdefault(self.step, {})
            stacks[stack_name(self.labels[len(stacks)], u.shape)] = u[:self.keep].to(torch.bfloat16).cpu()
        return self.fn(u, turbo=turbo)


def capture(data_path: str, steps: list, keep: int, train_flags, log_file: Path) -> dict:
    """Train the real model (train_gpt's build path, one process) to the last capture step; {step: {stack: tensor}}."""
    args = tg.parse_args(["--data-path", data_path, *CAPTURE_FLAGS, *train_flags])
    if max(steps) >= args.num_iterations:
        raise tg.ConfigError(f"--capture-steps {max(steps)} is past the run's last step ({args.num_iterations - 1})")
    runtime = tg.resolve_runtime(args)
    trainer = tg.build_trainer(args, runtime, log_file, replace_log=True)
    trainer.warm_up_kernels()
    muon = trainer.muon
    labels = [g["label"] for g, layout in zip(muon.param_groups, muon._layout) if layout["hi"] > layout["lo"]]
    recorder = muon._orthogonalize_fn = Recorder(muon._orthogonalize_fn, labels, steps, keep)
    table = tg.stages(args)
    batches, previous = trainer.new_batches(table[0].batch_size), table[0].batch_size
    for step in range(max(steps) + 1):  # Trainer.train's loop without validation
        stage = table[tg.stage_index(step, args)]
        trainer.model.yarn.set_window(stage.ws_long)
        bs = stage.batch_size
        settings = (bs, args.train_max_seq_len, runtime.grad_accum_steps) if bs != previous else None
        previous = bs
        trainer.set_schedules(step)
        recorder.step = step
        trainer.train_step(step, batches, settings, stage.ws_short, stage.ws_long, runtime.grad_accum_steps)
    return recorder.captured


def parse_steps(text: str) -> list:
    try:
        steps = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        steps = [-1]  # reported as below
    if steps and steps[0] < 0:
        raise tg.ConfigError(f"--capture-steps {text!r}: give comma-separated steps from 0, e.g. 3,150,300")
    return steps


def table(result: dict) -> str:
    """The JSON's accuracy and speed as two short tables."""
    lines = [f"{'accuracy':<32}{'stack':<26}{'polar err':>10}{'turbo err':>10}   output sv p1..p99 (polar | turbo)"]
    for source, stacks in result["accuracy"].items():
        for name, r in stacks.items():
            if "polar" not in r:
                lines.append(f"{source:<32}{name:<26}  all {r['zero_matrices_skipped']} matrices zero")
                continue
            sv = " | ".join(f"{r[m]['output_sv']['p1']:.3f}..{r[m]['output_sv']['p99']:.3f}" for m, _ in MODES)
            errs = "".join(f"{r[m]['rel_err']:>10.4f}" for m, _ in MODES)
            lines.append(f"{source:<32}{name:<26}{errs}   {sv}")
    lines.append(f"{'speed (ms)':<12}{'W':>2}  {'stack':<28}{'eager polar/turbo':>20}{'compiled polar/turbo':>24}")
    for r in result["speed"]:
        cells = "".join(f"{r[h]['polar']:>10.3f}/{r[h]['turbo']:<9.3f}" for h in ("eager_ms", "compiled_ms"))
        flag = "  turbo slower: " + ",".join(r["turbo_slower"]) if r["turbo_slower"] else ""
        lines.append(f"{'':<12}{r['world_size']:>2}  {stack_name(r['group'], r['shape']):<28}{cells}{flag}")
    return "\n".join(lines)


def new_result(shapes: dict, captured_files: list, device: str, commit: str) -> dict:
    import triton
    return dict(question=QUESTION, device=device, torch=torch.__version__, triton=triton.__version__, commit=commit,
                date=datetime.date.today().isoformat(), command=" ".join([Path(sys.executable).name, *sys.argv]),
                shapes={str(w): s for w, s in shapes.items()}, captured_files=captured_files, accuracy={}, speed=[],
                turbo_slower=[])


def add_speed(result: dict, rows: list) -> None:
    result["speed"] = rows
    result["turbo_slower"] = [f"W={r['world_size']} {stack_name(r['group'], r['shape'])} {how}"
                              for r in rows for how in r["turbo_slower"]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="orthogonalizer_bench.json")
    ap.add_argument("--capture-steps", default="", help="steps of a proxy run whose NorMuon inputs are measured")
    ap.add_argument("--data-path", default="data/proxy", help="shards of the capture run")
    ap.add_argument("--keep", type=int, default=2, help="matrices kept per captured stack (default 2)")
    ap.add_argument("--shapes-only", action="store_true", help="run each orthogonalizer once per shape, then exit")
    ap.add_argument("--no-speed", action="store_true", help="accuracy only (a capture run and the timings' compiles "
                                                             "may not fit one 10-minute call together)")
    ap.add_argument("--commit", default="", help="recorded instead of .git's HEAD")
    ap.add_argument("train_flags", nargs="*", metavar="-- TRAIN_FLAGS", help="train_gpt.py flags of the capture run")
    a = ap.parse_args(argv)
    out = Path(a.out)
    try:
        steps = parse_steps(a.capture_steps)
        if a.keep < 1:
            raise tg.ConfigError(f"--keep {a.keep}: keep at least 1 matrix per stack")
        if not torch.cuda.is_available():
            raise tg.ConfigError("orthogonalizer_bench.py needs a CUDA GPU (it runs the Triton kernels)")
        shapes = {w: shard_shapes(normuon_params(w), w) for w in WORLDS}
        if a.shapes_only:
            for w, e, (mode, turbo) in [(w, e, m) for w, es in shapes.items() for e in es for m in MODES]:
                tg.polar_express(torch.randn(e["shape"], device="cuda").to(getattr(torch, e["dtype"])), turbo=turbo)
                torch.cuda.synchronize()
                print(f"W={w} {stack_name(e['group'], e['shape'])} {e['dtype']} {mode}: ran", flush=True)
            return 0
        files = {s: out.with_name(f"{out.stem}_capture_step{s}.pt") for s in steps}
        log_file = out.with_name(out.stem + "_trainer_log.txt")
        taken = [p for p in (out, log_file, *files.values()) if p.exists()]
        if taken:
            raise tg.ConfigError(f"{taken[0]} exists: remove it or choose another --out")
        tg.check_writable(out.parent, "--out")
        captured = capture(a.data_path, steps, a.keep, a.train_flags, log_file) if steps else {}
    except tg.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import triton.testing
    result = new_result(shapes, [p.name for p in files.values()], torch.cuda.get_device_name(),
                        a.commit or git_commit())
    for step, stacks in captured.items():
        torch.save(stacks, files[step])
        result["accuracy"][f"captured step {step}"] = {k: accuracy(G.cuda()) for k, G in stacks.items()}
    torch.manual_seed(0)
    result["accuracy"]["gaussian"] = {stack_name(e["group"], e["shape"]): accuracy(
        torch.randn(e["shape"], device="cuda").to(getattr(torch, e["dtype"]))) for e in shapes[1]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))  # accuracy survives a failure in the timings
    if a.no_speed:
        print(table(result))
        return 0
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)  # one graph per shape
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)
    fns = dict(eager=tg.polar_express, compiled=torch.compile(tg.polar_express, dynamic=False, fullgraph=True))
    timer = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")  # noqa: E731
    add_speed(result, speed_rows(shapes, fns, timer))
    out.write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
