"""The trainer's weights at its last few versions, kept in memory.

Owns: :class:`WeightHistory`, used by lag emulation (``relayrl.train.run.lagged``: the
weights v − d an in-process engine generates with) and by D-ARL's balance heuristic
(``relayrl.train.replay_step.PolicySnapshots``: each recent behaviour policy's logprobs).
Memory: ``keep`` copies of the weights, on the model's device.

Imports: torch, relayrl.errors.
"""

from __future__ import annotations

from typing import Any

import torch

from relayrl.errors import RelayError


class WeightHistory:
    """Copies of a model's weights at its last ``keep`` versions.

    ``full_state=False`` keeps ``named_parameters`` (a tied tensor once, as the engine's
    loader expects); ``True`` keeps the whole ``state_dict`` (buffers included, for
    ``load_state_dict``). ``purpose`` names the user in the error for a version not kept."""

    def __init__(self, keep: int, full_state: bool = False, purpose: str = "lag emulation"):
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self.keep, self.full_state, self.purpose = keep, full_state, purpose
        self._states: dict[int, dict[str, torch.Tensor]] = {}

    def add(self, version: int, model: torch.nn.Module) -> None:
        """Remember ``model``'s weights as ``version``; forget versions older than the
        last ``keep``."""
        named = model.state_dict().items() if self.full_state else model.named_parameters()
        self._states[version] = {n: p.detach().clone() for n, p in named}
        for old in [v for v in self._states if v <= version - self.keep]:
            del self._states[old]

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        if version not in self._states:
            raise RelayError(
                f"{self.purpose} needs the weights of version {version}, but only versions "
                f"{self.versions} are kept"
            )
        return self._states[version]

    @property
    def versions(self) -> list[int]:
        return sorted(self._states)

    def state_dict(self) -> dict[str, Any]:
        return {"keep": self.keep, "states": {str(v): s for v, s in self._states.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._states = {int(v): s for v, s in state["states"].items()}
