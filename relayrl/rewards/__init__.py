"""Verification and rewards: answer extraction, math equivalence (math-verify), the
Countdown verifier, the code sandbox, and the process pool that runs graders with timeouts.

Imports: the standard library, math-verify, relayrl.tasks (problem types), relayrl.errors.
"""
