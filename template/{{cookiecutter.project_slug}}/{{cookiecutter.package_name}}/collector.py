"""Environments, and the torchrl collectors that step them with a learner's policy.

``collector.mode=sync``: torchrl's ``Collector`` runs in the learner's process and acts
with the learner's own modules, so it sees every optimizer step; collection and updates
take turns. ``collector.mode=async``: torchrl's ``AsyncCollector`` runs the same collector
in a child process with its own copy of the policy, which the learner refreshes every
``collector.weight_sync_every`` updates; it collects the next batch while the learner
trains on the current one, and waits for the learner to take that batch before it starts
another (see ``learner.off_policy``).

``collector.workers=K``: K processes step the learner's env copies, ``env.num_envs / K``
copies each, seeded as the one process would seed them, acting with a CPU copy of the
policy in shared memory. In sync mode torchrl's ``MultiSyncCollector`` joins the workers'
slices along the copies, so a batch is the one process's ``[num_envs, steps]`` batch,
stepped on K cores; the learner refreshes the copy before each batch. In async mode
torchrl's ``MultiAsyncCollector`` has each worker collect whole batches of its own copies,
``[num_envs / K, K * steps]``, one ahead of the learner, which takes them as they come and
refreshes the copy every ``collector.weight_sync_every`` updates.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torchrl.collectors import AsyncCollector, Collector, MultiAsyncCollector, MultiSyncCollector
from torchrl.envs import EnvBase
from torchrl.weight_update import SharedMemWeightSyncScheme

from .config import COLLECT_ASYNC
from .distributed.watchdog import STOP_SIGNALS, RankFailure, exit_status, signals_ignored
from .envs import TrainingBatches, make_env

log = logging.getLogger(__name__)
POLICY_VERSION = "policy_version"


def make_collector(
    cfg: DictConfig,
    policy: TensorDictModuleBase,
    seed: int,
    total_frames: int,
    device: torch.device,
    frames_per_batch: int | None = None,
    random_frames: int = 0,
) -> Collector | CollectorProcess | CollectorWorkers | CollectorWorkersAsync:
    """The collector of ``cfg.collector.mode`` for one learner: batches of
    ``frames_per_batch`` frames (by default ``collector.frames_per_batch``) shaped
    ``[num_envs, steps]`` (time last; async workers' ``[num_envs / K, K * steps]``), on the
    CPU; ``total_frames=-1``: endless. The first ``random_frames`` (rounded up to whole
    batches, at least one for each async worker) act uniformly at random instead of with
    the policy.

    Settings measured for speed (benchmarks/collection.py, docs/benchmarks.md): no
    trajectory ids (nothing reads them), no policy transforms registered behind the
    recipe's back, each batch stacked once (no buffers copied into it), and, with the
    policy on the CPU, no device anywhere: the env's outputs and the batches stay
    device-less CPU tensors. Naming a device makes torchrl cast every step's tensordict to
    it (``GymWrapper`` at each step and reset, the collector between env, policy and
    storage), and each such cast also asks whether CUDA is available, which Lightning's
    ``PYTORCH_NVML_BASED_CUDA_CHECK`` turns into a library load per call.
    """
    # An async collector's process acts with a CPU copy of the policy. A policy on a GPU
    # takes the env's CPU tensors to its device, and the batches come back to the CPU.
    workers = cfg.collector.workers
    on_cpu = cfg.collector.mode == COLLECT_ASYNC or workers > 1 or device.type == "cpu"
    env_device = None if on_cpu else "cpu"
    env = OmegaConf.to_container(cfg.env)
    make = functools.partial(make_env, env, cfg.env.num_envs, seed, env_device, policy=policy)
    frames_per_batch = frames_per_batch or cfg.collector.frames_per_batch
    settings = {
        "frames_per_batch": frames_per_batch,
        "total_frames": total_frames,
        "init_random_frames": math.ceil(random_frames / frames_per_batch) * frames_per_batch,
        "storing_device": env_device,
        "env_device": env_device,
        "postproc": TrainingBatches(cfg.env.get("clip_rewards", False), cfg.env.get("life_loss", False)),
    }
    if workers > 1:
        # Worker i steps copies i * copies .. (i + 1) * copies - 1 of the one-process env,
        # with their seeds: a gymnasium vector env seeds its copies seed, seed + 1, ...
        copies = cfg.env.num_envs // workers
        if env.get("threads"):  # the learner's game threads, shared out
            env["threads"] = max(1, env["threads"] // workers)
        makes = [
            functools.partial(worker_env, env, copies, seed + worker * copies, env_device, policy)
            for worker in range(workers)
        ]
        with signals_ignored(*STOP_SIGNALS):  # as the async collector's child, below
            fork_children_from_a_server()
            if cfg.collector.mode == COLLECT_ASYNC:
                # MultiAsyncCollector starts every worker on a batch before it has counted
                # any, then tells each returning worker whether the frames so far are still
                # below init_random_frames: asked for n batches, K workers act randomly for
                # K + n - 1 (measured: tests/test_collector.py). So n random batches (at
                # least one a worker) are asked as n - K + 1.
                random_batches = settings["init_random_frames"] // frames_per_batch
                asked = max(random_batches - workers + 1, 1) if random_batches else 0
                settings["init_random_frames"] = asked * frames_per_batch
                return CollectorWorkersAsync(
                    makes,
                    copy.deepcopy(policy).cpu(),
                    track_policy_version=True,
                    num_threads=torch.get_num_threads(),
                    **settings,
                )
            return CollectorWorkers(
                makes,
                copy.deepcopy(policy).cpu(),
                # Along the copies: [num_envs, steps], as one process's batch.
                cat_results=0,
                use_buffers=True,  # joining the slices (cat_results) needs them
                # torchrl would otherwise give the learner its threads less one per worker.
                num_threads=torch.get_num_threads(),
                **settings,
            )
    if cfg.collector.mode == COLLECT_ASYNC:
        # The child acts with a CPU copy of the policy in shared memory: it never touches the
        # learner's GPU, and the learner decides when the copy changes (``update_policy_weights_``).
        # Every frame records the version (the number of pushes) of the weights it was
        # collected with, from which the learner computes the policy lag. The child ignores
        # the stop signals (an ignored signal stays ignored in a child, and Python keeps it
        # so): a Ctrl-C or SLURM's warning stops the run through this process, at a step's end.
        with signals_ignored(*STOP_SIGNALS):
            fork_children_from_a_server()
            return CollectorProcess(
                make,
                copy.deepcopy(policy).cpu(),
                track_policy_version=True,
                **settings,
            )
    # Each batch is stacked into new tensors (no buffers reused), so it is handed out as it
    # is: with its buffers torchrl copies them into a new batch, a second copy of every
    # frame (on Pong a tenth of the collector's time: docs/distributed.md, "The data path").
    return Collector(
        make(),
        policy,
        policy_device=None if on_cpu else device,
        track_traj_ids=False,
        auto_register_policy_transforms=False,
        use_buffers=False,
        return_same_td=True,
        **settings,
    )


def fork_children_from_a_server() -> None:
    """Start the collector's child processes from multiprocessing's fork server, which
    imports this module (torch, torchrl, the project) once per rank and forks each child
    from itself. torchrl sets "spawn" when it is imported, and a spawned child imports all
    that anew: about 6 s of CPU a child, so K workers cost K imports at start-up where the
    server costs one. The server is a fresh, single-threaded process: forking it is safe
    where forking the rank, with its threads (gloo, RPC, the watchdog), is not. Its children
    take its signal dispositions, so it must start with the stop signals ignored: it starts
    with the first child, which ``make_collector`` starts with them ignored."""
    multiprocessing.set_forkserver_preload([__name__])
    multiprocessing.set_start_method("forkserver", force=True)


def worker_env(
    env: dict, num_envs: int, seed: int, device: str | None, policy: TensorDictModuleBase
) -> EnvBase:
    """A collector worker's env copies (carrying ``policy``'s recurrent state, if it has
    one), made in the worker, whose torch generator is seeded as they are: every worker
    starts from the fork server's generator, the same in each, so their exploration
    (epsilon-greedy, sampled actions) would draw alike."""
    torch.manual_seed(seed)
    return make_env(env, num_envs, seed, device, policy=policy)


def exit_with_the_learner() -> None:
    """Run first in each collector process (torchrl's ``init_fn``): end it as soon as its
    learner's process is gone. A collector notices that only when it next reads its pipe,
    and one still starting waits up to 60 s for its weights first (torchrl's
    ``WEIGHT_SYNC_TIMEOUT``), holding the run's stderr open after the run has ended."""
    learner = multiprocessing.parent_process()

    def watch() -> None:
        multiprocessing.connection.wait([learner.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-the-learner", daemon=True).start()


class CollectorProcesses:
    """What the learner needs of a torchrl collector that runs in child processes: it also
    closes its weight-sync scheme when it shuts down (torchrl 0.14.1 leaves that to the
    scheme's ``__del__``, which, run at interpreter exit, starts a queue thread and hangs
    the exit), it leaves the learner its torch threads, and it says how a child that ended
    did."""

    def __init__(self, *args, **kwargs) -> None:
        self.weight_sync = SharedMemWeightSyncScheme()  # torchrl's default for this collector
        try:
            super().__init__(
                *args,
                weight_sync_schemes={"policy": self.weight_sync},
                init_fn=exit_with_the_learner,
                **kwargs,
            )
        except (RuntimeError, EOFError, OSError) as error:
            # torchrl reports a child that died while starting as a RuntimeError of its own
            # ("failed to initialize") or its pipe's end: say how it died instead, if it
            # did. A child's own exception (its env's, its policy's) comes as itself.
            status = self.ended(wait_s=2.0)
            if status is None and isinstance(error, BrokenPipeError):
                # The child died before it read what it was to run: it is not among the
                # started processes, whose exit codes say how they ended.
                status = "as it started"
            if status is None:
                raise
            raise ProcessDied(status) from None

    def shutdown(self, *args, **kwargs) -> None:
        threads = torch.get_num_threads()
        super().shutdown(*args, **kwargs)
        self.weight_sync.shutdown()
        # torchrl's shutdown gives this process the torch threads it had when torchrl was
        # imported (up to its threads plus one per child): the learner keeps its share.
        torch.set_num_threads(threads)

    def ended(self, wait_s: float = 0.0) -> str | None:
        """How a child process ended, in words; None while they run (after waiting up to
        ``wait_s`` for one to end)."""
        processes = getattr(self, "procs", [])  # none yet if it failed before starting one
        ended = []
        for index, process in enumerate(processes):
            try:
                if wait_s:
                    process.join(wait_s)
                code = process.exitcode
            except ValueError:  # closed: torchrl closes the survivors when a worker fails
                continue
            if code is not None:
                ended.append((code == 0, index, code))
        if not ended:
            return None
        # torchrl shuts the other workers down when one dies (the async ones exit cleanly):
        # the one that did not exit cleanly is the cause.
        _, index, code = min(ended)
        worker = f"worker {index} of {len(processes)}: " if len(processes) > 1 else ""
        return worker + exit_status(code)


class CollectorProcess(CollectorProcesses, AsyncCollector):
    """torchrl's ``AsyncCollector``: one child process collects while the learner trains."""


class CollectorWorkers(CollectorProcesses, MultiSyncCollector):
    """torchrl's ``MultiSyncCollector``: ``collector.workers`` child processes collect a
    batch together while the learner waits."""


class CollectorWorkersAsync(CollectorProcesses, MultiAsyncCollector):
    """torchrl's ``MultiAsyncCollector``: ``collector.workers`` child processes each collect
    whole batches while the learner trains; the learner takes them as they come."""


class ProcessDied(Exception):
    """A collector's process died while it started; the message says how."""


class CollectorFailed(RankFailure):
    """The collector's process died."""


class CollectingFailed(RankFailure):
    """The environment or the policy raised while collecting."""


@contextmanager
def collecting(env_id: str) -> Iterator[None]:
    """Collect from ``env_id``: an environment or a policy that raises stops the run with one
    line naming the env and the exception (its type and first line), the exception's whole
    traceback in this rank's log before it, and the exception as the line's cause."""
    try:
        yield
    except RankFailure:
        raise
    except Exception as error:
        log.error("collecting from %s failed", env_id, exc_info=True)
        message = (str(error).strip().splitlines() or [""])[0]
        raise CollectingFailed(f"collecting from {env_id}: {type(error).__name__}: {message}") from error


def next_batch(
    collector: Collector | CollectorProcesses, batches: Iterator[TensorDictBase], owner: str, env_id: str
) -> TensorDictBase:
    """The next batch from ``batches``, ``collector``'s iterator, of ``env_id``'s copies. A
    dead collector process is reported as one, naming ``owner``; an error in this process
    (the environment's, a recipe's policy's) as ``collecting`` does."""
    with collecting(env_id):
        try:
            return next(batches)
        except Exception:
            # torchrl reports a worker that died as a RuntimeError, or, while it starts, as
            # the EOFError or broken pipe of its end of the pipe; that end can see the death
            # a moment before the process can be reaped.
            reason = death(collector, owner, env_id, wait_s=2.0)
            if reason is None:
                raise
            # The child printed the traceback of what killed it, if anything did, above.
            raise CollectorFailed(reason) from None


def death(
    collector: Collector | CollectorProcesses, owner: str, env_id: str, wait_s: float = 0.0
) -> str | None:
    """How ``collector``'s process died, in words naming ``owner`` and ``env_id``; None
    while it runs (``wait_s`` seconds after the call), or for a collector in this process."""
    ended = collector.ended(wait_s) if isinstance(collector, CollectorProcesses) else None
    return None if ended is None else died(owner, env_id, ended)


def died(owner: str, env_id: str, status: str) -> str:
    return f"the collector process of {owner}, collecting from {env_id}, died ({status})"
