"""bench/results/INDEX.md: one line per result JSON (date, device, commit, the question it answers).

    python3 bench/index_results.py            # rewrite bench/results/INDEX.md
    python3 bench/index_results.py --check    # exit 1 when INDEX.md is not what this script would write

Date, device and commit come from the JSON's own fields (commit: the first hash-like word, also looked up in
nested records when the top level has none). The question comes from the JSON's "question" field; for results
written before that field existed, from QUESTIONS below. A JSON with neither is an error: give a new result a
"question" field, then rerun this script. Only the folder's top level is indexed (not its subfolders).
"""
import argparse
import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
HASH = re.compile(r"\b[0-9a-f]{7,40}\b")

QUESTIONS = {
    "2026-11-22_h100x1_bench.json":
        "How fast is the trainer before the issue-4 optimisations (ac1a1bf)? Full benchmark: stages, cold start, "
        "optimizers, orthogonalizers, profile",
    "2026-11-22_h100x1_bench_dynamic.json":
        "Full benchmark with one compiled graph for all stages (dynamic token dim), unfused FP8 head",
    "2026-11-22_h100x1_bench_static.json":
        "Control of ..._bench_dynamic (same call): one compiled graph per stage (--static)",
    "2026-11-22_h100x1_bench_fused_64x128.json":
        "Full benchmark with the fused FP8 head at its first tile (64x128, 8 warps)",
    "2026-11-22_h100x1_bench_static_fused_64x128.json":
        "Does one graph for all stages cost step time? --static control of ..._bench_fused_64x128 (same machine)",
    "2026-11-22_h100x1_bench_unfused_head.json":
        "Does the fused FP8 head beat the unfused one? --unfused-head control of ..._bench_fused_64x128 (same machine)",
    "2026-11-22_h100x1_ce_kernel_variants.json":
        "Which tile of the fused CE-backward kernel is fastest, against the unfused path? (32x128, 4 warps)",
    "2026-11-22_h100x1_bench_final.json":
        "Full benchmark with the fused head at its best tile (32x128/4), FA2 attention (3960b45's trainer)",
    "2026-11-22_h100x1_fused_vs_unfused_head_runs.json":
        "Does the fused FP8 head change the loss? Proxy schedule, seeds 1-2, fused vs unfused head",
    "2026-11-22_h100x1_gpu_checks.json":
        "Are the FP8 head, FA2 attention, the orthogonalizer's Triton kernels and Polar Express / Turbo-Muon "
        "correct on the GPU? (first GPU checks)",
    "2026-11-22_h100x1_gpu_checks_attention_fp8.json":
        "FA2 attention and the FP8 head against their references (our FA2 op vs torch's varlen_attn)",
    "2026-11-22_h100x1_gpu_checks_fused_head.json":
        "Is the fused head's e5m2 gradient the reference formula's, byte for byte? (with attention and FP8 head)",
    "2026-11-22_h100x1_gpu_checks_fa4.json":
        "Is FlashAttention-4 as accurate as FA2, how long does its first call compile, how fast are its kernels?",
    "2026-11-22_h100x1_bench_hostsync_varlen.json":
        "Full benchmark after the host-synchronisation fix (FA2): step times, synchronising calls, GPU idle time",
    "2026-11-22_h100x1_bench_fa4_stages.json":
        "Per-stage step times with FA4 in the whole model (same machine as ..._bench_hostsync_varlen)",
    "2026-11-22_h100x1_relu2_mm.json":
        "Which tile of the ReLU² Triton GEMM is fastest, and does it beat cuBLAS + Inductor? (no, ~10 % slower)",
    "2026-11-22_h100x1_bench_final_fa4.json":
        "Full benchmark of the final default configuration (FA4, fused head, Inductor's ReLU²)",
    "2026-11-22_h100x1_bench_fa4_fused_mlp.json":
        "Does the fused ReLU² GEMM help the whole model? Control of ..._bench_final_fa4 (same machine)",
    "2026-11-22_h100x1_ml_check_optimized_vs_unoptimized.json":
        "Do the optimisations change the loss? Final defaults vs FA2 + unfused head, proxy schedule, 3 seeds",
    "2026-11-22_h100x1_proxy_96steps.json":
        "Does the trainer run the 90+6-step proxy schedule end to end on one H100? (first proxy run)",
    "2026-11-22_h200x2_w2_vs_w1.json":
        "Does the trainer scale to 2 GPUs, and does W=2 reach W=1's loss? (one seed each, profiled step 75)",
    "2026-11-22_h200x2_w1_w2_spread.json":
        "W=2 vs W=1, and after vs before the optimisations, over 3 seeds; communication overlap; kill test",
    "2026-11-23_h100x1_cold_start_varlen.json":
        "Cold start with FA2 as the first backend on a fresh machine (caches of its own)",
    "2026-11-23_h100x1_cold_start_fa4.json":
        "Cold start with FA4, second on the same machine after FA2 (caches of its own)",
    "2026-11-23_h100x1_cold_start_fa4_first.json":
        "Cold start and step times of the final default configuration, FA4 first on a fresh machine "
        "(bench/RESULTS.md's current numbers)",
    "2026-11-23_h100x1_cold_start_varlen_second.json":
        "Cold start with FA2, second on the same machine after FA4 (caches of its own, OS file cache warm)",
}


def first_hash(value) -> str:
    m = HASH.search(value) if isinstance(value, str) else None
    return m.group(0)[:7] if m else ""


def row(path: Path) -> dict:
    d = json.loads(path.read_text())
    if not isinstance(d, dict):
        d = {}
    commit = first_hash(d.get("commit"))
    if not commit:  # e.g. one commit per compared set
        nested = [first_hash(v.get("commit")) for v in d.values() if isinstance(v, dict)]
        commit = "/".join(dict.fromkeys(c for c in nested if c))
    device = re.split(r" \(|,|;", str(d.get("device", "")))[0].strip()
    question = d.get("question") or QUESTIONS.get(path.name)
    if not question:
        raise SystemExit(f"index_results.py: {path.name} has no \"question\" field and no entry in QUESTIONS")
    return dict(file=path.name, date=str(d.get("date", ""))[:10], device=device or "-", commit=commit or "-",
                question=question)


def render(folder: Path = RESULTS) -> str:
    lines = ["# Results index", "",
             "One line per JSON in this folder, written by `python3 bench/index_results.py` (do not edit by hand; "
             "`--check` tells whether it is current). How to read each kind: `bench/README.md`; what they showed: "
             "`bench/RESULTS.md`.", "",
             "| file | date | device | commit | question |", "|---|---|---|---|---|"]
    rows = sorted((row(p) for p in folder.glob("*.json")), key=lambda r: (r["date"], r["file"]))
    lines += [f"| `{r['file']}` | {r['date']} | {r['device']} | {r['commit']} | {r['question']} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare with INDEX.md instead of writing it")
    ap.add_argument("--folder", default=str(RESULTS))
    a = ap.parse_args(argv)
    folder = Path(a.folder)
    text, index = render(folder), folder / "INDEX.md"
    if a.check:
        if not index.exists() or index.read_text() != text:
            print(f"{index} is out of date: run python3 bench/index_results.py", file=sys.stderr)
            return 1
        return 0
    index.write_text(text)
    print(f"wrote {index} ({text.count(chr(10)) - 6} results)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
