"""The canary of a publication: proof that a server samples from the weights it loaded.

The transaction's verify step (``relayrl.sync.transaction``) proves by checksum that the
weights were delivered; the canary, run on the first publication and then every
``train.publish_canary_every``-th, that each server samples from them: it samples
:data:`CANARY_TOKENS` tokens after a fixed prompt, and their logprobs must equal the
trainer's under the published weights (a copy of the trainer's model taken with the
snapshot) within ``train.publish_canary_tolerance`` (e.g. a load that reached the checkpoint
tensors but not a tied LM head's cached GEMM handle fails it). The checksum catches a
one-step-stale server exactly; the canary only a difference above its tolerance. Under LoRA
it also fails a server that serves the base model where the trainer's adapters move the
logprobs. A server the canary cannot reach is restarted by the supervisor (loading this
publication) and the canary runs again, as a request fails over.

Owns: :class:`Canary` (when it is due, its tolerance), :class:`CanaryCheck` (the rounds on
every server, its reference model and counters) and :func:`reference_logprobs`.

Imports: relayrl.engine.client, relayrl.launch.supervisor (the restart of an unreachable
server) and the transaction (its step deadline and error).
"""

from __future__ import annotations

import asyncio
import copy
import sys
import threading
import time
from dataclasses import dataclass

import torch

from relayrl.engine.client import RolloutClient, RolloutServerError
from relayrl.launch.supervisor import ServerSupervisor
from relayrl.sync.transaction import Deadlines, PublicationError, run_step
from relayrl.sync.transports.base import WeightSource

CANARY_PROMPT = [3, 4, 5, 6, 7, 8, 9, 10]  # token ids: any model's vocabulary has them
CANARY_TOKENS = 8
CANARY_SEED = 1234
CANARY_FAILOVERS = 8  # canary rounds repeated after a server was found unreachable


@dataclass(frozen=True)
class Canary:
    """``every``: the canary runs on the first publication and then every ``every``-th
    (``train.publish_canary_every``, 0 = never); ``tolerance``: the largest |Δ logprob|
    (nats) allowed between a server's and the trainer's for the same weights
    (``train.publish_canary_tolerance``)."""

    every: int = 10
    tolerance: float = 1e-2

    def due(self, index: int) -> bool:
        return self.every > 0 and index % self.every == 0


def reference_logprobs(
    model: torch.nn.Module, prompt: list[int], output: list[int], temperature: float = 1.0
) -> list[float]:
    """The trainer's view of a sample: ``log_softmax(logits / T)`` of each output token."""
    device = next(model.parameters()).device
    with torch.no_grad():
        ids = torch.tensor([prompt + output], device=device)
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        picked = logp.gather(-1, torch.tensor(output, device=device)[:, None])[:, 0]
    return [float(x) for x in picked.cpu()]


