"""Verification and rewards: answer extraction, math equivalence (math-verify), the
Countdown verifier, the code sandbox, the grader seam (``dispatch``: ``GRADERS``,
``register_grader``), the sandboxed process that scores third-party graders (``isolated``:
reasoning-gym's scorers, plugin graders not declared safe), and the process pool that runs
graders with timeouts (``pool``).

Imports: the standard library, math-verify, relayrl.tasks (problem types), relayrl.plugins
(the user's graders in spawned workers), relayrl.registry, relayrl.errors; never
relayrl.engine or relayrl.report (its independent siblings) nor any layer above.
"""
