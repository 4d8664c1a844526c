"""The trainer ranks of `relayrl train` at ``train.world_size`` N > 1: launch, the command
channel from rank 0, and failures.

Owns: :func:`check_trainer_ranks` (bad input, before anything starts), :func:`resolve_backend`,
:func:`make_trainer` (world size 1: the plain ``RLTrainer``, unchanged; N > 1: a
:class:`TrainerGroup`), :class:`TrainerGroup` (rank 0's handle on the ranks), :func:`worker_main`
(ranks 1..N−1), :func:`torchrun_rank` and :func:`run_torchrun_worker` (`relayrl train` under
``torchrun --nproc-per-node N``: rank 0 runs the job, the others only train).

Layout (docs/async.md): rank 0 is the `relayrl train` process; it keeps the controller, the
rollout servers, metrics, checkpoints' manifest and weight publication, and runs its own
share of every step. Ranks 1..N−1 are worker processes (``relayrl.train.distributed``,
started by rank 0 with one line per rank in ``<run>/trainer-rank<r>.log``, or by
``torchrun``) that only train. Each trainer call of the loop is a command that rank 0
broadcasts (``broadcast_object_list`` on a gloo group: a :class:`RankCall`, the
:class:`RankCommand` and its arguments, e.g. the step's groups of trajectories) before
running it itself, so every rank runs the same ``ShardedRLTrainer`` method on the same
inputs, and nothing else of the loop changes.

Failure: a collective that fails on rank 0 (a rank died: gloo reports the closed connection)
is turned into one error naming the dead rank and how it ended; rank 0 then stops the job and
the other ranks, as for any error (``--resume`` continues from the last checkpoint). A worker
whose rank 0 dies gets SIGKILL (parent-death signal) or a failed collective, and exits;
workers ignore SIGINT/SIGTERM, so Ctrl-C stops the job through rank 0, with a checkpoint.

Rendezvous (docs/security.md): rank 0 hosts the ranks' ``TCPStore`` on the address the
workers reach it at only (127.0.0.1 on one host, the node's address under Ray), the ranks'
keys live under a prefix derived from a fresh secret that reaches the workers in their
environment (:func:`rendezvous_store`), and the store stops accepting connections once the
group has formed (:func:`relayrl.engine.wire.relayrl_transfer_wire.stop_listening`).
Under torchrun, torchrun's own store is used.

Imports: torch.distributed, relayrl.config, relayrl.engine.wire (the store's socket),
relayrl.models.loading, relayrl.train.fsdp, relayrl.launch.servers (free_port) and
.launchers (who starts ranks 1..N−1), relayrl.registry, relayrl.errors, relayrl.train.options.
"""

from __future__ import annotations

import datetime
import os
import secrets
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from relayrl.config.schema import RunConfig
from relayrl.errors import RelayError
from relayrl.plugins import load_plugins_from_env
from relayrl.train.options import ShardingOptions, TrainerOptions
from relayrl.train.worker_ranks import (
    BACKEND_ENV,
    PARENT_ENV,
    SECRET_ENV,
    TIMEOUT_ENV,
    WorkerRanks,
    resolve_backend,
)


class RankCommand(Enum):
    """What rank 0 tells every rank to run (each a ``ShardedRLTrainer`` method, but
    :data:`STOP`, which ends a worker)."""

    TRAIN_STEP = "train_step"
    SAVE_WEIGHTS = "save_weights"
    FULL_STATE_DICT = "full_state_dict"
    ADAPTER_STATE = "adapter_state"
    SAVE_SHARDS = "save_shards"
    RESTORE_CHECKPOINT = "restore_checkpoint"
    STOP = "stop"


@dataclass(frozen=True)
class RankCall:
    """One command and its arguments, as rank 0 broadcasts it."""

    command: RankCommand
    args: tuple[Any, ...] = ()


STOP = RankCall(RankCommand.STOP)