class CanaryCheck:
    """The canary of a run's publications (see the module docstring): :meth:`reference`
    copies the trainer's model when the canary is due, :meth:`run` checks every server."""

    def __init__(
        self,
        canary: Canary,
        supervisor: ServerSupervisor,
        deadlines: Deadlines,
        served_dtype: torch.dtype | None = None,
    ) -> None:
        self.canary, self.supervisor, self.deadlines = canary, supervisor, deadlines
        # the servers' weights dtype when it is not the trainer's (rollout.dtype): the
        # reference is the trainer's model rounded to it
        self.served_dtype = served_dtype
        self.runs = 0  # canaries run
        self.seconds = 0.0  # their time in all
        self.max_diff = 0.0  # the largest |Δ logprob| a canary saw
        self._reference_lock = threading.Lock()  # canaries share the reference model

    def reference(self, trainer: WeightSource, index: int) -> torch.nn.Module | None:
        """A copy of the trainer's model when publication ``index`` (0-based) runs the
        canary, else None (blocking; the trainer is held meanwhile, and trains on after)."""
        if not self.canary.due(index):
            return None
        try:
            reference = copy.deepcopy(trainer.model).eval()
            if self.served_dtype is not None:
                reference = reference.to(self.served_dtype)
        except Exception as exc:  # noqa: BLE001 - e.g. a sharded model: no canary
            print(f"warning: no canary ({exc!r})", file=sys.stderr, flush=True)
            self.canary = Canary(every=0)
            return None
        return reference

    async def run(self, version: int, reference: torch.nn.Module) -> None:
        """Each server samples :data:`CANARY_TOKENS` tokens after a fixed prompt; their
        logprobs must equal the trainer's under the published weights (``reference``)
        within the tolerance, and carry ``version``. Under the step deadline.

        A server found unreachable fails over as a request does: the supervisor restarts
        it (the replacement loads this publication, the newest) and the canary runs again
        on every server, at most :data:`CANARY_FAILOVERS` times; the supervisor's limit on
        restarts still ends the run. (Raised as is, a server lost just after the load
        stopped the run while the supervisor was restarting it.)"""
        start = time.perf_counter()
        for failovers in range(CANARY_FAILOVERS + 1):
            try:
                await self._canary_round(version, reference)
                break
            except RolloutServerError as exc:
                if not exc.unreachable or failovers == CANARY_FAILOVERS:
                    raise
                await self.supervisor.recover(exc.url)
        self.runs += 1
        self.seconds += time.perf_counter() - start

    async def _canary_round(self, version: int, reference: torch.nn.Module) -> None:
        """One canary on every current server, under one step deadline."""
        client = self.supervisor.client
        end = asyncio.get_running_loop().time() + self.deadlines.step_s
        calls = {u: self._canary_on(client, u, version, reference) for u in client.urls}
        await run_step(self.deadlines, end, version, "canary", calls)

    async def _canary_on(
        self, client: RolloutClient, url: str, version: int, reference: torch.nn.Module
    ) -> None:
        params = {
            "max_new_tokens": CANARY_TOKENS,
            "temperature": 1.0,
            "seed": CANARY_SEED,
            "ignore_eos": True,
        }
        out = await client.generate_once(list(CANARY_PROMPT), params, url=url)
        if not out.output_ids or any(v != version for v in out.output_versions):
            raise PublicationError(
                version,
                "canary",
                [url],
                f"{len(out.output_ids)} tokens labelled {sorted(set(out.output_versions))}",
            )
        expected, base = await asyncio.to_thread(self._reference_view, reference, out.output_ids)
        pairs = zip(out.output_logprobs, expected, strict=True)
        diff = max(abs(a - b) for a, b in pairs)
        self.max_diff = max(self.max_diff, diff)
        if base is not None:
            self._adapter_applied(url, version, out.output_logprobs, expected, base)
        if diff > self.canary.tolerance:
            raise PublicationError(
                version,
                "canary",
                [url],
                f"its logprobs of a fixed prompt differ from the trainer's for the same weights "
                f"by up to {diff:.3g} nats (> train.publish_canary_tolerance="
                f"{self.canary.tolerance:g}): it does not serve the published weights",
            )

    def _reference_view(
        self, reference: torch.nn.Module, output: list[int]
    ) -> tuple[list[float], list[float] | None]:
        """The trainer's logprobs of a canary's ``output`` and, for a peft (LoRA) policy, the
        base model's (its adapters disabled). One server's canary at a time: disabling the
        adapters changes the shared model, so a concurrent canary computed without the lock
        saw the base model as the trainer's."""
        prompt = list(CANARY_PROMPT)
        with self._reference_lock:
            expected = reference_logprobs(reference, prompt, list(output))
            if getattr(reference, "disable_adapter", None) is None:
                return expected, None
            with reference.disable_adapter():
                return expected, reference_logprobs(reference, prompt, list(output))

    def _adapter_applied(
        self,
        url: str,
        version: int,
        served_logprobs: list[float],
        expected: list[float],
        base: list[float],
    ) -> None:
        """A LoRA policy's canary: where the trainer's logprobs differ from the base model's
        by more than the tolerance, the server's must too; a server that matches the base
        there serves the base model, not the adapter (issue 32: an adapter never applied)."""
        adapted = max(abs(a - b) for a, b in zip(expected, base, strict=True))
        served = max(abs(a - b) for a, b in zip(served_logprobs, base, strict=True))
        tolerance = self.canary.tolerance
        if adapted > tolerance and served <= tolerance:
            raise PublicationError(
                version,
                "canary",
                [url],
                f"it serves the base model, not the published LoRA adapter: its logprobs of a "
                f"fixed prompt equal the base model's (max |Δ| {served:.3g} nats) where the "
                f"trainer's differ from them by up to {adapted:.3g} nats",
            )

    def stats(self) -> dict[str, float]:
        """The canary's counters for the run's summary (none when it never ran)."""
        if not self.runs:
            return {}
        return {
            "publish_canaries": float(self.runs),
            "publish_canary_mean_s": self.seconds / self.runs,
            "publish_canary_max_logprob_diff": self.max_diff,
        }


__all__ = ["CANARY_PROMPT", "Canary", "CanaryCheck", "reference_logprobs"]
