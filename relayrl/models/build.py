"""Create a fresh model directory: tokenizer trained on task text + randomly initialised model."""

from __future__ import annotations

import random
from pathlib import Path

from relayrl.models.factory import build_model
from relayrl.models.tokenizer import train_tokenizer
from relayrl.tasks.base import SyntheticTask


def task_corpus(task: SyntheticTask, n: int, seed: int) -> list[str]:
    """Prompts and demonstrations (correct and wrong) of ``n`` train problems."""
    rng = random.Random(seed)
    texts = []
    for problem in task.problems("train", n, seed):
        texts.append(problem.prompt)
        texts.append(task.demonstration(problem, rng, wrong=rng.random() < 0.5))
    return texts


def create_model_dir(
    out_dir: str | Path,
    task: SyntheticTask,
    preset: str,
    *,
    seed: int = 0,
    max_position_embeddings: int = 512,
    vocab_size: int = 384,
    corpus_size: int = 2000,
):
    """Write tokenizer + random-init model to ``out_dir``; returns (model, tokenizer)."""
    tokenizer = train_tokenizer(task_corpus(task, corpus_size, seed), vocab_size=vocab_size)
    model = build_model(preset, tokenizer, max_position_embeddings, seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    return model, tokenizer
