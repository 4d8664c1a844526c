"""The staleness bound η of a run: fixed, or ``rollout.eta=auto``, chosen anew after every
training step.

Owns: :class:`StalenessBound` (``rollout.eta`` as a run uses it: the hard bound the trainer
and a restored controller check against, the bound admission starts from, the rule when
there is one), :func:`is_auto` (the one test of a setting for ``auto``), :class:`AutoEta`
(the rule), :data:`AUTO`, :data:`DEFAULT_ETA`, :data:`DEFAULT_ETA_BUDGET`, :data:`INITIAL_ETA`,
:data:`ETA_SMOOTHING`.
The derivation, the default budget and the evidence are in docs/async.md ("η = auto").

After each step the rule gets what the step measured for free:

- ``drift``: the per-version drift k_t of the trained batch, the behaviour-vs-proximal KL
  of its stale tokens per version of staleness, Σ KL(μ ‖ π_v) / Σ staleness over the tokens
  sampled by older weights (``relayrl.algo.losses.stale_kl_per_version``; None when the
  batch has no stale token);
- (live runs only) ``latency_s``, the batch's generation latency (its slowest group's
  admission to completion), and ``train_s``, the trainer's compute seconds of the step.

Both are smoothed by an exponential moving average with weight :data:`ETA_SMOOTHING` on
the newest value: k̂ and r̂ = latency / train time. The targets:

- drift: η_kl = ⌊budget / k̂⌋, the largest η whose predicted staleness KL η·k̂ stays within
  ``rollout.eta_budget`` (η_max while no stale token has been seen);
- busy: η_busy = ⌈r̂⌉, the versions the trainer completes while one batch is generated, so
  that a group admitted now is not held back by the bound (η_max without timings, as in lag
  emulation, where generation and training alternate and timing must not enter);

target = clamp(min(η_kl, η_busy), 1, η_max). The bound moves towards it by shrinking at
once and growing by one per step, and grows only once a drift has been measured: a
too-large η costs accuracy at once, a too-small one only throughput. The rule is a pure
function of its inputs, so lag emulation stays deterministic.

Imports: nothing of relayrl.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

# rollout.eta's value that lets the rule below choose the bound
AUTO: Literal["auto"] = "auto"

# the default fixed η (rollout.eta), and the largest bound auto may choose (rollout.eta_max):
# auto then only lowers the bound where the drift is high (docs/async.md)
DEFAULT_ETA = 4

# the default rollout.eta_budget (a KL in nats per token), derived in docs/async.md from the
# lag-emulation study's two regimes as the rule measures them: low drift reaches η = 8 when
# budget ≥ 8·max k̂ = 1.4e-3, high drift stays at η = 1 when budget < 2·min k̂ = 3.4e-3; the
# default is about the geometric mean of the two ends (2.2e-3), rounded
DEFAULT_ETA_BUDGET = 2e-3

# the bound before any measurement: the safe end (a too-small η costs only throughput)
INITIAL_ETA = 1

# weight of the newest measurement in the moving averages of the drift and the timing ratio
ETA_SMOOTHING = 0.5


def _smooth(old: float | None, new: float) -> float:
    return new if old is None else (1.0 - ETA_SMOOTHING) * old + ETA_SMOOTHING * new


class AutoEta:
    """The self-tuning staleness bound: :attr:`eta` is the bound in force;
    :meth:`update` feeds one step's measurements and returns the next bound."""

    def __init__(
        self, eta_max: int, budget: float = DEFAULT_ETA_BUDGET, initial: int = INITIAL_ETA
    ) -> None:
        if eta_max < 1:
            raise ValueError(f"rollout.eta_max must be >= 1 with rollout.eta=auto, got {eta_max}")
        if budget <= 0:
            raise ValueError(f"rollout.eta_budget must be > 0, got {budget}")
        self.eta_max = eta_max
        self.budget = budget
        self.eta = min(max(initial, 1), eta_max)
        self.drift: float | None = None  # k̂: smoothed KL per version of staleness
        self.busy_ratio: float | None = None  # r̂: smoothed generation latency / train time

    def drift_target(self) -> int:
        """η_kl = ⌊budget / k̂⌋ (η_max before any drift is measured or when k̂ is 0)."""
        if self.drift is None or self.drift <= 0:
            return self.eta_max
        return int(min(self.budget / self.drift, self.eta_max))

    def busy_target(self) -> int:
        """η_busy = ⌈r̂⌉ (η_max without timings)."""
        if self.busy_ratio is None:
            return self.eta_max
        return int(min(math.ceil(self.busy_ratio), self.eta_max))

    def target(self) -> int:
        return min(max(min(self.drift_target(), self.busy_target()), 1), self.eta_max)

    def update(
        self,
        drift: float | None,
        latency_s: float | None = None,
        train_s: float | None = None,
    ) -> int:
        """One step's measurements (``drift`` None: the batch had no stale token; timings
        None: not measured) → the bound for what is admitted next."""
        if drift is not None and math.isfinite(drift):
            self.drift = _smooth(self.drift, max(drift, 0.0))
        if latency_s is not None and train_s is not None and train_s > 0:
            self.busy_ratio = _smooth(self.busy_ratio, latency_s / train_s)
        target = self.target()
        if target < self.eta:
            self.eta = target
        elif target > self.eta and self.drift is not None:
            self.eta += 1
        return self.eta

    def state_dict(self) -> dict[str, Any]:
        return {"eta": self.eta, "drift": self.drift, "busy_ratio": self.busy_ratio}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.eta = min(max(int(state["eta"]), 1), self.eta_max)
        self.drift = state.get("drift")
        self.busy_ratio = state.get("busy_ratio")


