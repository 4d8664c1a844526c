"""Evaluation metrics over K samples per problem.

* ``pass@1`` — the mean correctness over all samples (per problem, then averaged).
* ``pass@k`` — the unbiased estimator of Chen et al. (2021): with n samples of which c are
  correct, ``1 - C(n-c, k) / C(n, k)``, computed as the product
  ``prod_{i=n-c+1}^{n} (1 - k/i)`` so that no large binomial is ever formed.
* ``maj@k`` — majority vote over the first k samples' extracted answers; the vote is
  correct when the winning answer's samples are correct. Ties go to the answer that
  reached the winning count first (earliest sample), so results are deterministic and do
  not depend on hash order. Samples with no extracted answer (None) do not vote; with no
  votes at all the problem counts as wrong.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with ``n`` samples, ``c`` correct."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"need 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def mean_pass_at_k(correct: Sequence[Sequence[bool]], k: int) -> float:
    """pass@k averaged over problems; ``correct[p]`` lists problem p's sample outcomes."""
    if not correct:
        raise ValueError("no problems")
    return sum(pass_at_k(len(s), sum(map(bool, s)), k) for s in correct) / len(correct)


def pass_at_1(correct: Sequence[Sequence[bool]]) -> float:
    """Mean correctness over K samples, averaged over problems."""
    return mean_pass_at_k(correct, 1)


def majority_answer(answers: Sequence[Hashable | None]) -> tuple[Hashable | None, int]:
    """The most frequent non-None answer and its count; ties go to the one first reaching it."""
    counts: dict[Hashable, int] = {}
    best: Hashable | None = None
    best_count = 0
    for answer in answers:
        if answer is None:
            continue
        counts[answer] = counts.get(answer, 0) + 1
        if counts[answer] > best_count:
            best, best_count = answer, counts[answer]
    return best, best_count


def maj_at_k(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> bool:
    """Whether the majority answer among the first ``k`` samples is a correct one."""
    if len(answers) != len(correct):
        raise ValueError("answers and correct must have the same length")
    if k < 1 or k > len(answers):
        raise ValueError(f"maj@{k} needs between 1 and {len(answers)} samples")
    winner, _ = majority_answer(answers[:k])
    if winner is None:
        return False
    return any(ok for a, ok in zip(answers[:k], correct[:k], strict=True) if a == winner)


def mean_maj_at_k(
    answers: Sequence[Sequence[Hashable | None]], correct: Sequence[Sequence[bool]], k: int
) -> float:
    """maj@k averaged over problems."""
    if not answers:
        raise ValueError("no problems")
    return sum(maj_at_k(a, c, k) for a, c in zip(answers, correct, strict=True)) / len(answers)
