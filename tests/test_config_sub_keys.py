"""An override of one key inside a dataset keeps the rest of it: ``rollout.dataset`` and
``eval.datasets`` entries given as a plain path (``{data: PATH}`` written short) keep the
path when an override sets one of their keys, and ``eval.datasets.N.KEY`` (or
``eval.datasets[N].KEY``) sets a key of one entry instead of replacing the list."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from relayrl.cli import main
from relayrl.config.loader import load_config
from relayrl.config.schema import DataSource, EvalDataset
from relayrl.errors import RelayError

CONFIG = """\
rollout:
  dataset: train.jsonl
eval:
  datasets:
    - test.jsonl
    - {data: other.jsonl, name: other}
"""


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(CONFIG)
    return path


def test_a_sub_key_override_keeps_the_dataset_path(config_file: Path) -> None:
    config = load_config(
        config_file,
        [
            "rollout.dataset.prompt_field=question",
            "eval.datasets.0.answer_field=solution",
            "eval.datasets[1].grader=exact",
        ],
    )
    assert config.rollout.dataset == DataSource(data="train.jsonl", prompt_field="question")
    assert config.eval.datasets == [
        EvalDataset(data="test.jsonl", answer_field="solution"),
        EvalDataset(data="other.jsonl", name="other", grader="exact"),
    ]


def test_overrides_in_order_build_one_dataset() -> None:
    config = load_config(None, ["rollout.dataset=qa.jsonl", "rollout.dataset.template={q}?"])
    assert config.rollout.dataset == DataSource(data="qa.jsonl", template="{q}?")
    with pytest.raises(RelayError, match=r"rollout\.dataset\.data.*Field required"):
        load_config(None, ["rollout.dataset.template={q}?"])  # no path anywhere: still an error


def test_relayrl_config_prints_the_kept_path(config_file: Path, capsys) -> None:
    argv = ["config", "--config", str(config_file), "rollout.dataset.prompt_field=question"]
    assert main(argv) == 0
    dataset = yaml.safe_load(capsys.readouterr().out)["rollout"]["dataset"]
    assert (dataset["data"], dataset["prompt_field"]) == ("train.jsonl", "question")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "eval.datasets.2.grader=exact",
            "'eval.datasets' is a list; name an entry by its index (0 to 1)",
        ),
        (
            "eval.datasets.grader=exact",
            "'eval.datasets' is a list; name an entry by its index (0 to 1)",
        ),
    ],
)
def test_an_entry_that_is_not_there_is_an_error(
    config_file: Path, override: str, message: str
) -> None:
    with pytest.raises(
        RelayError, match=f"override '[^']+': {message}".replace("(", r"\(").replace(")", r"\)")
    ):
        load_config(config_file, [override])


def test_no_list_to_set_an_entry_of_is_an_error() -> None:
    with pytest.raises(RelayError, match=r"'eval\.datasets' has no entries to set a key of"):
        load_config(None, ["eval.datasets.0.grader=exact"])
