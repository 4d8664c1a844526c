"""Verification and rewards: answer extraction, math equivalence (math-verify), the
Countdown verifier, the code sandbox, the sandboxed process that scores third-party graders
(``isolated``: reasoning-gym's scorers, plugin graders not declared safe), and the process
pool that runs graders with timeouts.

Imports: the standard library, math-verify, relayrl.tasks (problem types), relayrl.errors.
"""
