"""Which requests run: the request tables, KV-slot assignment, admission, retraction.

Owns :class:`Scheduler`: the waiting queue (FIFO; retracted requests go back to its head),
the running list (row ``i`` of the batch holds KV slot ``i``), the id table, admission
within the row count, the prefill token budget and the KV memory budget, slot release (the last row moves into
each hole so the running rows stay dense) and finishing a request into its
:class:`~relayrl.engine.types.GenerationResult`. Touched only by the engine's loop thread.

Imports: relayrl.engine (kv cache, sequence, types).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from relayrl.engine.kv import SlotKVCache
from relayrl.engine.sequence import Sequence
from relayrl.engine.types import FinishReason, GenerationResult


class Scheduler:
    def __init__(
        self,
        cache: SlotKVCache,
        num_slots: int,
        max_prefill_tokens: int,
        stats: dict[str, Any],
        kv_budget_tokens: int | None = None,
    ) -> None:
        self.cache = cache
        self.num_slots = num_slots
        self.kv_budget_tokens = kv_budget_tokens  # None: rows bounded by num_slots only
        self.max_prefill_tokens = max_prefill_tokens
        self.stats = stats  # the engine's counters, shared
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, Sequence] = {}

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, seq: Sequence) -> None:
        if seq.rid in self.requests:
            seq.future.set_exception(ValueError(f"duplicate request id {seq.rid!r}"))
            return
        self.requests[seq.rid] = seq
        self.waiting.append(seq)

    def abort(self, rid: str) -> bool:
        """Finish one live request with ``abort``; False if it is not live."""
        seq = self.requests.get(rid)
        if seq is None:
            return False
        if seq.row >= 0:
            self.release([seq])
        else:
            self.waiting.remove(seq)
        self.finish(seq, "abort")
        return True

    def abort_all(self) -> list[GenerationResult]:
        """Finish every running and queued request with ``abort`` (partial outputs)."""
        live = list(self.running) + list(self.waiting)
        self.release(list(self.running))
        self.waiting.clear()
        return [self.finish(seq, "abort") for seq in live]

    def fail_all(self, exc: BaseException) -> None:
        """A model step raised: every live request gets the error; the tables empty."""
        for seq in list(self.requests.values()):
            if not seq.future.done():
                seq.future.set_exception(exc)
        self.requests.clear()
        self.waiting.clear()
        self.running.clear()

    def retract_all(self) -> None:
        """Free every running request's KV; they go back to the head of the queue, shortest
        first: they are all re-admitted at once (their slots are free), and length order
        lets each left-padded prefill batch hold sequences of similar length (measured on
        the demo workload: 1.5× fewer padded tokens per weight update than slot order)."""
        self.retract(list(self.running))

    def retract(self, seqs: list[Sequence]) -> None:
        """Retract the running ``seqs`` as :meth:`retract_all` does all of them."""
        if not seqs:
            return
        running = sorted(seqs, key=lambda s: s.row)
        self.release(running)
        for seq in running:
            seq.retracted = True
        self.stats["retracted"] += len(running)
        self.waiting.extendleft(sorted(running, key=lambda s: -len(s.all_ids())))

    def release(self, seqs: list[Sequence]) -> None:
        """Free the slots of running ``seqs``: the last row moves into each hole."""
        if len(seqs) == len(self.running):
            for seq in seqs:
                seq.row, seq.kv_len = -1, 0
            self.running.clear()
            return
        for seq in sorted(seqs, key=lambda s: s.row, reverse=True):
            last = self.running[-1]
            if last is not seq:
                self.cache.move_row(last.row, seq.row, last.kv_len)
                self.running[seq.row] = last
                last.row = seq.row
            self.running.pop()
            seq.row, seq.kv_len = -1, 0

    def finish(self, seq: Sequence, reason: FinishReason, matched=None) -> GenerationResult:
        """Resolve ``seq``'s future with its result (the caller released its slot)."""
        self.requests.pop(seq.rid, None)
        now = time.perf_counter()
        result = GenerationResult(
            rid=seq.rid,
            prompt_ids=seq.prompt_ids,
            output_ids=list(seq.output_ids),
            output_logprobs=list(seq.output_logprobs),
            output_versions=list(seq.output_versions),
            finish_reason=reason,
            prompt_tokens=len(seq.prompt_ids),
            time_to_first_token=(
                seq.first_token_at - seq.submitted_at if seq.first_token_at else None
            ),
            latency=now - seq.submitted_at,
            matched_stop=matched,
            output_top_logprobs=list(seq.output_top_logprobs),
        )
        if not seq.future.done():
            seq.future.set_result(result)
        self.stats["aborted"] += reason == "abort"
        return result

    def fits_kv_budget(self, rows: int, longest: int) -> bool:
        """Whether ``rows`` running requests of at most ``longest`` tokens each fit the KV
        budget (the cache is a rows x longest rectangle, relayrl.engine.kv)."""
        return self.kv_budget_tokens is None or rows * longest <= self.kv_budget_tokens

    def admit(self) -> list[Sequence]:
        """Pop waiting requests into free rows within the prefill token budget and the KV
        budget (every running request counted at its longest: prompt + max_new_tokens)."""
        admitted: list[Sequence] = []
        longest = max((s.max_length for s in self.running), default=0)
        while self.waiting and len(self.running) < self.num_slots:
            n = len(self.waiting[0].prompt_ids) + len(self.waiting[0].output_ids)
            padded = max([n] + [len(s.all_ids()) for s in admitted]) * (len(admitted) + 1)
            if admitted and padded > self.max_prefill_tokens:
                break
            longest = max(longest, self.waiting[0].max_length)
            if self.running and not self.fits_kv_budget(len(self.running) + 1, longest):
                self.stats["kv_budget_waits"] += 1
                break
            seq = self.waiting.popleft()
            seq.row = len(self.running)
            self.running.append(seq)
            admitted.append(seq)
        return admitted
