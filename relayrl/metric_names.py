"""Names of the columns of a run's ``metrics.jsonl`` (and keys of its ``train_summary.json``)
that more than one module writes or reads.

Owns: one constant per shared column. The trainer, the training loop and the run logger
write these keys; the dashboard, ``relayrl report``, the benchmarks and the experiments read
them. A column read in another module than the one writing it is named here once, so a
rename is one edit and a typo is an import error. Columns only their writer knows (most of
the loss statistics, ``relayrl.algo.losses``) stay where they are made.

Imports: nothing (the lowest layer, with ``relayrl.errors`` and ``relayrl.registry``).
"""

from __future__ import annotations

# ------------------------------------------------------------------ row identity
STEP = "step"  # optimizer steps done (1-based; 0: the evaluation before training)
VERSION = "version"  # the trainer's weight version after the step
FINAL = "final"  # true on the final evaluation's row, after the last step

# ------------------------------------------------------------------ the batch (train/metrics.py)
REWARD_MEAN = "reward_mean"
PASS_RATE = "pass_rate"
# samples that finished (not truncated at the token budget) with a passing reward, / batch
COMPLETED_CORRECT = "completed_correct_frac"

# ------------------------------------------------------------------ the step (train/trainer.py)
STALENESS_MIN = "staleness_min"
STALENESS_MEAN = "staleness_mean"
STALENESS_MAX = "staleness_max"
TRAIN_TOKENS = "train_tokens"  # prompt + completion tokens of the sequences trained
TIME_PROX_S = "time_prox_s"  # the no-grad proximal pass
TIME_UPDATE_S = "time_update_s"  # the AdamW steps
TIME_DRIFT_S = "time_drift_s"  # the drift metrics' extra passes
ESS_FRAC = "ess_frac"  # effective sample size of π_prox/μ over the tokens, / N
IS_WEIGHT_MEAN = "is_weight_mean"  # mean behaviour weight π_prox/μ (relayrl.algo.losses)
ENGINE_TRAINER_KL = "engine_trainer_kl_k3"  # KL(μ ‖ π_prox) at staleness 0
BEHAV_KL = "behav_kl_k3"  # KL(μ ‖ π_θ) of the loss's tokens (relayrl.algo.losses)
DRIFT_KL = "drift_kl_k3"  # KL(π_v ‖ π_v+1) on the batch's tokens (train.drift_metrics)
BEHAV_PROX_KL = "behav_prox_kl_k3"  # KL(μ ‖ π_v) on the batch's tokens (train.drift_metrics)
# the mismatch doctor (relayrl.algo.losses.mismatch_by_staleness): KL(μ ‖ π_v) of the batch's
# model tokens of staleness s, one column per level present: MISMATCH_KL + "0" is the fresh
# tokens' engine-vs-trainer mismatch, "1".."η" the drift of tokens s versions old
MISMATCH_KL = "mismatch_kl_k3_s"
MISMATCH_TOKENS = "mismatch_tokens_s"  # + s: how many tokens each level averages
STALE_KL_PER_VERSION = "stale_kl_per_version"  # Σ KL(μ ‖ π_v) / Σ staleness, stale tokens
CLIP_FRAC = "clip_frac"  # fraction of the loss's tokens whose ratio was clipped

# ------------------------------------------------------------------ the loop (train/loop.py)
# this process's peak resident memory so far, in MiB: every step's row and the summary
TRAINER_PEAK_RSS_MB = "trainer_peak_rss_mb"
STEP_TIME_S = "step_time_s"  # wall-clock seconds of the step, evaluation included
ELAPSED_S = "elapsed_s"  # wall-clock seconds since the loop started
TIME_WAIT_S = "time_wait_s"  # waiting for the batch
TRAIN_TOKENS_PER_S = "train_tokens_per_s"

# ------------------------------------------------------------------ held-out evaluation
EVAL_PASS_AT_1 = "eval_pass@1"
EVAL_VERSION = "eval_version"  # the weight version evaluated
EVAL_PROBLEMS = "eval_problems"  # problems the evaluation graded
TIME_EVAL_S = "time_eval_s"

# ------------------------------------------------------------------ the batch sources (train/run/)
GEN_TOKENS_PER_S = "gen_tokens_per_s"  # tokens generated per second of the step
TIME_SYNC_S = "time_sync_s"  # the trainer held for a weight publication
LAG = "lag"  # lag emulation: the weight lag d of the step's batch
ETA = "eta"  # the staleness bound in force after the step (rollout.eta=auto: the rule's choice)
ETA_DRIFT = "eta_drift"  # rollout.eta=auto: the smoothed per-version drift k̂ the rule used
# min over the batch's samples of (the bound in force when its group was admitted − its
# staleness): never negative (rollout.eta=auto changes the bound while groups are in flight)
STALENESS_SLACK = "staleness_slack_min"
PUBLISH_LATENCY_S = "publish_latency_s"

# ------------------------------------------------------------------ the run's summary (train_summary.json)
# keys of TrainResult.summary that the run writes (relayrl.train.run) and the CLI prints
ROLLOUT_ENGINE = "rollout_engine"  # the backend that generated the rollouts
PUBLICATIONS = "publications"  # weight publications over the run
PUBLISH_LATENCY_MEAN_S = "publish_latency_mean_s"
WEIGHT_TRANSPORT = "weight_transport"
SERVERS = "servers"  # the rollout servers per node as the watchdog saw them (a string)
