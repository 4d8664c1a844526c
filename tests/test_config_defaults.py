"""Each setting's default is written once, by the part that uses it (issue 46: ``eps_high``
was 0.2 in the loss and 0.28 in the config, ``dynamic_sampling`` False in the controller and
True in the config, ``max_running_requests`` 64 in the engine and 128 in the config). The run
config reads those defaults from the owner's options class; this test reads schema.py's
source, so a literal written there again fails here even while the two values agree.

A loss's or an advantage estimator's own parameters (``gspo_eps_*``, ``cispo_cap``) are
declared by its ``Params`` alone and composed into ``algo.<name>`` keys: the test reads all
of relayrl's source and fails on a second declaration of one anywhere, and on a literal
default of a shared loss knob outside ``LossConfig``."""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from relayrl.algo.losses import LossConfig
from relayrl.config import schema
from relayrl.config.loader import load_config
from relayrl.config.objectives import SEAMS
from relayrl.engine.types import EngineOptions
from relayrl.rollout.controller import ControllerOptions

SCHEMA = Path(schema.__file__)
PACKAGE = SCHEMA.parents[1]

LOSS_FIELDS = [knob.name for knob in LossConfig.shared_knobs()]
CONTROLLER_ALGO = ["advantage", "gamma", "overlong_buffer", "overlong_penalty", "dynamic_sampling"]

# (config section, owner, the name schema.py gives the owner, the settings it owns there)
OWNED = [
    (schema.AlgoConfig, LossConfig, "LOSS", LOSS_FIELDS),
    (schema.AlgoConfig, ControllerOptions, "CONTROLLER", CONTROLLER_ALGO),
    (schema.RolloutConfig, ControllerOptions, "CONTROLLER", ["temperature", "top_p"]),
    (schema.RolloutConfig, EngineOptions, "ENGINE", ["max_running_requests", "max_adapters"]),
    (schema.RolloutConfig, EngineOptions, "ENGINE", ["share_prefill"]),
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


def objective_parameters() -> dict[str, type]:
    """``{parameter: the Params class declaring it}`` of every registered loss and advantage."""
    return {
        name: registry.lookup(owner).Params
        for registry in SEAMS.values()
        for owner in list(registry)
        for name in registry.lookup(owner).Params.model_fields
    }


def declarations(source: str) -> Iterator[tuple[str, str, ast.expr]]:
    """``(scope, name, default)`` of every class field and function parameter with a default
    in ``source``; ``scope`` is the dotted path of the enclosing classes and functions."""

    def walk(node: ast.AST, scope: str) -> Iterator[tuple[str, str, ast.expr]]:
        for child in ast.iter_child_nodes(node):
            function = isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef)
            named = function or isinstance(child, ast.ClassDef)
            inner = f"{scope}.{child.name}".lstrip(".") if named else scope
            if function:
                a = child.args
                with_default = [*a.posonlyargs, *a.args][::-1][: len(a.defaults)][::-1]
                pairs = [
                    *zip(with_default, a.defaults, strict=True),
                    *zip(a.kwonlyargs, a.kw_defaults, strict=True),
                ]
                yield from ((inner, arg.arg, d) for arg, d in pairs if d is not None)
            is_field = isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name)
            if is_field and child.value is not None and isinstance(node, ast.ClassDef):
                yield scope, child.target.id, child.value
            yield from walk(child, inner)

    yield from walk(ast.parse(source), "")


def is_literal(default: ast.expr) -> bool:
    """Whether a default is a value written out (``0.28``, ``Field(0.28, ge=0)``) rather
    than read from its owner (``LOSS.eps_high``)."""
    if isinstance(default, ast.Call) and ast.unparse(default.func) in ("Field", "field"):
        given = [k.value for k in default.keywords if k.arg == "default"]
        if not (default.args or given):
            return False
        default = default.args[0] if default.args else given[0]
    try:
        ast.literal_eval(default)
    except ValueError:
        return False
    return True


def second_declarations(source: str, module: str) -> list[str]:
    """Where ``source`` (the module ``module``) declares a loss's setting again: an
    objective's parameter outside its ``Params``, or a shared knob of the loss with a
    literal default outside ``LossConfig``."""
    parameters, knobs = objective_parameters(), set(LOSS_FIELDS)
    found = []
    for scope, name, default in declarations(source):
        owner = parameters.get(name)
        if owner is not None and (module, scope) != (owner.__module__, owner.__qualname__):
            found.append(f"{module}:{scope}.{name} (declared by {owner.__qualname__})")
        owns_knob = (module, scope) == (LossConfig.__module__, LossConfig.__qualname__)
        if name in knobs and is_literal(default) and not owns_knob:
            found.append(f"{module}:{scope}.{name} = {ast.unparse(default)} (LossConfig's)")
    return found


def test_a_loss_setting_is_declared_once_in_the_package():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        found += second_declarations(path.read_text(), module.removesuffix(".__init__"))
    assert not found, "a loss's setting declared again:\n" + "\n".join(found)


def test_a_second_declaration_of_a_loss_setting_is_found():
    source = (
        "class AlgoConfig(Section):\n"
        "    cispo_cap: float = Field(LOSS.cispo_cap, gt=0)\n"
        "    eps_high: float = Field(0.28, ge=0)\n"
        "    eps_low: float = Field(LOSS.eps_low)\n"
        "def clip(ratio, gspo_eps_low=3e-4, *, eps_low=0.2, kl_coef=KL):\n"
        "    pass\n"
    )
    assert second_declarations(source, "relayrl.config.schema") == [
        "relayrl.config.schema:AlgoConfig.cispo_cap (declared by CISPOLoss.Params)",
        "relayrl.config.schema:AlgoConfig.eps_high = Field(0.28, ge=0) (LossConfig's)",
        "relayrl.config.schema:clip.gspo_eps_low (declared by GSPOLoss.Params)",
        "relayrl.config.schema:clip.eps_low = 0.2 (LossConfig's)",
    ]


@pytest.mark.parametrize("name", sorted(objective_parameters()))
def test_an_objective_parameter_is_an_algo_key_with_its_default(name):
    """``algo.<name>`` shows the ``Params`` default, and a run that selects the objective
    hands that default to it."""
    params = objective_parameters()[name]
    default = params.model_fields[name].default
    assert schema.AlgoConfig.accepted_fields()[name].default == default
    [(seam, owner)] = [
        (seam, owner)
        for seam, registry in SEAMS.items()
        for owner in list(registry)
        if registry.lookup(owner).Params is params
    ]
    algo = load_config(None, [f"algo.{seam}={owner}"]).algo
    assert getattr(algo.params_of(seam), name) == getattr(algo, name) == default