def run_call(trainer: Any, call: RankCall) -> Any:
    """Run ``call`` on this rank's ``trainer`` (a ``ShardedRLTrainer``)."""
    match call.command:
        case RankCommand.TRAIN_STEP:
            return trainer.train_step(*call.args)
        case RankCommand.SAVE_WEIGHTS:
            return trainer.save_weights(*call.args)
        case RankCommand.FULL_STATE_DICT:
            return trainer.full_state_dict(*call.args)
        case RankCommand.ADAPTER_STATE:
            return trainer.adapter_state(*call.args)
        case RankCommand.SAVE_SHARDS:
            return trainer.save_shards(*call.args)
        case RankCommand.RESTORE_CHECKPOINT:
            return trainer.restore_checkpoint(*call.args)
    raise RuntimeError(f"not a trainer command: {call.command}")


PR_SET_PDEATHSIG = 1


# --------------------------------------------------------------------------- checks
def torchrun_rank() -> int | None:
    """This process's rank when started by torchrun (``TORCHELASTIC_RUN_ID`` set), else None."""
    if "TORCHELASTIC_RUN_ID" in os.environ and "RANK" in os.environ:
        return int(os.environ["RANK"])
    return None


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_trainer_ranks(config: RunConfig) -> None:
    """Raise a RelayError naming the key when ``train.world_size`` cannot run here."""
    t = config.train
    if t.world_size == 1:
        return
    backend = resolve_backend(config)
    on_cuda = str(config.model.device).startswith("cuda")
    if backend == "nccl" and not (on_cuda and torch.cuda.is_available()):
        raise RelayError(
            f"train.backend=nccl needs CUDA (model.device={config.model.device!r}, "
            f"torch.cuda.is_available()={torch.cuda.is_available()}); use train.backend=gloo"
        )
    from relayrl.launch.launchers import make_launcher

    here = make_launcher(config).ranks_here()  # e.g. ray: rank 0 only, Ray places the others
    if on_cuda and here > torch.cuda.device_count():
        raise RelayError(
            f"train.world_size={t.world_size} needs {t.world_size} GPUs; this node has "
            f"{torch.cuda.device_count()}"
        )
    if not on_cuda and here * t.trainer_threads > available_cores():
        raise RelayError(
            f"train.world_size={t.world_size} × train.trainer_threads={t.trainer_threads} "
            f"needs {here * t.trainer_threads} cores here; this process may use "
            f"{available_cores()} (lower train.world_size or train.trainer_threads)"
        )
    launched = os.environ.get("WORLD_SIZE") if torchrun_rank() is not None else None
    if launched is not None and int(launched) != t.world_size:
        raise RelayError(
            f"train.world_size={t.world_size} but torchrun started {launched} processes "
            f"(set train.world_size={launched} or --nproc-per-node {t.world_size})"
        )
    if launched is None and t.master_port:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", t.master_port))
            except OSError as exc:
                raise RelayError(
                    f"train.master_port={t.master_port} is in use on 127.0.0.1 ({exc.strerror}); "
                    "pick a free port or 0 for any free one"
                ) from exc


# --------------------------------------------------------------------------- process group
RENDEZVOUS_GROUP = "trainer-ranks"


@dataclass
class Rendezvous:
    """The ranks' store (under the secret's prefix) and, on rank 0, its listening socket."""

    store: dist.Store
    listener: socket.socket | None = None

    def close(self) -> None:
        """The group has formed: accept no more connections (the ranks' stay)."""
        from relayrl.engine.wire.relayrl_transfer_wire import stop_listening

        listener, self.listener = self.listener, None
        stop_listening(listener)


