"""Error analysis of the demo's held-out completions (arithmetic chains; docs/demo.md).

    python scripts/demo_errors.py EVAL.jsonl [EVAL2.jsonl ...] [--params '{"max_steps": 40}']

EVAL.jsonl is a per-problem file as ``relayrl sft`` (``<run>/sft_eval.jsonl``) or ``relayrl
eval --out`` writes it for the default task's test split. Every wrong completion is
classified by its first deviation from a correct chain, given the model's own previous line:
``arith`` (the line copies its inputs right but computes a wrong result; ``planted`` when the
error is one of the deltas SFT's wrong demonstrations use), ``copy_value`` (the left operand
is not the previous result), ``copy_op`` (operator or operand not the prompt's step),
``steps`` (too few or too many step lines), ``answer`` (the #### line differs from the last
result), ``format`` (an unreadable line or no #### line). Counts are broken down by chain
length and by the operator of the failing step. ``--params`` gives the task parameters the
file was evaluated with (JSON; the default task's otherwise), e.g. the long-tail workload's.
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter

from relayrl.tasks.arithmetic import _APPLY, _WRONG_DELTAS, ArithmeticTask, _label

LINE = re.compile(r"^(\S+) (\d+)([+\-*])(\d+)=(-?\d+)$")


def classify(meta: dict, completion: str) -> tuple[str, int, str]:
    """(kind, failing step index, operator of that step) of a wrong completion."""
    lines = [line.strip() for line in completion.strip().split("\n") if line.strip()]
    ops = meta["ops"]
    value = meta["start"]
    steps = [line for line in lines if not line.startswith("####")]
    answers = [line for line in lines if line.startswith("####")]
    for i, (op, b) in enumerate(ops):
        if i >= len(steps):
            return "steps", i, op
        m = LINE.match(steps[i])
        if not m or m.group(1) != _label(i):
            return "format", i, op
        lhs, got_op, got_b, result = int(m.group(2)), m.group(3), int(m.group(4)), int(m.group(5))
        if lhs != value:
            return "copy_value", i, op
        if (got_op, got_b) != (op, b):
            return "copy_op", i, op
        true = _APPLY[op](value, b)
        if result != true:
            return ("arith_planted" if result - true in _WRONG_DELTAS else "arith_other"), i, op
        value = result
    if len(steps) > len(ops):
        return "steps", len(ops), "extra"
    if not answers:
        return "format", len(ops), "answer"
    return "answer", len(ops), "answer"


def analyse(path: str, params: dict) -> None:
    rows = [json.loads(line) for line in open(path)]
    problems = {p.id: p for p in ArithmeticTask(**params).problems("test", len(rows), seed=0)}
    kinds: Counter = Counter()
    by_len_total: Counter = Counter()
    by_len_wrong: Counter = Counter()
    by_op: Counter = Counter()
    by_step: Counter = Counter()
    n_total = n_wrong = 0
    for row in rows:
        problem = problems[row["id"]]
        length = len(problem.meta["ops"])
        for reward, text in zip(row["rewards"], row["completions"], strict=True):
            n_total += 1
            by_len_total[length] += 1
            if reward > 0:
                continue
            n_wrong += 1
            by_len_wrong[length] += 1
            kind, step, op = classify(problem.meta, text)
            kinds[kind] += 1
            by_op[(kind, op)] += 1
            by_step[step] += 1
    print(f"{path}: {n_wrong}/{n_total} wrong (pass@1 {1 - n_wrong / max(n_total, 1):.3f})")
    print("  kinds:", dict(kinds.most_common()))
    print(
        "  wrong rate by chain length:",
        {k: f"{by_len_wrong[k]}/{by_len_total[k]}" for k in sorted(by_len_total)},
    )
    print("  by (kind, op):", dict(by_op.most_common(12)))
    print("  failing step index:", dict(sorted(by_step.items())))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="per-problem eval JSONL files")
    parser.add_argument("--params", default="{}", help="the task's parameters (JSON)")
    args = parser.parse_args()
    for p in args.files:
        analyse(p, json.loads(args.params))
