"""D-ARL inside the trainer step: which samples a step trains and how their losses combine.

Owns: :class:`ReplayStep` (the replay buffer of a run, variance-guided selection of
replayed samples, the multi-behaviour loss terms, per-version metrics, checkpoint state),
:class:`PolicySnapshots` (the last weight versions, for the balance heuristic) and
:func:`trajectory_scores`. The trainer (``relayrl.train.trainer``) calls, per step:

1. ``candidates(fresh, v)``: the fresh samples (from the controller, always trained once;
   their staleness is bounded by η at admission) followed by the buffer's replay
   candidates (trained before, fewer than ``max_reuse`` times, oldest version ≥ v − K + 1,
   none during warm-up);
2. the no-grad proximal pass over all candidates (π_prox per token);
3. ``select(...)``: scores ``s = mean_t (π_prox/μ − 1)²``; a replayed candidate is kept when
   ``s`` is within ``replay.quantile`` of the *fresh* samples' scores (or under
   ``replay.threshold``); at most ``batch_fraction · #fresh`` of them, lowest scores first;
4. ``loss_terms(...)``: ``α_k`` and the per-token coefficients ``α_k/N_k`` over the whole
   step (``relayrl.algo.darl.behaviour_plan``), or the balance-heuristic weights;
5. after the optimizer step, ``finish(...)``: fresh samples enter the buffer, every trained
   sample counts one use, samples outside the window are evicted.

Metric keys are indexed by lag = trainer version − behaviour version, so there are at most
max(η, K − 1) + 1 of each: ``replay_count_v<lag>`` (samples trained, by oldest-token
version), ``replay_kept_fraction_v<lag>`` and ``replay_score_v<lag>`` (replay candidates),
``darl_ess_v<lag>`` and ``darl_alpha_v<lag>`` (tokens, by the version that produced them).

Imports: torch, relayrl.algo.darl, relayrl.buffer, the Trajectory record, the config and
the weight history.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from relayrl.algo.darl import (
    BehaviourPlan,
    balance_heuristic_logweights,
    behaviour_plan,
    selection_cutoff,
    variance_scores,
)
from relayrl.buffer.replay import ReplayBuffer
from relayrl.config.schema import ReplayConfig
from relayrl.rollout.trajectory import Trajectory
from relayrl.train.weight_history import WeightHistory

# (model, trajectories) -> per-trajectory completion logprobs, no grad (the trainer's pass)
LogprobsFn = Callable[[torch.nn.Module, Sequence[Trajectory]], list[Tensor]]


def _flat(values: Sequence[Tensor]) -> Tensor:
    return torch.cat([v.reshape(-1).double() for v in values]) if values else torch.zeros(0)


def _split(flat: Tensor, trajs: Sequence[Trajectory]) -> list[Tensor]:
    return list(torch.split(flat, [len(t.completion_ids) for t in trajs]))


def _behav(trajs: Sequence[Trajectory]) -> Tensor:
    return torch.tensor([lp for t in trajs for lp in t.behav_logprobs], dtype=torch.float64)


def _token_versions(trajs: Sequence[Trajectory]) -> Tensor:
    return torch.tensor([v for t in trajs for v in t.versions], dtype=torch.long)


def trajectory_scores(trajs: Sequence[Trajectory], prox: Sequence[Tensor]) -> list[float]:
    """``s_i = mean_t (π_prox/μ − 1)²`` of each trajectory (0 for an empty completion)."""
    if not trajs:
        return []
    seq = torch.repeat_interleave(
        torch.arange(len(trajs)), torch.tensor([len(t.completion_ids) for t in trajs])
    )
    p = _flat(prox)
    scores = variance_scores(p, _behav(trajs), torch.ones_like(p, dtype=torch.bool), seq)
    out = scores.tolist()
    return out + [0.0] * (len(trajs) - len(out))  # trailing empty completions


class PolicySnapshots:
    """The weights of the last ``keep`` versions (a full-state
    :class:`~relayrl.train.weight_history.WeightHistory`), to score samples under each
    recent behaviour policy (the balance heuristic): one forward pass per version, on a
    scratch copy of the model."""

    def __init__(self, keep: int) -> None:
        self.history = WeightHistory(keep, full_state=True, purpose="the balance heuristic")
        self._scratch: torch.nn.Module | None = None

    @property
    def versions(self) -> list[int]:
        return self.history.versions

    def store(self, version: int, model: torch.nn.Module) -> None:
        """Remember ``model``'s weights as ``version``."""
        self.history.add(version, model)

    def logprobs(
        self, version: int, model: torch.nn.Module, trajs: Sequence[Trajectory], fn: LogprobsFn
    ) -> list[Tensor]:
        """Per-trajectory logprobs under the stored weights of ``version``."""
        state = self.history.weights(version)
        if self._scratch is None:
            self._scratch = copy.deepcopy(model).requires_grad_(False)
        self._scratch.load_state_dict(state)
        return fn(self._scratch, trajs)

    def state_dict(self) -> dict[str, Any]:
        return self.history.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history.load_state_dict(state)


