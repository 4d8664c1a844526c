"""The parameters an objective declares for itself: a policy loss's or an advantage
estimator's own hyperparameters (GSPO's clip range, CISPO's cap, a plugin's).

Owns: :class:`ObjectiveParams` (the base of each objective's ``Params`` model),
:class:`Objective` (what the loss and advantage seams share: ``Params`` and the validated
``params`` an instance reads) and :func:`validate_params`. The run config composes every
registered objective's ``Params`` fields into ``algo.<field>`` keys, with their defaults,
constraints and descriptions (``relayrl.config.objectives``), so an objective with
parameters is still one class and one registry line, and each default is written once, in
its ``Params``.

Imports: pydantic and the standard library.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError


class ObjectiveParams(BaseModel):
    """An objective's own parameters: fields with a default, constraints and a
    ``description`` (``pydantic.Field``); each becomes the run config key ``algo.<field>``.
    Name them after the objective (``gspo_eps_low``, ``cispo_cap``): they share the ``algo``
    section with every other objective's parameters and the shared keys, and a name
    declared twice is an error when the config is composed. The base declares none."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Objective:
    """A registered objective (a policy loss, an advantage estimator) and its own
    parameters: ``Params`` (a subclass of :class:`ObjectiveParams`, declared on the class)
    and ``params``, the validated values this instance reads."""

    Params: ClassVar[type[ObjectiveParams]] = ObjectiveParams

    def __init__(self, params: ObjectiveParams | None = None) -> None:
        if params is None:
            params = self.Params()
        if type(params) is not self.Params:
            raise TypeError(
                f"{type(self).__name__} takes its own {self.Params.__qualname__}, "
                f"got {type(params).__qualname__}"
            )
        self.params = params


def validate_params(
    params_class: type[ObjectiveParams], values: Mapping[str, Any], owner: str, prefix: str = ""
) -> ObjectiveParams:
    """``values`` validated by ``params_class`` (unset ones take their defaults). A
    ``ValueError`` names the key (after ``prefix``, e.g. ``"algo."``): one the class does
    not declare (with the nearest it does), or a value its constraints refuse. ``owner``
    says whose parameters they are, e.g. ``"loss 'gspo'"``."""
    declared = list(params_class.model_fields)
    for key in values:
        if key not in declared:
            close = difflib.get_close_matches(key, declared, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            own = ", ".join(declared) if declared else "none"
            raise ValueError(f"{prefix}{key} is not a parameter of {owner} (its own: {own}){hint}")
    try:
        return params_class.model_validate(dict(values))
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(part) for part in err["loc"])
        raise ValueError(
            f"{prefix}{key} = {err.get('input')!r} is invalid: {err['msg']} (a parameter of "
            f"{owner})"
        ) from None