def rendezvous_store(
    address: str, port: int, rank: int, world_size: int, secret: str, timeout_s: float
) -> Rendezvous:
    """Rank 0 hosts (listening on ``address`` only), the others join, the store of the
    trainer ranks; every key they write is under ``store_prefix(RENDEZVOUS_GROUP, secret)``,
    which a client without ``secret`` cannot compute (a TCPStore cannot list its keys)."""
    from relayrl.engine.wire.relayrl_transfer_wire import listening_socket, store_prefix

    listener = None
    kwargs: dict[str, Any] = {}
    if rank == 0:
        listen_fd = listening_socket(address, port)
        listener = socket.socket(fileno=os.dup(listen_fd))
        kwargs["master_listen_fd"] = listen_fd
    store = dist.TCPStore(
        address,
        port,
        world_size,
        is_master=rank == 0,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        **kwargs,
    )
    return Rendezvous(dist.PrefixStore(store_prefix(RENDEZVOUS_GROUP, secret), store), listener)


def _device_for(config: RunConfig, backend: str, local_rank: int) -> str:
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        return f"cuda:{local_rank}"
    return str(config.model.device)


def _control_group(backend: str):
    """Commands travel as pickled objects on CPU: the default group with gloo, a gloo
    group beside NCCL's."""
    return dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD


def _receive(group) -> Any:
    message: list[Any] = [None]
    dist.broadcast_object_list(message, src=0, group=group)
    return message[0]


def _build_rank(config: RunConfig, model_dir: str, pad_id: int, device: str, backend: str):
    from relayrl.models.loading import load_model
    from relayrl.train.fsdp import ShardedRLTrainer

    torch.manual_seed(config.seed)
    model = load_model(model_dir, device, config.model.dtype)
    if config.model.lora is not None:  # the same adapters as rank 0's replica (one seed)
        from relayrl.train.lora import apply_lora

        model = apply_lora(model, config.model.lora, seed=config.seed)
    options, sharding = TrainerOptions.from_config(config), ShardingOptions.from_config(config)
    return ShardedRLTrainer(
        model, options, sharding, pad_id, "cuda" if backend == "nccl" else "cpu"
    )


