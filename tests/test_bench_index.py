"""bench/index_results.py: bench/results/INDEX.md lists every result JSON and is what the script writes; and
bench/val_steps.py's comparison of two sets of runs, which result JSONs quote."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import index_results  # noqa: E402


def test_the_committed_index_lists_every_result_json_and_is_current():
    index = (index_results.RESULTS / "INDEX.md").read_text()
    listed = [line.split("`")[1] for line in index.splitlines() if line.startswith("| `")]
    assert sorted(listed) == sorted(p.name for p in index_results.RESULTS.glob("*.json")), \
        "a result without an index line (or a line without a result): run python3 bench/index_results.py"
    assert index == index_results.render(), "INDEX.md is stale: run python3 bench/index_results.py"


def test_every_hand_written_question_belongs_to_a_result():
    assert set(index_results.QUESTIONS) <= {p.name for p in index_results.RESULTS.glob("*.json")}


def test_rows_come_from_the_json_fields(tmp_path):
    (tmp_path / "2030-01-02_h200x1_new.json").write_text(json.dumps(dict(
        date="2030-01-02T10:00:00+00:00", device="NVIDIA H200 (fresh machine), torch 2.12",
        commit="0123456789abcdef0123456789abcdef01234567", question="Is the new thing faster?")))
    (tmp_path / "2030-01-01_h100x1_ab.json").write_text(json.dumps(dict(
        date="2030-01-01", device="NVIDIA H100", a=dict(commit="abcdef1 (seeds 1, 2)"), b=dict(commit="1234567"),
        question="A or B?")))
    text = index_results.render(tmp_path)
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows == ["| `2030-01-01_h100x1_ab.json` | 2030-01-01 | NVIDIA H100 | abcdef1/1234567 | A or B? |",
                    "| `2030-01-02_h200x1_new.json` | 2030-01-02 | NVIDIA H200 | 0123456 | Is the new thing faster? |"]
    assert index_results.main(["--folder", str(tmp_path), "--check"]) == 1
    assert index_results.main(["--folder", str(tmp_path)]) == 0
    assert index_results.main(["--folder", str(tmp_path), "--check"]) == 0


def test_a_result_without_a_question_is_an_error(tmp_path):
    (tmp_path / "2030-01-01_x.json").write_text(json.dumps(dict(date="2030-01-01", device="GPU", commit="abcdef1")))
    with pytest.raises(SystemExit, match="2030-01-01_x.json has no \"question\""):
        index_results.render(tmp_path)


def test_val_steps_reports_the_welch_interval_and_the_smallest_shift_the_runs_could_detect():
    """Per checkpoint: the difference of the means, Welch's p and 95 % interval, and (t_0.975 + t_0.8) x the standard
    error as the shift two sets of this size and spread could detect; steps one set lacks, or with one run, skipped."""
    import math
    import val_steps
    from scipy import stats
    a, b = [2.40, 2.41, 2.39, 2.40], [2.42, 2.43, 2.41]
    new = {310: dict(mean=sum(a) / 4, n=4, losses=a), 100: dict(mean=3.2, n=1, losses=[3.2])}
    prior = {310: dict(mean=sum(b) / 3, n=3, losses=b), 100: dict(mean=3.1, n=2, losses=[3.1, 3.0])}
    out = val_steps.compare_sets(new, prior)
    assert list(out) == [310]
    row = out[310]
    se = math.sqrt(stats.tvar(a) / 4 + stats.tvar(b) / 3)
    df = se ** 4 / ((stats.tvar(a) / 4) ** 2 / 3 + (stats.tvar(b) / 3) ** 2 / 2)
    assert row["diff"] == pytest.approx(-0.02) and row["df"] == pytest.approx(df)
    assert row["p"] == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue)
    assert row["ci95"] == pytest.approx([-0.02 - stats.t.ppf(0.975, df) * se, -0.02 + stats.t.ppf(0.975, df) * se])
    assert row["detectable_shift"] == pytest.approx((stats.t.ppf(0.975, df) + stats.t.ppf(0.8, df)) * se)
    assert (row["n_new"], row["n_prior"]) == (4, 3)
