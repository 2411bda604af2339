"""bench/index_results.py: bench/results/INDEX.md lists every result JSON and is what the script writes."""
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
