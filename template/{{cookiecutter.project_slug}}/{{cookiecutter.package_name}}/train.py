"""Train an agent: Lightning Fabric starts the ranks, then each rank plays its role.

    python train.py                                # one process (replay buffer in-process)
    python train.py fabric.devices=2               # Fabric starts 2 ranks itself
    fabric run --accelerator cpu --strategy ddp --devices 2 train.py seed=1
    python train.py --print-config env.id=Acrobot-v1   # show the resolved config and stop
    python train.py recipe=<name> --help           # every key: its value and what it means

``train.py`` in the project folder runs ``main`` below; where the project is installed as
a package (``pip install .``), ``python -m <package>.train`` and the ``<project>-train``
command (pyproject.toml's ``[project.scripts]``) do. The defaults are this package's
``config.yaml``.

Every rank Fabric starts is a learner. With several of them and a replay recipe, rank 0
also starts ``replay.processes`` CPU processes that host the prioritized replay buffer's shards
(distributed/replay_processes.py); one process keeps its buffer in-process (see
distributed/topology.py). Rank 0 writes the run's records into run_dir. The training
loops themselves are in learner.py.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from types import ModuleType

import torch
from lightning_fabric import Fabric
from lightning_fabric.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig

from . import checkpoint, config, learner, logs, recipes, usage
from .distributed import replay_processes, restarts, topology
from .distributed.watchdog import Watchdog
from .recorder import Recorder
from .replay import ReplayClient

log = logging.getLogger(__name__)
Autocast = Callable[[], AbstractContextManager]
DEFAULTS = Path(__file__).with_name("config.yaml")
FLAGS = {"-h", "--help", "--print-config"}


def main(argv: list[str] | None = None) -> int:
    """The exit code of a run with command-line arguments ``argv`` (default: sys.argv's)."""
    argv = sys.argv[1:] if argv is None else argv
    overrides = [arg for arg in argv if arg not in FLAGS]
    try:
        cfg = config.load(overrides, DEFAULTS)
        recipe = recipes.load(cfg.recipe)
        resumed = checkpoint.check_resume(cfg)
        if not FLAGS & set(argv):  # --help and --print-config run nothing
            checkpoint.check_run_dir(cfg, resumed)
            agent = recipes.check_update(cfg.recipe, recipe, cfg.algo, cfg.env, cfg.seed)
            if cfg.cudagraphs:
                recipes.check_graphable(cfg.recipe, agent)
    except (config.ConfigError, recipes.RecipeError) as error:
        return refused(error)
    if {"-h", "--help"} & set(argv):
        print(usage.render(cfg, recipe, DEFAULTS))
        return 0
    if "--print-config" in argv:
        print(usage.annotated_config(cfg, config.sources(overrides, DEFAULTS)), end="")
        return 0

    logs.setup(logs.launcher_rank())
    topology.bind_to_loopback_unless_named(cfg.rpc.address)
    topology.join_restarted_attempt(cfg.learners.timeout)
    # On any machine with SLURM installed, Lightning warns that a run not started by srun
    # should be: wrong advice for `fabric run` or torchrun there (slurm.sh runs torchrun).
    warnings.filterwarnings("ignore", message="The `srun` command is available")
    try:
        fabric = Fabric(**fabric_arguments(cfg))
    except (ValueError, RuntimeError, ImportError, MisconfigurationException) as error:
        # Lightning's refusal of the fabric settings (or of `fabric run`'s): an accelerator
        # this machine lacks (fabric.accelerator=cuda without a GPU), an unknown name, ...
        message = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return refused(config.ConfigError(f"Fabric refuses the fabric settings: {message}"))
    try:
        config.check_learners(cfg, config.learner_device(cfg, fabric.device), fabric.world_size)
    except config.ConfigError as error:
        return refused(error)
    if os.environ.get("LT_CLI_USED") == "1":
        # `fabric run` already started the ranks; Fabric forbids launch()
        return run(fabric, cfg, recipe, resumed)
    return fabric.launch(run, cfg, recipe, resumed)


def refused(error: ValueError) -> int:
    """Say what is wrong with the configuration or the recipe in one line; the exit code.
    Under `fabric run` or torchrun every rank checks the same config and rank 0 says it.
    The others wait a moment: the launcher stops all ranks as soon as one exits, and then
    adds its own report of rank 0's exit (a ChildFailedError traceback, exit code 1),
    which no rank can prevent."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {error}", file=sys.stderr)
    else:
        time.sleep(5)
    return 2


def fabric_arguments(cfg: DictConfig) -> dict:
    """Fabric's settings; values that `fabric run` or torchrun already chose win."""
    devices, num_nodes = cfg.fabric.devices, cfg.fabric.num_nodes
    if devices is None:
        if "LT_DEVICES" in os.environ:
            devices = "auto"  # let `fabric run --devices` decide
        elif "LOCAL_WORLD_SIZE" in os.environ:  # torchrun without Fabric's CLI
            devices = int(os.environ["LOCAL_WORLD_SIZE"])
            num_nodes = int(os.environ["WORLD_SIZE"]) // devices
        else:
            devices = 1
    return {
        # learners.share_gpu: Fabric starts CPU ranks (gloo); each learner moves to GPU 0.
        "accelerator": "cpu" if cfg.learners.share_gpu else cfg.fabric.accelerator,
        "strategy": cfg.fabric.strategy,
        "devices": devices,
        "num_nodes": num_nodes,
        "precision": cfg.fabric.precision,
    }


def run(fabric: Fabric, cfg: DictConfig, recipe: ModuleType, resumed: checkpoint.Checkpoint | None) -> int:
    """This rank's part of the run; returns the process's exit code. ``resumed``: the
    checkpoint the run goes on from."""
    plan = topology.Topology.plan(
        fabric.world_size, fabric.global_rank, cfg.replay.processes, recipe.Agent.uses_replay
    )
    logs.setup(plan.rank, plan.role)
    if plan.rank == 0:
        where = {topology.REPLAY: " (a CPU process of rank 0)", topology.LEARNER: ""}
        log.info("roles: %s", ", ".join(f"rank {r} {role}{where[role]}" for r, role in plan.roles.items()))
    # Adam's moments of weights whose gradients are mostly zero (dead ReLUs, MinAtar's empty
    # channels) decay into denormal floats, on which a CPU computes many times slower: on
    # MinAtar Breakout, Adam's step took 4 times as long after 2,000 updates. Flushed to
    # zero they cost nothing. Set before torch starts its threads, which inherit it.
    torch.set_flush_denormal(True)
    share = topology.cpus_per_rank(getattr(fabric.strategy, "num_processes", 1))
    torch.set_num_threads(cfg.threads or share)
    cfg.env.threads = cfg.env.threads or share
    served = topology.endpoints(cfg.rpc.address, cfg.rpc.port, plan, fabric.broadcast)
    # torchrun's agent (behind `fabric run` too) is every rank's parent and sets this.
    launcher = "the launcher" if "TORCHELASTIC_RUN_ID" in os.environ else None
    on_failure = functools.partial(restarts.failed, cfg.run_dir, plan.rank)
    watchdog = Watchdog(
        plan,
        served.address,
        served.watchdog_port,
        cfg.rpc.heartbeat_timeout,
        cfg.rpc.timeout,
        launcher,
        on_failure,
    )
    with watchdog.watching():
        summary = play_role(fabric, cfg, recipe, resumed, plan, served, watchdog)
    # Only now, with no heartbeats watched: a replay process stops beating once it has left
    # the RPC world, and may take a few seconds more to exit.
    replay_processes.join(list(watchdog.children.values()), cfg.rpc.heartbeat_timeout)
    if summary is not None:
        print(f"summary: {summary}")
    # Stopped by a signal: rank 0 says so in the exit code, as a shell does (128 + its
    # number). The other ranks exit 0: Fabric's launcher kills every rank as soon as one
    # exits non-zero, which could cut rank 0 short of writing its records. Under
    # `torchrun --max-restarts` rank 0 exits 0 too: its agent would take a non-zero exit
    # for a failure and start the ranks again; summary.json's stopped_by says why it stopped.
    restartable = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0
    if watchdog.stop.is_set() and plan.rank == 0 and not restartable:
        return 128 + signal.Signals[watchdog.stop.signal]
    return 0


def play_role(
    fabric: Fabric,
    cfg: DictConfig,
    recipe: ModuleType,
    resumed: checkpoint.Checkpoint | None,
    plan: topology.Topology,
    served: topology.Endpoints,
    watchdog: Watchdog,
) -> Path | None:
    """Host, connect, train, and write the records; rank 0 returns the summary."""
    uses_replay = recipe.Agent.uses_replay
    # Objects served over RPC exist before the RPC world opens, so no call can miss them.
    if plan.rank == 0:
        topology.host("recorder", Recorder(cfg, plan, resumed=resumed))
        if uses_replay and plan.world_size == 1:
            topology.host("replay", replay_processes.make_shard(cfg, plan, resumed))
        replay_processes.start(cfg, plan, served, watchdog)
    learner_group = topology.connect(
        plan, served.address, served.rpc_port, cfg.rpc.timeout, cfg.learners.timeout
    )
    if resumed and plan.rank == 0:
        log.info("%s", resumed_line(plan, resumed, uses_replay))

    recorder = topology.handle(plan, 0, "recorder")
    device, autocast = device_and_autocast(cfg, fabric)
    run = learner.Run(cfg, recipe, plan, device, learner_group, watchdog, recorder, autocast, resumed)
    if uses_replay:
        replay = ReplayClient(
            [topology.handle(plan, rank, "replay") for rank in plan.shard_ranks],
            config.learner_batch(cfg, len(plan.learner_ranks), plan.learner_index)[0],
            cfg.replay.beta,
            cfg.replay.batches_per_request,
            first_shard=plan.learner_index,
            share_frames=plan.world_size > 1,  # the shards are in replay processes
            prioritized=cfg.replay.alpha > 0,
        )
        stats = learner.off_policy(run, replay)
    else:
        stats = learner.on_policy(run)
    recorder.rpc_sync().finish(plan.rank, stats)

    summary = None
    if plan.rank == 0:
        records = topology.hosted("recorder")
        records.wait_for_learners()
        shards = []
        if uses_replay:
            shards = [topology.handle(plan, rank, "replay").rpc_sync().stats() for rank in plan.shard_ranks]
        summary = records.close(shards)
    topology.disconnect(plan)
    return summary


def device_and_autocast(cfg: DictConfig, fabric: Fabric) -> tuple[torch.device, Autocast]:
    """This learner's device and the autocast around its loss: Fabric's, or with
    ``learners.share_gpu`` GPU 0 and an autocast for it (Fabric's is for the CPU ranks it
    started)."""
    if not cfg.learners.share_gpu:
        return fabric.device, fabric.autocast
    device = config.learner_device(cfg, fabric.device)
    torch.cuda.set_device(device)
    if cfg.fabric.precision == "bf16-mixed":
        return device, functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16)
    return device, contextlib.nullcontext


def resumed_line(plan: topology.Topology, resumed: checkpoint.Checkpoint, uses_replay: bool) -> str:
    """What a resume restored, in one line; and what changed, when the checkpoint was
    written by another number of learners or replay shards."""
    line = f"resumed from {resumed.folder} at frame {resumed.frames}, update {resumed.updates}"
    changes = resumed.changes(*plan.layout(uses_replay))
    if changes:
        line += f" ({', '.join(changes)})"
    if not uses_replay:
        return line
    if not resumed.replay:
        return f"{line}; replay not restored (saved with checkpoint.replay=false): refilled before updating"
    sizes = [topology.handle(plan, rank, "replay").rpc_sync().stats()["size"] for rank in plan.shard_ranks]
    saved = resumed.replay_shards
    if saved != len(sizes):
        shards = "shard" if saved == 1 else "shards"
        return f"{line}; replay restored: {sum(sizes)} transitions from {saved} {shards} into {len(sizes)}"
    return f"{line}; replay restored: {sum(sizes)} transitions in {len(sizes)} shard(s)"


if __name__ == "__main__":
    sys.exit(main())
