"""The global random-number generators of this process, as checkpoint state.

Owns: :class:`RngState` (python, numpy, torch CPU and CUDA generators to and from JSON), the
``rng`` component of every checkpoint (``relayrl.train.resume.checkpoints``): a resumed run
draws the same numbers as the uninterrupted one.

Imports: numpy, torch.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


class RngState:
    """The global RNGs of this process (python, numpy, torch CPU and CUDA) as JSON."""

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state: dict[str, Any] = {
            "python": [version, list(internal), gauss],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": torch.get_rng_state().tolist(),
        }
        if torch.cuda.is_available():
            state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(
                [torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]]
            )
