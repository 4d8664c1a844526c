"""Rollout: the Trajectory record (``trajectory``), the rollout controller (``controller``:
staleness-bounded admission, groups, reward shaping, filtering, batches in admission order
with their advantages), the staleness bound η (``eta``: ``StalenessBound``,
``rollout.eta=auto``), the workflow seam (``workflow``), environments and tools for
multi-turn episodes (``environment``, ``tools``), the prompt order (``prompts``) and the
distillation teacher's scoring (``distill``). Generation and grading reach the controller
as injected callables; resubmitting interrupted requests is the rollout client's
(relayrl.engine.client).

Imports: relayrl.engine (plain types, the client's error, the teacher's client),
relayrl.rewards (the sandbox, for tools), relayrl.algo (advantages, objective parameters),
relayrl.tasks, relayrl.registry, relayrl.errors; never relayrl.config (a layer above: the
controller takes ``ControllerOptions``) nor relayrl.buffer, launch, sync or train.
"""
