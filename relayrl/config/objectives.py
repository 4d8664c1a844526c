"""The ``algo`` keys the registered objectives declare: each policy loss's and advantage
estimator's own parameters (its ``Params``, ``relayrl.algo.params``), composed into the run
config's ``algo`` section next to the section's shared keys: ``algo.gspo_eps_low``,
``algo.cispo_cap``, a plugin's.

Owns: :class:`ObjectiveKey` (one such key and the objective that declares it),
:func:`objective_keys` (all of them, checked for clashes) and :func:`selected_params` (the
values an ``algo`` mapping gives them → the selected loss's and advantage's validated
``Params``).

A key of an objective that is not selected is accepted at its default and dropped: a config
that ``relayrl config`` printed or a run saved before lists such keys at their defaults, and
they change nothing. Set to any other value it is an error, because the value would change
nothing either (the message names the objective that reads it).

Imports: relayrl.algo (the loss and advantage registries), pydantic, the standard library.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic.fields import FieldInfo

from relayrl.algo.advantages import ADVANTAGES
from relayrl.algo.losses import LOSSES
from relayrl.algo.params import ObjectiveParams, validate_params
from relayrl.registry import Registry

# the algo key that selects an objective → the registry it names
SEAMS: dict[str, Registry[Any]] = {"loss": LOSSES, "advantage": ADVANTAGES}


@dataclass(frozen=True)
class ObjectiveKey:
    """The key ``algo.<name>``, a field of the ``Params`` of the objective ``owner``, which
    ``algo.<seam>=<owner>`` selects (``seam``: ``"loss"`` or ``"advantage"``)."""

    name: str
    seam: str
    owner: str
    field: FieldInfo

    def reference_field(self) -> FieldInfo:
        """The field as the config reference shows it: its description says who reads it."""
        shown = copy.copy(self.field)
        shown.description = f"({self.seam}={self.owner} only) {self.field.description or ''}"
        return shown


def objective_keys(shared: Collection[str]) -> dict[str, ObjectiveKey]:
    """Every key the registered objectives declare, losses first, each in registration
    order. A key that two objectives declare, or that is one of the section's ``shared``
    keys, is a ``ValueError`` naming both: the ``algo`` section is one namespace."""
    out: dict[str, ObjectiveKey] = {}
    for seam, registry in SEAMS.items():
        for owner in list(registry):
            for name, field in registry.lookup(owner).Params.model_fields.items():
                taken = f"the shared key algo.{name}" if name in shared else None
                if name in out:
                    taken = f"{out[name].seam} {out[name].owner!r}'s parameter too"
                if taken is not None:
                    raise ValueError(
                        f"{seam} {owner!r} declares the parameter {name!r}, {taken}; name an "
                        f"objective's parameters after it (e.g. {owner}_{name})"
                    )
                out[name] = ObjectiveKey(name, seam, owner, field)
    return out


def selected_params(
    given: Mapping[str, Any], selected: Mapping[str, Any], shared: Collection[str]
) -> dict[str, ObjectiveParams]:
    """``{seam: Params}`` of the objectives ``selected`` names (``{"loss": "gspo", ...}``)
    from ``given``, the values of the ``algo`` keys that are not ``shared`` ones: each
    selected objective's keys validated by its ``Params`` (unset: the defaults). A key no
    objective declares, or one of an objective not selected set to other than its default,
    is a ``ValueError``. A seam whose selected name is not registered is left out (the
    section's own check reports the name)."""
    keys = objective_keys(shared)
    for name, value in given.items():
        key = keys.get(name)
        if key is None:
            close = difflib.get_close_matches(name, [*shared, *keys], n=1)
            hint = f"; did you mean 'algo.{close[0]}'?" if close else ""
            raise ValueError(f"unknown config key 'algo.{name}'{hint}")
        default = key.field.get_default(call_default_factory=True)
        if selected.get(key.seam) != key.owner and value != default:
            raise ValueError(
                f"algo.{name}={value!r} is a parameter of the {key.seam} {key.owner!r}, and "
                f"algo.{key.seam}={selected.get(key.seam)!r} does not read it; select "
                f"algo.{key.seam}={key.owner} or remove algo.{name}"
            )
    out = {}
    for seam, registry in SEAMS.items():
        owner = selected.get(seam)
        if not isinstance(owner, str) or owner not in registry:
            continue
        params_class = registry.lookup(owner).Params
        own = {k: v for k, v in given.items() if k in params_class.model_fields}
        out[seam] = validate_params(params_class, own, f"the {seam} {owner!r}", "algo.")
    return out