def is_auto(eta: object) -> bool:
    """Whether a setting of η (``rollout.eta``, a staleness-grid cell's) is ``auto``."""
    return eta == AUTO


@dataclass(frozen=True)
class StalenessBound:
    """``rollout.eta`` (with ``eta_max`` and ``budget``, read only with ``auto``) as a run
    uses it. Every sample trained is at most :attr:`hard` versions staler than the oldest
    weights that produced it; admission starts at :attr:`initial`, and with ``auto``
    :meth:`rule` moves the bound in force within [1, :attr:`hard`] after each step."""

    eta: int | Literal["auto"]
    eta_max: int = DEFAULT_ETA
    budget: float = DEFAULT_ETA_BUDGET

    def __post_init__(self) -> None:
        self.validate(self.eta)  # eta_max and budget: AutoEta checks them (rule)

    @staticmethod
    def validate(eta: object) -> int | Literal["auto"]:
        """``eta`` if it is a setting of ``rollout.eta`` (a non-negative int or ``auto``)."""
        if is_auto(eta) or (isinstance(eta, int) and not isinstance(eta, bool) and eta >= 0):
            return eta  # type: ignore[return-value]
        raise ValueError(f"rollout.eta must be a non-negative integer or 'auto', got {eta!r}")

    @property
    def auto(self) -> bool:
        """The rule chooses the bound (``rollout.eta=auto``)."""
        return is_auto(self.eta)

    @property
    def hard(self) -> int:
        """The largest bound of the run: η, or ``eta_max`` with ``auto``. What the trainer
        checks every sample against, the lag-emulation weight history keeps (+1), a restored
        controller and a replay check, and the vLLM adapter slots are sized by (+1)."""
        return self.eta_max if self.auto else int(self.eta)

    @property
    def initial(self) -> int:
        """The admission bound before any step: η, or with ``auto`` :data:`INITIAL_ETA`
        (the safe end; the rule's first bound)."""
        return INITIAL_ETA if self.auto else int(self.eta)

    def rule(self) -> AutoEta | None:
        """A fresh :class:`AutoEta` starting at :attr:`initial` with ``auto``, else None."""
        return AutoEta(self.eta_max, self.budget, self.initial) if self.auto else None
