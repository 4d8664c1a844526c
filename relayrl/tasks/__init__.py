"""Problem sources: synthetic verifiable reasoning tasks (multi-step arithmetic, Countdown)
with deterministic, disjoint splits and SFT demonstrations, and real benchmark files
(GSM8K, MATH-500, AIME, HumanEval, MATH train).

Imports: the standard library, relayrl.config and relayrl.errors. Grading lives in relayrl.rewards.
"""