@dataclass
class ReplayBatch:
    """What one step trains: the fresh samples then the selected replayed ones, with their
    π_prox logprobs (one tensor per trajectory, over its completion tokens)."""

    trajs: list[Trajectory]
    prox: list[Tensor]
    n_fresh: int
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def replayed(self) -> list[Trajectory]:
        return self.trajs[self.n_fresh :]


@dataclass
class LossTerms:
    """Per-trajectory loss inputs of the step. ``normalizer=None``: use the step's usual
    ``loss_normalizer``; a number: the multi-behaviour coefficients already normalise."""

    per_token: dict[str, list[Tensor]]
    normalizer: float | None
    stats: dict[str, float]


class ReplayStep:
    """D-ARL for one run (see the module docstring); ``eta`` bounds fresh staleness."""

    def __init__(self, cfg: ReplayConfig, eta: int, model: torch.nn.Module) -> None:
        self.cfg = cfg
        self.buffer = ReplayBuffer(cfg.k, cfg.max_reuse, cfg.warmup)
        self.weighting = cfg.weighting if cfg.pmis else "uniform"
        self.snapshots: PolicySnapshots | None = None
        if self.weighting == "balance":
            self.snapshots = PolicySnapshots(keep=max(eta, cfg.k - 1) + 1)
            self.snapshots.store(0, model)

    # ------------------------------------------------------------------ selection
    def candidates(self, fresh: Sequence[Trajectory], version: int) -> list[Trajectory]:
        """Fresh samples first, then the buffer's replay candidates at ``version``."""
        self.buffer.evict(version)
        replay = self.buffer.candidates(version, step=version)
        for t in replay:
            if t.staleness(version) > self.cfg.k - 1:  # the buffer's window guarantees it
                raise AssertionError(f"replayed sample of staleness {t.staleness(version)}")
        return list(fresh) + replay

    def _cutoff(self, fresh_scores: list[float]) -> float:
        if self.cfg.select == "none":
            return math.inf
        return selection_cutoff(fresh_scores, self.cfg.quantile, self.cfg.threshold)

    def select(
        self, cands: Sequence[Trajectory], prox: Sequence[Tensor], n_fresh: int, version: int
    ) -> ReplayBatch:
        """Keep every fresh sample and the selected replayed ones (see module docstring)."""
        scores = trajectory_scores(cands, prox)
        cutoff = self._cutoff(scores[:n_fresh])
        kept = [i for i in range(n_fresh, len(cands)) if scores[i] <= cutoff]
        if self.cfg.select == "variance":
            kept.sort(key=lambda i: scores[i])  # stable: arrival order among equal scores
        else:
            kept.sort(key=lambda i: -cands[i].oldest_version)  # newest first
        chosen = kept[: int(self.cfg.batch_fraction * n_fresh)]
        index = list(range(n_fresh)) + chosen
        batch = ReplayBatch([cands[i] for i in index], [prox[i] for i in index], n_fresh)
        batch.stats = self._selection_stats(cands, scores, n_fresh, set(kept), index, version)
        if math.isfinite(cutoff):
            batch.stats["replay_cutoff"] = cutoff
        return batch

    def _selection_stats(
        self,
        cands: Sequence[Trajectory],
        scores: list[float],
        n_fresh: int,
        kept: set[int],
        trained: list[int],
        version: int,
    ) -> dict[str, float]:
        stats = {
            "replay_fresh": float(n_fresh),
            "replay_candidates": float(len(cands) - n_fresh),
            "replay_replayed": float(len(trained) - n_fresh),
            "replay_buffer_size": float(len(self.buffer)),
        }
        if n_fresh:
            stats["replay_fresh_score_mean"] = sum(scores[:n_fresh]) / n_fresh
        by_lag: dict[int, list[int]] = {}
        for i in range(n_fresh, len(cands)):
            by_lag.setdefault(cands[i].staleness(version), []).append(i)
        for lag, idx in sorted(by_lag.items()):
            stats[f"replay_kept_fraction_v{lag}"] = sum(i in kept for i in idx) / len(idx)
            stats[f"replay_score_v{lag}"] = sum(scores[i] for i in idx) / len(idx)
        for i in trained:
            key = f"replay_count_v{cands[i].staleness(version)}"
            stats[key] = stats.get(key, 0.0) + 1.0
        return stats

    # ------------------------------------------------------------------ the loss
    def loss_terms(
        self, batch: ReplayBatch, version: int, model: torch.nn.Module, fn: LogprobsFn
    ) -> LossTerms:
        """α_k over the step's tokens grouped by the version that produced them; with
        ``ess`` the per-token coefficients ``α_k/N_k`` (normaliser 1), with ``balance``
        the per-token balance-heuristic log-weights (pooled token mean)."""
        prox, behav = _flat(batch.prox), _behav(batch.trajs)
        versions = _token_versions(batch.trajs)
        mask = torch.ones_like(prox, dtype=torch.bool)
        plan = behaviour_plan(prox, behav, mask, versions, self.weighting)
        stats: dict[str, float] = {}
        for k in plan.alphas:
            stats[f"darl_ess_v{version - k}"] = plan.ess[k]
            stats[f"darl_alpha_v{version - k}"] = plan.alphas[k]
        if self.weighting == "ess":
            coef = plan.token_coef(versions, mask)
            return LossTerms({"token_coef": _split(coef, batch.trajs)}, 1.0, stats)
        if self.weighting == "balance":
            log_w = self._balance_logweights(batch, prox, behav, versions, plan, version, model, fn)
            return LossTerms({"log_is_weight": _split(log_w, batch.trajs)}, None, stats)
        return LossTerms({}, None, stats)

    def _balance_logweights(
        self,
        batch: ReplayBatch,
        prox: Tensor,
        behav: Tensor,
        versions: Tensor,
        plan: BehaviourPlan,
        version: int,
        model: torch.nn.Module,
        fn: LogprobsFn,
    ) -> Tensor:
        """Per token ``log π_prox(y_t) − log Σ_j (n_j/N) μ_j(y_t)``: ``μ_j`` is the engine's
        logprob for the token's own version, the stored weights of version j otherwise
        (π_prox itself for j = v); ``n_j`` = the step's tokens of version j."""
        assert self.snapshots is not None
        rows = []
        for j in plan.token_counts:
            if j == version:
                row = prox
            else:
                row = _flat(self.snapshots.logprobs(j, model, batch.trajs, fn))
            rows.append(torch.where(versions == j, behav, row))
        counts = list(plan.token_counts.values())
        return balance_heuristic_logweights(prox, torch.stack(rows), counts)

    # ------------------------------------------------------------------ bookkeeping
    def finish(self, batch: ReplayBatch, new_version: int, model: torch.nn.Module) -> None:
        """After the optimizer step: store fresh samples, count one use of every trained
        sample, evict what left the window; remember the new weights for ``balance``."""
        self.buffer.add(batch.trajs[: batch.n_fresh])
        self.buffer.mark_trained(batch.trajs)
        self.buffer.evict(new_version)
        if self.snapshots is not None:
            self.snapshots.store(new_version, model)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"buffer": self.buffer.state_dict()}
        if self.snapshots is not None:
            state["snapshots"] = self.snapshots.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.buffer.load_state_dict(state["buffer"])
        if self.snapshots is not None and "snapshots" in state:
            self.snapshots.load_state_dict(state["snapshots"])