def _init_rank0(
    config: RunConfig, backend: str, workers: WorkerRanks, rendezvous: Rendezvous | None
) -> None:
    """``init_process_group`` on rank 0, failing fast (naming the rank) if a worker dies
    before joining instead of waiting ``train.dist_timeout_s``."""
    timeout = datetime.timedelta(seconds=config.train.dist_timeout_s)
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timeout}
    if rendezvous is not None:
        kwargs.update(store=rendezvous.store, rank=0, world_size=config.train.world_size)
    errors: list[BaseException] = []

    def init() -> None:
        try:
            dist.init_process_group(**kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=init, name="trainer-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        if thread.is_alive() and workers.dead():
            raise workers.failure() or RelayError("a trainer rank exited before joining")
    if errors:
        raise RelayError(f"trainer ranks could not rendezvous: {errors[0]}") from errors[0]


# --------------------------------------------------------------------------- rank 0
class TrainerGroup:
    """Rank 0's handle on the N trainer ranks, with the ``RLTrainer`` interface the loop
    and the checkpoints use: each collective call is broadcast to the workers first.

    ``model`` is an unsharded replica on rank 0, refreshed from the gathered weights (under
    LoRA only the adapters: the base is frozen) when the version moved (evaluation, ``save_pretrained`` of checkpoints and the final model;
    after :meth:`close` it keeps the last weights gathered, the final evaluation's)."""

    def __init__(self, local, replica: torch.nn.Module, workers: WorkerRanks, control) -> None:
        self.local, self.replica, self.workers, self.control = local, replica, workers, control
        self._replica_version: int | None = None
        self._closed = False

    @property
    def version(self) -> int:
        return self.local.version

    @property
    def options(self) -> TrainerOptions:
        return self.local.options

    @property
    def last_trained(self) -> list:
        return self.local.last_trained  # rank 0's trainer holds the whole batch

    @property
    def last_prox(self) -> list | None:
        return self.local.last_prox

    @property
    def world_size(self) -> int:
        return self.local.world_size

    def _all(self, command: RankCommand, *args: Any) -> Any:
        """Run ``command`` with ``args`` on every rank."""
        call = RankCall(command, args)
        try:
            dist.broadcast_object_list([call], src=0, group=self.control)
            return run_call(self.local, call)
        except RuntimeError as exc:  # torch.distributed errors are RuntimeErrors
            failure = self.workers.failure()
            if failure is not None:
                self._closed = True  # the group is broken: no goodbye message
                raise failure from exc
            raise

    def train_step(self, groups) -> dict[str, float]:
        return self._all(RankCommand.TRAIN_STEP, groups)

    @property
    def lora(self) -> bool:
        from relayrl.train.lora import is_lora

        return is_lora(self.replica)

    def save_weights(self, directory: Path) -> Path:
        """The publication's disk snapshot; under LoRA only the adapters are gathered (into
        the replica) and rank 0 writes the adapter snapshot from the replica."""
        if self.lora:
            from relayrl.train.lora import save_adapter_snapshot

            return save_adapter_snapshot(self.model, directory)
        return self._all(RankCommand.SAVE_WEIGHTS, directory)

    def lora_adapter(self):
        """Under LoRA, the adapters as one publication (``relayrl.train.lora.
        adapter_snapshot``, gathered into the replica); None for full fine-tuning."""
        if not self.lora:
            return None
        from relayrl.train.lora import adapter_snapshot

        return adapter_snapshot(self.model)

    def save_shards(self, directory: Path) -> None:
        self._all(RankCommand.SAVE_SHARDS, directory)

    def restore_checkpoint(self, model_dir: Path, shards: Path | None, state: dict) -> None:
        self._all(RankCommand.RESTORE_CHECKPOINT, model_dir, shards, state)
        self._replica_version = None

    def state_dict(self) -> dict[str, Any]:
        return self.local.state_dict()

    @property
    def model(self) -> torch.nn.Module:
        if not self._closed and self._replica_version != self.version:
            if self.lora:  # the base is frozen: only the adapters travel
                state = self._all(RankCommand.ADAPTER_STATE)
                result = self.replica.load_state_dict(state, strict=False)
                missing = [k for k in result.missing_keys if ".lora_" in k]
                assert not result.unexpected_keys and not missing, (result, missing)
            else:
                state = self._all(RankCommand.FULL_STATE_DICT)
                self.replica.load_state_dict(state)
            self._replica_version = self.version
        return self.replica

    def close(self) -> None:
        """Tell the workers to exit, leave the process group, reap the workers."""
        if not self._closed:
            self._closed = True
            try:
                dist.broadcast_object_list([STOP], src=0, group=self.control)
            except RuntimeError:
                pass  # a worker is gone already
        if dist.is_initialized():
            dist.destroy_process_group()
        self.workers.stop()


def make_trainer(
    model: torch.nn.Module, config: RunConfig, pad_id: int, model_dir: Path, log_dir: Path
):
    """The trainer of a run: ``RLTrainer`` at world size 1 (as always), else the ranks
    started here (or by torchrun) with rank 0 in this process, as a :class:`TrainerGroup`."""
    from relayrl.train.trainer import RLTrainer

    if config.model.lora is not None:  # at world size N, rank 0's replica (same seed)
        from relayrl.train.lora import apply_lora

        model = apply_lora(model, config.model.lora, seed=config.seed)
    if config.train.world_size == 1:
        return RLTrainer(model, TrainerOptions.from_config(config), pad_id=pad_id)
    from relayrl.launch.servers import free_port

    backend = resolve_backend(config)
    under_torchrun = torchrun_rank() is not None
    port = None if under_torchrun else (config.train.master_port or free_port())
    secret = secrets.token_urlsafe(32)
    if under_torchrun:
        workers = WorkerRanks({}, {}, log_dir)
    else:  # ranks 1..N-1 as the launcher starts them: subprocesses, Ray actors (docs/cluster.md)
        from relayrl.launch.launchers import make_launcher
        from relayrl.registry import load_path

        ranks: type[WorkerRanks] = load_path(make_launcher(config).trainer_ranks)
        workers = ranks.spawn(config, port, log_dir, secret)
    rendezvous = None
    try:
        if port is not None:
            rendezvous = rendezvous_store(
                workers.master_addr, port, 0, config.train.world_size, secret,
                config.train.dist_timeout_s,
            )  # fmt: skip
        _init_rank0(config, backend, workers, rendezvous)
        if rendezvous is not None:
            rendezvous.close()  # formed: every rank is connected, nobody else may be
        control = _control_group(backend)
        setup = {"config": config.model_dump(mode="json"), "model_dir": str(model_dir)}
        dist.broadcast_object_list([(setup, pad_id)], src=0, group=control)
        device = _device_for(config, backend, 0)
        replica = model
        local = _build_rank(config, str(model_dir), pad_id, device, backend)
        return TrainerGroup(local, replica, workers, control)
    except BaseException:
        if rendezvous is not None:
            rendezvous.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        for proc in workers.procs.values():
            proc.kill()
        workers.stop()
        raise


# --------------------------------------------------------------------------- ranks ≥ 1
def run_torchrun_worker(config: RunConfig) -> bool:
    """Under torchrun, ranks 1..N−1 of `relayrl train` become trainer workers here (and
    return True when done); rank 0 and plain runs get False and run the job."""
    rank = torchrun_rank()
    if rank is None or rank == 0:
        return False
    check_trainer_ranks(config)
    os.environ[BACKEND_ENV] = resolve_backend(config)
    os.environ[TIMEOUT_ENV] = str(config.train.dist_timeout_s)
    torch.set_num_threads(config.train.trainer_threads)
    os.environ["OMP_NUM_THREADS"] = str(config.train.trainer_threads)
    worker_main()
    return True


def _follow_rank0(parent: int) -> None:
    """A worker started by rank 0 leaves stopping to rank 0: Ctrl-C (SIGINT to the whole
    process group) and SIGTERM are ignored, so rank 0 can finish the step and write its
    checkpoint with every rank; rank 0's death kills it (parent-death SIGKILL, set by the
    worker itself; rank 0 forks workers from its main thread, which lives as long as it)."""
    if not parent:
        return  # torchrun's agent owns the signals of its workers
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # rank 0 died before the signal was set
        os._exit(1)


def _init_worker(rank: int, backend: str, timeout_s: float) -> None:
    """Join rank 0's store under the secret (rank 0 started us), else torchrun's (env://)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    secret = os.environ.pop(SECRET_ENV, None)
    if secret is None:
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    world_size = int(os.environ["WORLD_SIZE"])
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = rendezvous_store(address, port, rank, world_size, secret, timeout_s).store
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
    )


def worker_main() -> None:
    """A worker rank: join the group, build the rank's trainer from rank 0's setup message,
    then run rank 0's commands until told to stop. Exits 1 on any error (logged)."""
    from relayrl.config.schema import RunConfig

    _follow_rank0(int(os.environ.get(PARENT_ENV, "0")))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank = int(os.environ["RANK"])
    backend = os.environ.get(BACKEND_ENV, "gloo")
    try:
        timeout_s = float(os.environ.get(TIMEOUT_ENV, "600"))
        _init_worker(rank, backend, timeout_s)
        control = _control_group(backend)
        setup, pad_id = _receive(control)
        load_plugins_from_env()  # the config's own plugins are imported by its validation
        config = RunConfig.model_validate(setup["config"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        trainer = _build_rank(
            config, setup["model_dir"], pad_id, _device_for(config, backend, local_rank), backend
        )
        print(
            f"trainer rank {rank}/{config.train.world_size} ready ({backend}, pid {os.getpid()})",
            flush=True,
        )
        while True:
            call = _receive(control)
            if not isinstance(call, RankCall):
                raise RuntimeError(f"not a trainer command: {call!r}")
            if call.command is RankCommand.STOP:
                break
            run_call(trainer, call)
    except Exception as exc:  # noqa: BLE001 - the log says why; rank 0 names the rank
        import traceback

        traceback.print_exc()
        print(f"trainer rank {rank} stops: {exc}", flush=True)
        sys.exit(1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
