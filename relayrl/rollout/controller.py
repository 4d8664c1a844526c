"""The rollout controller: feeds prompts to the rollout servers under the staleness bound η
and hands complete, graded groups to the trainer in admission order.

Owns: :func:`request_seed`, :func:`admission_capacity` (the bound), :func:`assign_advantages`,
:class:`PublishedVersion` (the read-only view of the published version admission reads: a
live run's ``relayrl.sync.clock.VersionClock``, else :class:`OwnPublishedVersion`) and
:class:`RolloutController` (asyncio: admission loop, one task per group, reward shaping,
DAPO filtering, batches with their advantages). What happens to one admitted prompt is the
rollout workflow's (``relayrl.rollout.workflow``: by default its n samples generated in one
call, each with its own seed, and graded in one call); the prompt order is
``relayrl.rollout.prompts``.

Admission (AReaL): with B prompts per step, published weight version p and bound η, a new
group is admitted only while ``accepted + running < (p + η + 1)·B`` (and the concurrency
limit allows). ``accepted`` counts every group that completed and was kept (consumed or
not); groups rejected by the dynamic-sampling filter, by an error or because a sample came
back still aborted (the client gave up resubmitting it) do not count, so their replacements
are admitted at once. Batches are taken **in admission order**: the group
admitted with rank r among kept groups is trained at step ⌊r/B⌋ ≤ p + η, and all its tokens
come from weights ≥ p, so its staleness is at most η whatever the completion order (see
docs/async.md for the proof and why completion order would not give this).

Dynamic sampling drops at most ``max_filtered_per_step`` groups between two batches handed
out (``algo.max_filtered_per_step`` × B); past that, an all-equal group is kept and fills a
slot of the batch (``accepted_uniform_groups``), so a nearly solved task costs the trainer a
few wasted slots instead of a wait for the rare group that still carries an advantage.

On-policy distillation (``distill.teacher``): a completed group's tokens are scored by the
teacher server before the group is kept (``relayrl.rollout.distill``, one request per group),
and its samples' advantages get the per-token reverse-KL reward when the batch is handed out.

Imports: the engine's plain types and client error, the algo helpers, the Trajectory record,
relayrl.rollout (workflow, prompts, the staleness bound). Generation, decoding and grading
are injected callables, so tests can drive the controller with fakes and the trainer with the
real servers.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from relayrl.algo.advantages import (
    advantage_estimator,
    compute_advantages,
    compute_token_advantages,
    dynamic_sampling_keep,
    overlong_penalty,
)
from relayrl.algo.params import ObjectiveParams
from relayrl.engine.client import RolloutServerError
from relayrl.engine.types import SamplingParams
from relayrl.errors import RelayError
from relayrl.rollout.distill import TeacherScorer, apply_distillation
from relayrl.rollout.eta import StalenessBound
from relayrl.rollout.prompts import PromptLoader
from relayrl.rollout.trajectory import StalenessError, Trajectory, check_staleness
from relayrl.rollout.workflow import (
    EpisodeWorkflow,
    GenerateFn,
    GenerateGroupFn,
    GroupRequest,
    RolloutServices,
    RolloutWorkflow,
    Sample,
    ScoreGroupFn,
)
from relayrl.tasks.base import Problem


def request_seed(run_seed: int, prompt_index: int, sample_index: int) -> int:
    """Seed of sample ``sample_index`` of the ``prompt_index``-th prompt drawn in a run."""
    return ((run_seed * 1_000_003 + prompt_index) * 1_009 + sample_index) % (2**63 - 1)


def auto_concurrency(concurrency: int, prompts_per_step: int, n_samples: int) -> int:
    """``rollout.concurrency``, with -1 meaning 2·B·n requests in flight: enough to keep the
    servers' batch full while the trainer works, few enough that the next batch's groups are
    not queued behind (η + 1)·B·n requests (measured: first batch 0.96 s → 0.56 s at η = 4)."""
    return 2 * prompts_per_step * n_samples if concurrency < 0 else concurrency


def admission_capacity(published_version: int, eta: int, prompts_per_step: int) -> int:
    """How many groups may have been accepted or be running: ``(p + η + 1)·B``."""
    return (published_version + eta + 1) * prompts_per_step


def assign_advantages(
    groups: Sequence[Sequence[Trajectory]],
    method: str,
    gamma: float = 1.0,
    params: ObjectiveParams | None = None,
) -> None:
    """Set every sample's ``advantage`` from the groups' rewards: the one place advantages
    are computed (``relayrl.algo.advantages``, the estimator ``method`` with its own
    ``params``), over the whole training batch. A per-token estimator sets
    ``token_advantages`` too (``advantage``: their mean over model tokens)."""
    rewards = [[t.reward for t in g] for g in groups]
    if advantage_estimator(method).per_token:
        masks = [[t.model_mask for t in g] for g in groups]
        per_token = compute_token_advantages(rewards, masks, method, gamma=gamma, params=params)
        for group, advantages in zip(groups, per_token, strict=True):
            for traj, adv in zip(group, advantages, strict=True):
                traj.token_advantages = adv
                traj.advantage = sum(adv) / max(traj.num_model_tokens, 1)
        return
    per_sample = compute_advantages(rewards, method, params=params)
    for group, advantages in zip(groups, per_sample, strict=True):
        for traj, adv in zip(group, advantages, strict=True):
            traj.advantage = adv


class AbortedSample(RuntimeError):
    """A sample came back still aborted (the client gave up resubmitting it): its group is
    rejected (``rejected_aborted``) and replaced, never trained as if complete."""


class PublishedVersion(Protocol):
    """A read-only view of the newest weight version every rollout server serves (p of the
    admission bound). A live run's is its ``relayrl.sync.clock.VersionClock``, which only
    ``WeightSync`` moves: the controller reads it there and keeps no copy of its own."""

    @property
    def published(self) -> int: ...


@dataclass
class OwnPublishedVersion:
    """The published version of a controller that no publisher drives (lag emulation, tests):
    :meth:`RolloutController.set_published_version` moves it."""

    published: int = 0


def filter_cap(per_step: float | None, prompts_per_step: int) -> int | None:
    """``algo.max_filtered_per_step`` (a multiple of B) as a number of groups per step."""
    return None if per_step is None else max(1, math.ceil(per_step * prompts_per_step))


@dataclass
class ControllerOptions:
    """What the controller needs from the run config (see ``RolloutConfig``/``AlgoConfig``)."""

    n_samples: int
    prompts_per_step: int
    staleness: StalenessBound  # rollout.eta: admission starts at .initial, set_eta moves it
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    concurrency: int = 0
    max_context: int | None = None
    advantage: str = "grpo"
    advantage_params: ObjectiveParams | None = None  # the estimator's own (None: its defaults)
    gamma: float = 1.0
    distill: bool = False  # on-policy distillation: the controller is given a teacher
    distill_coef: float = 1.0
    distill_task_weight: float = 1.0
    dynamic_sampling: bool = True
    max_filtered_per_step: int | None = None  # None: dynamic sampling waits for as long as it takes
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    seed: int = 0
    max_consecutive_errors: int = 20
    max_consecutive_filtered: int = 2000

    def __post_init__(self) -> None:
        if self.dynamic_sampling and self.n_samples < 2:
            raise RelayError(
                "algo.dynamic_sampling needs rollout.n_samples >= 2 (a group of one sample "
                "always has equal rewards and would always be dropped)"
            )


class GroupStatus(StrEnum):
    """Where an admitted group is: generating and grading, complete (waits to be trained in
    admission order) or rejected (filtered, or a failure; its slot is given back)."""

    RUNNING = "running"
    READY = "ready"
    REJECTED = "rejected"


@dataclass
class Group:
    """The n samples of one prompt; ``index`` is the admission rank (trained in this order)."""

    index: int
    prompt_index: int
    problem: Problem
    prompt_ids: list[int]
    submit_version: int
    admitted_at: float
    eta: int = 0  # the staleness bound in force when the group was admitted
    completed_at: float | None = None
    trajectories: list[Trajectory] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    status: GroupStatus = GroupStatus.RUNNING

    @property
    def key(self) -> str:
        return f"g{self.index}"


class RolloutController:
    """Admits groups under the staleness bound, generates, grades and batches them.

    Call :meth:`start` inside a running event loop, :meth:`next_batch` from the training
    loop, :meth:`set_published_version` after every weight publication and :meth:`stop`
    at the end. ``encode(problem) -> prompt ids``, ``decode(ids) -> text``; for multi-turn
    episodes ``generate`` (one request; default: a one-sample ``generate_group``) and
    ``encode_text(text) -> ids`` (observations). ``published``: where the published version
    is read (a live run's ``VersionClock``); None: the controller's own, which
    :meth:`set_published_version` moves.
    """

    def __init__(
        self,
        loader: PromptLoader,
        options: ControllerOptions,
        generate_group: GenerateGroupFn,
        score_group: ScoreGroupFn,
        encode: Callable[[Problem], list[int]],
        decode: Callable[[list[int]], str],
        published: PublishedVersion | None = None,
        workflow: RolloutWorkflow | None = None,
        generate: GenerateFn | None = None,
        encode_text: Callable[[str], list[int]] | None = None,
        teacher: TeacherScorer | None = None,
    ) -> None:
        if options.distill and teacher is None:
            raise RelayError("on-policy distillation needs a teacher (distill.teacher)")
        self.loader = loader
        self.opt = options
        self._teacher = teacher if options.distill else None
        self.workflow = workflow if workflow is not None else EpisodeWorkflow()
        extra: dict[str, Any] = {"generate": generate}
        if encode_text is not None:
            extra["encode_text"] = encode_text
        self._services = RolloutServices(generate_group, score_group, decode, **extra)
        self._encode = encode
        self._published = published if published is not None else OwnPublishedVersion()
        self.consumed_version = self.published_version  # batches handed out (trainer version)
        self.accepted = 0
        self.counters: Counter[str] = Counter()
        self._next_index = 0
        self._running: dict[int, Group] = {}
        self._pending: deque[Group] = deque()  # kept or running groups, admission order
        self._tasks: set[asyncio.Task] = set()
        self._admit_wake: asyncio.Event | None = None
        self._batch_wake: asyncio.Event | None = None
        self._admit_task: asyncio.Task | None = None
        self._fatal: BaseException | None = None
        self._consecutive_errors = 0
        self._reported_errors: set[tuple] = set()  # (type, file, line) already printed
        self._filtered_in_row = 0  # all-equal groups in a row, filtered or past the cap
        self._filtered_this_step = 0  # groups dropped since the last batch was handed out
        self._gen_tokens = 0
        self.eta = options.staleness.initial  # the bound in force (auto: set_eta moves it)
        self.batch_latency_s: float | None = None  # the last batch's slowest group
        self.staleness_slack: int | None = None  # the last batch's min (bound − staleness)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self._admit_wake, self._batch_wake = asyncio.Event(), asyncio.Event()
        for group in list(self._running.values()):  # restored in-flight groups go first
            group.submit_version = self.published_version
            self._launch(group)
        self._admit_task = asyncio.create_task(self._admission_loop(), name="admission")

    async def stop(self) -> None:
        tasks = [t for t in (self._admit_task, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def published_version(self) -> int:
        """The newest version every server serves, read from :class:`PublishedVersion`."""
        return self._published.published

    @published_version.setter
    def published_version(self, version: int) -> None:
        if not isinstance(self._published, OwnPublishedVersion):
            raise AttributeError(
                "the published version is read from the publisher's clock; only it moves it"
            )
        self._published.published = version

    def set_published_version(self, version: int) -> None:
        """The servers now run weights ``version``: the admission bound moves up. A
        controller reading a publisher's clock records nothing (the clock, advanced first,
        already says ``version``); it only wakes admission."""
        if isinstance(self._published, OwnPublishedVersion):
            self.published_version = version
        elif version != self.published_version:
            raise ValueError(
                f"told that the servers serve v{version}, but the clock it reads says "
                f"v{self.published_version}"
            )
        self._notify()

    def set_eta(self, eta: int) -> None:
        """A new staleness bound for groups admitted from now on (``rollout.eta=auto``).
        Groups already admitted keep the bound they were admitted under: the admission
        proof (module docstring) holds for each group with its own η, and the trainer
        checks every sample against the largest bound, ``rollout.eta_max``."""
        self.eta = eta
        self._notify()

    def fail(self, exc: BaseException) -> None:
        """Stop handing out batches: :meth:`next_batch` raises ``exc``."""
        if self._fatal is None:
            self._fatal = exc
        self._notify()

    @property
    def failure(self) -> BaseException | None:
        """The error given to :meth:`fail`, if any."""
        return self._fatal

    def _notify(self) -> None:
        if self._admit_wake is not None and self._batch_wake is not None:
            self._admit_wake.set()
            self._batch_wake.set()

    # ------------------------------------------------------------------ admission
    @property
    def running_groups(self) -> int:
        return len(self._running)

    @property
    def ready_groups(self) -> int:
        return sum(1 for g in self._pending if g.status is GroupStatus.READY)

    def capacity(self) -> int:
        return admission_capacity(self.published_version, self.eta, self.opt.prompts_per_step)

    def can_admit(self) -> bool:
        if self._fatal is not None:
            return False
        if self.accepted + len(self._running) >= self.capacity():
            return False
        limit = self.opt.concurrency
        return limit <= 0 or (len(self._running) + 1) * self.opt.n_samples <= limit

    async def _admission_loop(self) -> None:
        """Admit while the bound allows. An error here (a prompt that cannot be encoded, a
        broken prompt source) fails the run: a dead admission task would otherwise leave
        :meth:`next_batch` waiting forever for groups that are never admitted."""
        assert self._admit_wake is not None
        try:
            while True:
                self._admit_wake.clear()
                while self.can_admit():
                    self._admit_one()
                await self._admit_wake.wait()
        except Exception as exc:  # noqa: BLE001 - handed to the loop, never swallowed
            self.fail(exc)

    def _admit_one(self) -> None:
        group = self._admit_group()
        if group is not None:
            self._launch(group)

    def _admit_group(self) -> Group | None:
        """Draw the next prompt that fits and admit it as a running group (None: the run
        failed, most prompts are too long)."""
        while True:
            prompt_index, problem = self.loader.next()
            prompt_ids = self._encode(problem)
            limit = self.opt.max_context
            if limit is None or len(prompt_ids) + self.opt.max_new_tokens <= limit:
                break
            self.counters["skipped_long_prompts"] += 1
            if self.counters["skipped_long_prompts"] > 1000 + self.loader.draws // 2:
                self.fail(RelayError("most prompts are longer than model.max_context allows"))
                return None
        group = Group(
            index=self._next_index,
            prompt_index=prompt_index,
            problem=problem,
            prompt_ids=prompt_ids,
            submit_version=self.published_version,
            admitted_at=time.perf_counter(),
            eta=self.eta,
        )
        self._next_index += 1
        self._running[group.index] = group
        self._pending.append(group)
        self.counters["admitted_groups"] += 1
        return group

    def _launch(self, group: Group) -> None:
        task = asyncio.create_task(self._run_group(group), name=group.key)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ one group
    async def _run_group(self, group: Group) -> None:
        try:
            samples = await self._generate_and_grade(group)
        except asyncio.CancelledError:
            raise
        except AbortedSample as exc:  # never trained as if complete
            self._reject(group, "aborted")
            self._count_error(exc)
            return
        except (RelayError, RolloutServerError) as exc:
            if isinstance(exc, RelayError) or exc.status is None:
                self.fail(exc)  # unreachable server: the run cannot continue
                return
            self._reject(group, "error")
            self._count_error(exc)
            return
        except Exception as exc:  # noqa: BLE001 - a bad sample rejects its group only
            self._report_unexpected(group, exc)
            self._reject(group, "error")
            self._count_error(exc)
            return
        self._consecutive_errors = 0
        group.trajectories = [t for t, _ in samples]
        group.texts = [text for _, text in samples]
        self._finish_group(group)

    def _report_unexpected(self, group: Group, exc: Exception) -> None:
        """A workflow or grader raised something that is not a server or user error: often a
        programming error, so its traceback is printed the first time each (type, place)
        occurs instead of being counted silently until ``max_consecutive_errors``."""
        frames = traceback.extract_tb(exc.__traceback__)
        place = (type(exc).__name__, *(frames[-1][:2] if frames else ()))
        self.counters["unexpected_errors"] += 1
        if place in self._reported_errors:
            return
        self._reported_errors.add(place)
        detail = "".join(traceback.format_exception(exc)).rstrip()
        print(
            f"warning: group {group.key} failed and is dropped (more like it are counted in "
            f"unexpected_errors, not printed):\n{detail}",
            file=sys.stderr,
            flush=True,
        )

    def _count_error(self, exc: BaseException) -> None:
        self._consecutive_errors += 1
        if self._consecutive_errors >= self.opt.max_consecutive_errors:
            self.fail(RelayError(f"{self._consecutive_errors} groups failed in a row: {exc}"))

    async def _generate_and_grade(self, group: Group) -> list[tuple[Trajectory, str]]:
        """The group's samples from the workflow, counted and with the run's reward shaping."""
        request = GroupRequest(
            key=group.key,
            problem=group.problem,
            prompt_ids=group.prompt_ids,
            submit_version=group.submit_version,
            sampling=[
                SamplingParams(
                    max_new_tokens=self.opt.max_new_tokens,
                    temperature=self.opt.temperature,
                    top_p=self.opt.top_p,
                    seed=request_seed(self.opt.seed, group.prompt_index, j),
                )
                for j in range(self.opt.n_samples)
            ],
        )
        samples = await self.workflow.run_group(request, self._services)
        if len(samples) != self.opt.n_samples:
            raise RelayError(
                f"workflow {self.workflow.name!r} returned {len(samples)} samples for a group "
                f"of {self.opt.n_samples}"
            )
        for sample in samples:
            if sample.trajectory.finish_reason == "abort":
                raise AbortedSample(
                    f"group {group.key}: sample {sample.trajectory.sample_index} is still "
                    f"aborted after {sample.resubmissions} resubmissions"
                )
        for sample in samples:
            self._count(sample)
        if self._teacher is not None:  # the teacher's logprobs of the student's tokens
            await self._teacher(group.prompt_ids, [s.trajectory for s in samples], group.key)
        return [(sample.trajectory, sample.text) for sample in samples]

    def _count(self, sample: Sample) -> None:
        traj = sample.trajectory
        self.counters[f"reward_{traj.reward_status}"] += 1
        self.counters["resubmissions"] += sample.resubmissions
        self._gen_tokens += traj.num_model_tokens
        if self.opt.overlong_buffer > 0:
            traj.reward += overlong_penalty(
                len(traj.completion_ids),
                self.opt.max_new_tokens,
                self.opt.overlong_buffer,
                self.opt.overlong_penalty,
            )

    def _finish_group(self, group: Group) -> None:
        rewards = [t.reward for t in group.trajectories]
        if self.opt.dynamic_sampling and not dynamic_sampling_keep(rewards):
            self._filtered_in_row += 1
            if self._filtered_in_row >= self.opt.max_consecutive_filtered:
                self.fail(
                    RelayError(
                        f"dynamic sampling saw {self._filtered_in_row} groups in a row whose "
                        f"samples all got the same reward (last {rewards}); the task is too "
                        "hard or too easy for this model, or set algo.dynamic_sampling=false"
                    )
                )
            cap = self.opt.max_filtered_per_step
            if cap is None or self._filtered_this_step < cap:
                self._filtered_this_step += 1
                self._reject(group, "filtered")
                return
            self.counters["accepted_uniform_groups"] += 1  # past the cap: it fills the batch
        else:
            self._filtered_in_row = 0
        group.status = GroupStatus.READY
        group.completed_at = time.perf_counter()
        del self._running[group.index]
        self.accepted += 1
        self.counters["accepted_groups"] += 1
        self._notify()

    def _reject(self, group: Group, why: str) -> None:
        group.status = GroupStatus.REJECTED
        self._running.pop(group.index, None)
        self._pending.remove(group)
        self.counters[f"rejected_{why}"] += 1
        self._notify()

    # ------------------------------------------------------------------ batches
    def _head_ready(self) -> bool:
        b = self.opt.prompts_per_step
        if len(self._pending) < b:
            return False
        return all(self._pending[i].status is GroupStatus.READY for i in range(b))

    async def next_batch(self) -> list[Group]:
        """The next B groups in admission order, once all of them are complete, with the
        advantages of their samples computed over the batch (one estimator call)."""
        assert self._batch_wake is not None, "call start() first"
        while True:
            self._batch_wake.clear()
            if self._fatal is not None:
                raise self._fatal
            if self._head_ready():
                return self._take_batch()
            await self._batch_wake.wait()

    def _take_batch(self) -> list[Group]:
        """Hand out the B complete groups at the head, advantages computed over them."""
        batch = [self._pending.popleft() for _ in range(self.opt.prompts_per_step)]
        self._record_batch(batch)
        assign_advantages(
            [g.trajectories for g in batch],
            self.opt.advantage,
            self.opt.gamma,
            self.opt.advantage_params,
        )
        if self._teacher is not None:
            apply_distillation(
                [g.trajectories for g in batch],
                self.opt.distill_coef,
                self.opt.distill_task_weight,
            )
        self.consumed_version += 1
        self._filtered_this_step = 0
        self._notify()
        return batch

    def _record_batch(self, batch: list[Group]) -> None:
        """The batch's slack, min over its samples of (the bound its group was admitted
        under − its staleness at the version it trains; negative would be a controller bug,
        ``rollout.eta=auto`` tests it), and its generation latency (its slowest group's
        admission to completion)."""
        version = self.consumed_version
        slack = [g.eta - t.staleness(version) for g in batch for t in g.trajectories]
        self.staleness_slack = min(slack) if slack else None
        done = [g.completed_at - g.admitted_at for g in batch if g.completed_at is not None]
        self.batch_latency_s = max(done) if done else None

    async def lagged_batch(self, version: int) -> list[Group]:
        """Lag emulation (``rollout.lag`` fixed / uniform; do not :meth:`start`): the next
        batch, generated now by the weights of ``version`` that the caller loaded. Groups are
        admitted, generated, graded, shaped and filtered as on the asynchronous path
        (rejected ones replaced), but one at a time, in admission order, so the batch depends
        on the run's seed and the weights only, never on timing; then handed out as
        :meth:`next_batch` does."""
        assert self._admit_task is None, "lag emulation drives the controller without start()"
        self.published_version = version
        while not self._head_ready():
            if self._fatal is not None:
                raise self._fatal
            group = self._admit_group()
            if group is not None:
                await self._run_group(group)
        return self._take_batch()

    # ------------------------------------------------------------------ reporting
    def take_generated_tokens(self) -> int:
        n, self._gen_tokens = self._gen_tokens, 0
        return n

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {k: float(v) for k, v in self.counters.items()}
        out["queue_ready_groups"] = float(self.ready_groups)
        out["queue_running_groups"] = float(self.running_groups)
        out["published_version"] = float(self.published_version)
        return out

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue losslessly (JSON): the loader position, counters,
        the groups admitted but not yet trained, in admission order (complete ones with
        their trajectories, texts and versions; in-flight ones by prompt index, generated
        again on resume with the same request seeds), and the admission bookkeeping."""
        pending = []
        for g in self._pending:
            entry: dict[str, Any] = {
                "index": g.index,
                "prompt_index": g.prompt_index,
                "prompt_id": g.problem.id,
                "submit_version": g.submit_version,
                "status": g.status.value,
            }
            if g.status is GroupStatus.READY:
                entry["trajectories"] = [t.to_dict() for t in g.trajectories]
                entry["texts"] = list(g.texts)
            pending.append(entry)
        return {
            "loader": self.loader.state_dict(),
            "counters": dict(self.counters),
            "accepted": self.accepted,
            "consumed_version": self.consumed_version,
            "next_index": self._next_index,
            "filtered_this_step": self._filtered_this_step,
            "pending": pending,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` before :meth:`start`; in-flight groups are generated
        again first, in their original admission order, ahead of any new prompt.

        Raises RelayError if a restored complete group would break the staleness bound at
        the restored trainer version, or if the train prompts changed since the checkpoint.
        """
        assert self._admit_task is None, "load_state_dict() must come before start()"
        self.loader.load_state_dict(state["loader"])
        self.counters = Counter(state["counters"])
        self.accepted = int(state["accepted"])
        self.consumed_version = int(state["consumed_version"])
        self._next_index = int(state["next_index"])
        self._filtered_this_step = int(state.get("filtered_this_step", 0))
        self._pending.clear()
        self._running.clear()
        for entry in state["pending"]:
            group = self._restore_group(entry)
            self._pending.append(group)
            if group.status is GroupStatus.RUNNING:
                self._running[group.index] = group

    def _restore_group(self, entry: dict[str, Any]) -> Group:
        problem = self.loader.problem_at(int(entry["prompt_index"]))
        if problem.id != entry["prompt_id"]:
            raise RelayError(
                f"the train prompts changed since the checkpoint: draw {entry['prompt_index']} "
                f"was {entry['prompt_id']!r}, now {problem.id!r}; resume with the same "
                "task/dataset settings and seed"
            )
        group = Group(
            index=int(entry["index"]),
            prompt_index=int(entry["prompt_index"]),
            problem=problem,
            prompt_ids=self._encode(problem),
            submit_version=int(entry["submit_version"]),
            admitted_at=time.perf_counter(),
            eta=self.opt.staleness.hard,
            status=GroupStatus(entry["status"]),
        )
        if group.status is GroupStatus.READY:
            group.trajectories = [Trajectory.from_dict(t) for t in entry["trajectories"]]
            group.texts = list(entry["texts"])
            self._check_restored_staleness(group)
        return group

    def _check_restored_staleness(self, group: Group) -> None:
        version, bound = self.consumed_version, self.opt.staleness.hard
        try:
            check_staleness(group.trajectories, version, bound)
        except StalenessError as exc:
            worst = exc.worst
            raise RelayError(
                f"checkpoint holds group {group.key} (prompt {group.problem.id!r}) of staleness "
                f"{worst} at trainer version {version}, above rollout.eta={bound}: it "
                f"must not be trained; resume with rollout.eta >= {worst}"
            ) from None

    def restored_counts(self) -> tuple[int, int]:
        """(complete, in-flight) groups waiting to be trained, e.g. right after a restore."""
        return self.ready_groups, self.running_groups
