"""bench/results/*.json: every result says what it answers, where and when it ran, on which commit and how."""
import json
import re
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
NAME = re.compile(r"(\d{4}-\d{2}-\d{2})_[a-z0-9]+(_[a-z0-9]+)*\.json")  # <date>_<device>_<what>.json
HASH = re.compile(r"\b[0-9a-f]{7,40}\b")
COMMAND_FIELDS = ("command", "commands", "device_command")  # one command, several (per run or call), or the device's


def result_problems(path: Path) -> list:
    name = NAME.fullmatch(path.name)
    if not name:
        return ["name is not <date>_<device>_<what>.json"]
    try:
        d = json.loads(path.read_text())
    except ValueError as e:
        return [f"not JSON ({e})"]
    if not isinstance(d, dict):
        return ["not a JSON object"]
    problems = [f"no {field}" for field in ("question", "device") if not (isinstance(d.get(field), str) and d[field])]
    if not str(d.get("date", "")).startswith(name.group(1)):
        problems.append(f"date {d.get('date')!r} is not the name's {name.group(1)}")
    if not HASH.search(str(d.get("commit", ""))):
        problems.append("commit names no commit hash")
    if not any(d.get(field) for field in COMMAND_FIELDS):
        problems.append(f"none of {', '.join(COMMAND_FIELDS)}")
    return problems


def test_every_result_json_names_its_question_device_date_commit_and_command():
    paths = sorted(RESULTS.glob("*.json"))
    assert len(paths) > 30
    bad = {p.name: result_problems(p) for p in paths}
    assert {name: problems for name, problems in bad.items() if problems} == {}


def test_results_hold_json_only_and_no_archived_logs():
    assert sorted({p.suffix for p in RESULTS.iterdir()}) == [".json"]


@pytest.mark.parametrize("name, content, problem", [
    ("2030-01-02_h100x1_x.json", dict(device="H100", date="2030-01-02", commit="abcdef1", command="c"), "no question"),
    ("2030-01-02_h100x1_x.json", dict(question="q", device="H100", date="2030-01-03", commit="abcdef1", commands=["c"]),
     "date '2030-01-03' is not the name's 2030-01-02"),
    ("2030-01-02_h100x1_x.json", dict(question="q", device="H100", date="2030-01-02", commit="HEAD", command="c"),
     "commit names no commit hash"),
    ("2030-01-02_h100x1_x.json", dict(question="q", device="H100", date="2030-01-02", commit="abcdef1"),
     "none of command, commands, device_command"),
    ("bench.json", dict(question="q", device="H100", date="2030-01-02", commit="abcdef1", command="c"),
     "name is not <date>_<device>_<what>.json"),
])
def test_a_result_missing_a_field_is_named_with_what_it_lacks(tmp_path, name, content, problem):
    (tmp_path / name).write_text(json.dumps(content))
    assert result_problems(tmp_path / name) == [problem]
    good = dict(question="q", device="H100", date="2030-01-02T10:00:00+00:00", commit="new 0123abc; base 4567def",
                commands={"a": "python3 bench/bench.py"})
    (tmp_path / "2030-01-02_h200x2_ok.json").write_text(json.dumps(good))
    assert result_problems(tmp_path / "2030-01-02_h200x2_ok.json") == []
