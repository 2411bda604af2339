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
    "2026-11-22_h100x1_bench_fused_64x128.json":
        "Full benchmark with the fused FP8 head at its first tile (64x128, 8 warps)",
    "2026-11-22_h100x1_bench_static_fused_64x128.json":
        "Does one graph for all stages cost step time? --static control of ..._bench_fused_64x128 (same machine)",
    "2026-11-22_h100x1_ce_kernel_variants.json":
        "Which tile of the fused CE-backward kernel is fastest, against the unfused path? (32x128, 4 warps)",
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
