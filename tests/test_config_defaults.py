"""Each setting's default is written once, by the part that uses it (issue 46: ``eps_high``
was 0.2 in the loss and 0.28 in the config, ``dynamic_sampling`` False in the controller and
True in the config, ``max_running_requests`` 64 in the engine and 128 in the config). The run
config reads those defaults from the owner's options class; this test reads schema.py's
source, so a literal written there again fails here even while the two values agree."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from relayrl.algo.losses import LossConfig
from relayrl.config import schema
from relayrl.engine.types import EngineOptions
from relayrl.rollout.controller import ControllerOptions

SCHEMA = Path(schema.__file__)

LOSS_FIELDS = [f.name for f in dataclasses.fields(LossConfig) if f.init]
CONTROLLER_ALGO = ["advantage", "gamma", "overlong_buffer", "overlong_penalty", "dynamic_sampling"]

# (config section, owner, the name schema.py gives the owner, the settings it owns there)
OWNED = [
    (schema.AlgoConfig, LossConfig, "LOSS", LOSS_FIELDS),
    (schema.AlgoConfig, ControllerOptions, "CONTROLLER", CONTROLLER_ALGO),
    (schema.RolloutConfig, ControllerOptions, "CONTROLLER", ["temperature", "top_p"]),
    (schema.RolloutConfig, EngineOptions, "ENGINE", ["max_running_requests", "max_adapters"]),
    (schema.ModelConfig, EngineOptions, "ENGINE", ["device", "dtype"]),
]


def written_defaults(source: str, section: str) -> dict[str, str]:
    """``{field: its default as written}`` for the annotated fields of class ``section``:
    ``Field``'s first argument (or ``default=``), else the assigned value."""
    [node] = [
        n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == section
    ]
    out = {}
    for item in node.body:
        if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
            continue
        value = item.value
        if isinstance(value, ast.Call) and ast.unparse(value.func) == "Field":
            keyword = [k.value for k in value.keywords if k.arg == "default"]
            value = value.args[0] if value.args else (keyword[0] if keyword else None)
        if value is not None:
            out[item.target.id] = ast.unparse(value)
    return out


@pytest.mark.parametrize(
    "section, owner, alias, names", OWNED, ids=lambda x: getattr(x, "__name__", "")
)
def test_the_config_reads_each_default_from_its_owner(section, owner, alias, names):
    written = written_defaults(SCHEMA.read_text(), section.__name__)
    defaults = {f.name: f.default for f in dataclasses.fields(owner)}
    for name in names:
        assert written.get(name) == f"{alias}.{name}", (
            f"{section.__name__}.{name} is written as {written.get(name)!r} in schema.py; its "
            f"default belongs to {owner.__name__} (write {alias}.{name})"
        )
        assert section.model_fields[name].default == defaults[name], name


def test_a_literal_written_twice_is_found():
    source = (
        "class AlgoConfig(Section):\n"
        "    eps_high: float = Field(0.28, ge=0)\n"
        "    eps_low: float = Field(LOSS.eps_low)\n"
        "    kl_estimator: str = LOSS.kl_estimator\n"
    )
    assert written_defaults(source, "AlgoConfig") == {
        "eps_high": "0.28",
        "eps_low": "LOSS.eps_low",
        "kl_estimator": "LOSS.kl_estimator",
    }


def test_every_loss_setting_is_a_config_key():
    """A loss's own hyperparameters (``gspo_eps_*``, ``cispo_cap``) reach the run config."""
    assert set(LOSS_FIELDS) <= set(schema.AlgoConfig.model_fields)
