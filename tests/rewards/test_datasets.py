"""Loading real benchmark files and user files, with precise errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.errors import RelayError
from relayrl.tasks.datasets import DATASETS, FieldMap, load_problems
from tests.conftest import FIXTURE_DATA, rows_in

FULL_ROWS = {
    "gsm8k": 1319,
    "math500": 500,
    "aime24": 30,
    "aime25": 30,
    "humaneval": 164,
    "math_train": 7470,
}


def test_known_datasets_load(benchmark_data: Path) -> None:
    for name, full in FULL_ROWS.items():
        problems = load_problems(name, data_root=benchmark_data)
        count = rows_in(benchmark_data, DATASETS[name].path)
        assert count == full or benchmark_data == FIXTURE_DATA, (name, count)
        assert len(problems) == count, name
        assert len({p.id for p in problems}) == count
    gsm = load_problems("gsm8k", data_root=benchmark_data, limit=1)[0]
    assert gsm.grader == "math" and gsm.answer == "18" and "####" in gsm.prompt
    assert gsm.prompt.startswith("Janet")
    math500 = load_problems("math500", data_root=benchmark_data, limit=1)[0]
    assert "\\boxed{}" in math500.prompt and math500.meta["math"]["modes"][0] == "boxed"
    he = load_problems("humaneval", data_root=benchmark_data, limit=1)[0]
    assert he.grader == "code" and he.meta["entry_point"] == "has_close_elements"
    assert "def check" in he.meta["test"] and he.meta["prompt"] in he.prompt


def test_env_data_root(benchmark_data: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELAYRL_DATA", str(benchmark_data))
    assert len(load_problems("aime25")) == rows_in(benchmark_data, "aime25/test.jsonl")
    monkeypatch.setenv("RELAYRL_DATA", "/nonexistent")
    with pytest.raises(RelayError, match="RELAYRL_DATA"):
        load_problems("aime25")


def test_template_override(benchmark_data: Path) -> None:
    p = load_problems("aime24", data_root=benchmark_data, template="Q: {problem}\nA:", limit=1)[0]
    assert p.prompt.startswith("Q: Every morning") and p.prompt.endswith("A:")


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_user_jsonl_fields_and_errors(tmp_path: Path) -> None:
    good = _write(
        tmp_path / "mine.jsonl",
        [json.dumps({"qid": f"q{i}", "q": "1+1?", "a": "2"}) for i in range(3)],
    )
    problems = load_problems(str(good), fields=FieldMap(id="qid", prompt="q", answer="a"))
    assert [p.id for p in problems] == ["q0", "q1", "q2"] and problems[0].answer == "2"

    rows = [json.dumps({"id": str(i), "prompt": "x", "answer": "1"}) for i in range(6)]
    bad_json = _write(tmp_path / "bad.jsonl", rows + ["{not json"])
    with pytest.raises(RelayError, match=r"bad\.jsonl:7: bad JSON"):
        load_problems(str(bad_json))
    missing = _write(
        tmp_path / "missing.jsonl", rows[:5] + [json.dumps({"id": "x", "prompt": "p"})]
    )
    with pytest.raises(RelayError, match=r"missing\.jsonl:6: row missing field 'answer'"):
        load_problems(str(missing))
    dup = _write(tmp_path / "dup.jsonl", rows[:2] + rows[:1])
    with pytest.raises(RelayError, match="duplicate id"):
        load_problems(str(dup))


def test_unknown_name_suggests() -> None:
    with pytest.raises(RelayError, match="did you mean 'gsm8k'"):
        load_problems("gsm8")
    with pytest.raises(RelayError, match="did you mean 'math500'"):
        load_problems("math-500")


def test_a_saved_datasets_directory_loads_its_split(tmp_path: Path) -> None:
    """What ``datasets``' ``save_to_disk`` wrote (one Dataset, or a DatasetDict and its
    split) loads like a file, offline; a bad split or a plain directory is one error."""
    datasets = pytest.importorskip("datasets")
    datasets.disable_progress_bars()
    rows = {"id": ["a", "b"], "question": ["1+1?", "2+2?"], "gold": ["2", "4"]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "one"))
    fields = FieldMap(prompt="question", answer="gold")
    one = load_problems(str(tmp_path / "one"), fields=fields)
    assert [(p.id, p.answer, p.grader) for p in one] == [("a", "2", "math"), ("b", "4", "math")]

    train = datasets.Dataset.from_dict({"id": ["t"], "question": ["3+3?"], "gold": ["6"]})
    test = datasets.Dataset.from_dict({"id": ["s"], "question": ["4+4?"], "gold": ["8"]})
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "two"))
    assert [p.id for p in load_problems(str(tmp_path / "two"), fields=fields)] == ["s"]
    assert [p.id for p in load_problems(str(tmp_path / "two"), fields=fields, split="train")] == [
        "t"
    ]
    with pytest.raises(RelayError, match=r"two has splits \['test', 'train'\], not 'validation'"):
        load_problems(str(tmp_path / "two"), fields=fields, split="validation")
    with pytest.raises(RelayError, match=r"two\[test\]:1: cannot tell which grader"):
        load_problems(str(tmp_path / "two"))  # the default field names
    (tmp_path / "plain").mkdir()
    with pytest.raises(RelayError, match="plain is a directory but not a saved dataset"):
        load_problems(str(tmp_path / "plain"))
