"""A grader for fault-injection tests, in a module that imports nothing heavy (each grading
worker is a spawned process that imports it, again after every crash or timeout)."""

from __future__ import annotations

import os
import time
from pathlib import Path

FAULT_DIR_ENV = "RELAYRL_TEST_FAULT_DIR"


def faulty_grader(problem, completion: str) -> float:
    """The first grading call crashes its worker, the second hangs; then parity rewards.
    ``$RELAYRL_TEST_FAULT_DIR`` holds the marks that make each fault happen once."""
    marks = Path(os.environ[FAULT_DIR_ENV])
    for fault in ("crash", "hang"):
        try:
            (marks / fault).open("x").close()  # atomic: exactly one caller gets each fault
        except FileExistsError:
            continue
        if fault == "crash":
            os._exit(3)
        time.sleep(60)
    return float(len(completion) % 2 == 0)
