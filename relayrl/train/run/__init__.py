"""A training run as a composition: one setup and one batch source.

One module per piece:

- ``setup``: :class:`RunSetup`, what every run builds and tears down (tokenizer, policy and
  trainer, held-out splits, logger, the training loop; the final model and summary), and
  :class:`TrainResult`;
- ``live``: :class:`LiveSource`, batches from the rollout servers (``relayrl train``), its
  weights published through ``relayrl.sync.weight_sync.WeightSync``;
- ``lagged``: :class:`LaggedSource`, lag emulation (``rollout.lag: fixed | uniform``);
- ``recorded``: :class:`RecordedSource` and :func:`run_replay` (``--replay-from``);
- ``rollout``: the rollout controller and grading pool live and lagged runs share;
- ``process``: the process-wide settings of a training process;
- ``job``: :func:`run_train`, the `relayrl train` job, and where its published weights go.

The three sources are siblings behind :class:`~relayrl.train.loop.BatchSource`; none
inherits from another. The names below are this package's API.
"""

from relayrl.train.run.job import run_train
from relayrl.train.run.recorded import run_replay
from relayrl.train.run.setup import TrainResult

__all__ = ["TrainResult", "run_replay", "run_train"]
