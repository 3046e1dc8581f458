"""Replay shards in CPU processes of their own, beside the learner ranks.

A replay shard needs memory and a core, not a GPU. So that every rank Fabric launches is a
learner (``fabric run --devices 8``: eight GPU learners), rank 0 starts one process per
shard (``replay.processes``) on its node, with no GPU visible to it. Each joins the RPC world
and the watchdog's store as the rank after the learners', serves its shard until the
learners are done, and leaves with the RPC world's shutdown. It stops with the run on a
failure, and on its own when rank 0 is gone (the watchdog compares its parent's pid).

They are started as ``python -m <package>.distributed.replay_processes`` rather than with
multiprocessing: each gets an environment of its own (no GPU, its rank) and a command line
that ``ps`` and ``top`` tell apart from the learners'. The run's configuration reaches
them as the ``config.yaml`` rank 0's recorder wrote into run_dir.
"""

from __future__ import annotations

import argparse
import functools
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from .. import checkpoint, logs
from ..replay import ReplayShard
from . import restarts, topology
from .watchdog import STOP_SIGNALS, Watchdog, exit_status, signals_ignored

log = logging.getLogger(__name__)
PACKAGE_PARENT = Path(__file__).resolve().parents[2]


def make_shard(
    cfg: DictConfig, plan: topology.Topology, resumed: checkpoint.Checkpoint | None
) -> ReplayShard:
    """This process's shard of the replay buffer, holding its part of a checkpoint's replay
    when the run resumes (saved by any number of shards: with another number, the
    transitions are dealt anew)."""
    shards = len(plan.shard_ranks)
    index = plan.shard_ranks.index(plan.rank)
    shard = ReplayShard(
        math.ceil(cfg.replay.capacity / shards),
        cfg.replay.alpha,
        cfg.replay.beta,
        shard=index,
        storage=cfg.replay.storage,
        directory=Path(cfg.replay.directory) / f"shard-{index}",
    )
    if resumed and resumed.replay:
        saved = [resumed.folder / f"replay-{i}" for i in range(resumed.replay_shards)]
        shard.restore(saved, index, shards)
    return shard


def start(cfg: DictConfig, plan: topology.Topology, served: topology.Endpoints, watchdog: Watchdog) -> None:
    """Rank 0 starts the run's replay processes, which its watchdog watches (``children``);
    they share its standard output and error."""
    pythonpath = os.pathsep.join(filter(None, [str(PACKAGE_PARENT), os.environ.get("PYTHONPATH")]))
    for rank in plan.replay_ranks:
        command = [sys.executable, "-m", __name__, str(Path(cfg.run_dir) / "config.yaml")]
        command += ["--rank", str(rank), "--learners", str(len(plan.learner_ranks))]
        command += ["--address", served.address, "--rpc-port", str(served.rpc_port)]
        command += ["--watchdog-port", str(served.watchdog_port)]
        env = {**os.environ, "RANK": str(rank), "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": pythonpath}
        # Started ignoring the stop signals until its watchdog catches them: SLURM's SIGUSR1,
        # which slurm.sh sends again every 10 s, would otherwise kill one still importing
        # torch. A stop that comes meanwhile reaches it through the watchdog's store.
        with signals_ignored(*STOP_SIGNALS):
            watchdog.adopt(rank, subprocess.Popen(command, env=env))


def join(processes: list[subprocess.Popen], timeout_s: float) -> None:
    """Rank 0, once the RPC world has shut down and its watchdog has stopped: wait for the
    replay processes to exit. Each had served its shard to the end (a death before that
    stops the run), so an exit that fails costs the run nothing, but is said."""
    for process in processes:
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("replay process %d did not exit within %g s: killed", process.pid, timeout_s)
            process.kill()
            process.wait()
        else:
            if process.returncode != 0:
                status = exit_status(process.returncode)
                log.warning("replay process %d ended after its part of the run: %s", process.pid, status)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="A replay shard beside the learners (started by rank 0).")
    parser.add_argument("config", type=Path, help="the run's config.yaml, in its run_dir")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--learners", type=int, required=True)
    parser.add_argument("--address", required=True)
    parser.add_argument("--rpc-port", type=int, required=True, help="where rank 0 serves RPC's rendezvous")
    parser.add_argument(
        "--watchdog-port", type=int, required=True, help="where rank 0 serves the watchdog's store"
    )
    args = parser.parse_args(argv)
    cfg = OmegaConf.load(args.config)
    plan = topology.Topology.plan(args.learners, args.rank, cfg.replay.processes, uses_replay=True)
    logs.setup(plan.rank, plan.role)
    # Tree searches and gathers of a few hundred rows gain nothing from more threads.
    torch.set_num_threads(1)
    parent = f"rank 0 ({topology.LEARNER})"
    on_failure = functools.partial(restarts.failed, cfg.run_dir, plan.rank)
    watchdog = Watchdog(
        plan, args.address, args.watchdog_port, cfg.rpc.heartbeat_timeout, cfg.rpc.timeout, parent, on_failure
    )
    with watchdog.watching():
        topology.host("replay", make_shard(cfg, plan, checkpoint.check_resume(cfg)))
        topology.connect(plan, args.address, args.rpc_port, cfg.rpc.timeout, cfg.learners.timeout)
        topology.disconnect(plan)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
