"""The learner's loop. Replay recipes: collect, push to replay, sample, update with DDP, send
priorities back. On-policy recipes: collect, then a few epochs of DDP updates on minibatches
of what was just collected.

Every learner runs the same number of collector steps and the same number of updates per
step, so the DDP all-reduces of all learners always pair up.
"""

from __future__ import annotations

import functools
import math
import shutil
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric import Fabric
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel

from . import checkpoint
from .collector import VectorCollector, make_env
from .evaluation import evaluate
from .replay import ReplayClient
from .topology import Topology
from .watchdog import StopRequest


def train(
    fabric: Fabric,
    cfg: DictConfig,
    topology: Topology,
    recipe: ModuleType,
    replay: ReplayClient | None,
    recorder: Any,
    learner_group: Any,
    stop: StopRequest,
    resumed: dict[str, Any] | None,
) -> dict[str, Any]:
    """Train until ``total_frames`` or a stop request; ``resumed`` is the checkpoint's
    meta (``checkpoint.check_resume``) when the run goes on from one."""
    learners = len(topology.learner_ranks)
    index = topology.learner_index
    algo = recipe.Config(**OmegaConf.to_container(cfg.algo))
    max_norm = getattr(algo, "max_grad_norm", None)
    frames, updates = (resumed["frames"], resumed["updates"]) if resumed else (0, 0)
    # A resumed run starts new episodes: environments cannot be saved mid-episode.
    env = make_env(cfg.env.id, cfg.env.num_envs, seed=cfg.seed + 1000 * index + frames)

    # The same seed on every learner gives identical initial weights (DDP also broadcasts
    # them from the first learner); the environments above got their own seeds.
    fabric.seed_everything(cfg.seed, verbose=False)
    agent = recipe.Agent(algo, env).to(fabric.device)
    optimizer = agent.make_optimizer()
    if resumed:
        checkpoint.restore_learner(Path(resumed["folder"]), index, agent, optimizer, fabric.device)
    model = agent
    if learners > 1:
        # Plain DDP rather than fabric.setup(): Fabric's DDP spans every rank, and the
        # replay ranks hold no model. This one all-reduces over the learners only.
        model = DistributedDataParallel(
            agent,
            device_ids=[fabric.device.index] if fabric.device.type == "cuda" else None,
            process_group=learner_group,
            forward_sync_buffers=False,
        )

    frames_per_step = cfg.collector.frames_per_batch * learners
    steps = planned_frames(cfg, learners) // frames_per_step
    collector = VectorCollector(
        env,
        agent.policy,
        cfg.collector.frames_per_batch,
        (steps - frames // frames_per_step) * cfg.collector.frames_per_batch,
        fabric.device,
    )

    def greedy_returns() -> list[float]:
        # Each learner plays its share of the episodes (rounded up), on its own seeds.
        episodes = math.ceil(cfg.eval.episodes / learners)
        seed = cfg.seed + 1_000_000 + 1000 * index
        return evaluate(agent.policy, cfg.env.id, episodes, seed, fabric.device)

    window = Window()
    step = functools.partial(update, model, optimizer, agent, window, max_norm)
    reports = []
    saved_at = frames
    started = time.monotonic()
    for batch in collector:
        if all_agree(stop, learner_group, learners, fabric.device):
            break  # asked to stop (SIGINT, SIGTERM): every learner leaves at this same step
        frames += frames_per_step
        window.add_episodes(batch)
        if agent.uses_replay:
            agent.after_collect(batch, frames_per_step)
            replay.extend(batch.reshape(-1).select(*agent.batch_keys))
            if frames >= algo.learning_starts:
                if updates == 0:
                    replay.flush()  # the first sample must see this learner's own frames
                for _ in range(algo.updates_per_batch):
                    updates += 1
                    sample = replay.sample().to(fabric.device)
                    step(sample, where=f"frame {frames}, update {updates}")
                    # A non-finite priority would poison the sum tree every later sample is drawn from.
                    if not torch.isfinite(sample[agent.priority_key]).all():
                        raise NonFinite(f"non-finite priorities at frame {frames}, update {updates}")
                    replay.update_priority(sample, agent.priority_key)
        else:
            batch = batch.to(fabric.device)
            agent.after_collect(batch, frames_per_step)
            # Every learner collected the same number of frames, so all run the same
            # number of minibatches and their all-reduces pair up.
            transitions = batch.reshape(-1)
            for _ in range(algo.epochs):
                for minibatch in transitions[torch.randperm(len(transitions))].split(algo.minibatch_size):
                    updates += 1
                    step(minibatch, where=f"frame {frames}, update {updates}")

        if crossed(frames, frames_per_step, cfg.log_every):
            reports.append(recorder.rpc_async().report(frames, window.flush()))
        if crossed(frames, frames_per_step, cfg.eval.every):
            returns = greedy_returns()
            reports.append(recorder.rpc_async().report(frames, {"eval_return": sum(returns) / len(returns)}))
        if crossed(frames, frames_per_step, cfg.checkpoint.every):
            # The rows reported so far belong with the checkpoint: wait until rank 0 has them.
            torch.futures.wait_all(reports)
            save_checkpoint(
                cfg, frames, updates, agent, optimizer, replay, topology, learner_group, fabric.device
            )
            saved_at = frames
    if stop.is_set() and cfg.checkpoint.every > 0 and saved_at != frames:
        # Stopped early: the run can go on from here.
        torch.futures.wait_all(reports)
        save_checkpoint(
            cfg, frames, updates, agent, optimizer, replay, topology, learner_group, fabric.device
        )
    if window.frames:  # the frames since the last row: a run shorter than log_every gets one too
        reports.append(recorder.rpc_async().report(frames, window.flush()))
    train_s = time.monotonic() - started
    collector.shutdown()
    if agent.uses_replay:
        replay.flush()
    for report in reports:
        report.wait()

    stats = {
        "frames": frames // learners,
        "stopped_by": stop.signal,
        "updates": updates,
        "train_s": train_s,
        "param_checksum": sum(p.detach().double().sum() for p in agent.parameters()).item(),
        "eval_returns": greedy_returns(),
    }
    if index == 0:  # the learners' weights are identical: one of them saves
        stats["checkpoint"] = str(checkpoint.save_agent(Path(cfg.run_dir) / checkpoint.FINAL, cfg, agent))
    return stats


class NonFinite(FloatingPointError):
    """A loss or priority that is NaN or infinite; training cannot go on from it."""


def update(model, optimizer, agent, window: Window, max_norm: float | None, batch, where: str) -> None:
    """One gradient step; with DDP, ``backward`` all-reduces the gradients over the learners.
    ``max_norm`` clips the gradients' norm (the recipe's ``max_grad_norm``); ``where`` says
    where the run is, for the error should the loss not be finite."""
    loss, metrics = model(batch)
    if not torch.isfinite(loss):
        # Checked before the step: the weights and the priorities stay finite.
        raise NonFinite(f"non-finite loss ({loss.item()}) at {where}")
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if max_norm is not None:
        # After backward, DDP has all-reduced the gradients: every learner clips the same.
        torch.nn.utils.clip_grad_norm_(agent.parameters(), max_norm)
    optimizer.step()
    agent.after_update()
    window.add_metrics(metrics)


def save_checkpoint(
    cfg: DictConfig,
    frames: int,
    updates: int,
    agent: Any,
    optimizer: torch.optim.Optimizer,
    replay: ReplayClient | None,
    topology: Topology,
    group: Any,
    device: torch.device,
) -> None:
    """Every learner calls this at the same step. The shards must not change while they are
    written: each learner first waits for its own writes, and none goes on before the
    checkpoint is complete."""
    learners = len(topology.learner_ranks)
    index = topology.learner_index
    final = checkpoint.training_dir(cfg.run_dir, frames)
    partial = checkpoint.partial_dir(final)
    if replay is not None:
        replay.flush()
    if index == 0:
        shutil.rmtree(partial, ignore_errors=True)  # what a crash in an earlier write left
        partial.mkdir(parents=True)
    barrier(group, learners, device)
    torch.save(checkpoint.rng_state(), partial / f"rng-{index}.pt")
    barrier(group, learners, device)
    if index == 0:
        torch.save({"agent": agent.state_dict(), "optimizer": optimizer.state_dict()}, partial / "agent.pt")
        shards = replay.shards if replay is not None else []
        for shard_index, shard in enumerate(shards):
            shard.rpc_sync().save(str(partial / f"replay-{shard_index}"))
        meta = {
            "recipe": cfg.recipe,
            "env_id": cfg.env.id,
            "frames": frames,
            "updates": updates,
            "learners": learners,
            "replay_shards": len(shards),
            "frames_per_batch": cfg.collector.frames_per_batch,
        }
        checkpoint.write_meta(partial, meta)  # last: a folder without meta.json is incomplete
        checkpoint.commit(partial, final, cfg.checkpoint.keep)
    barrier(group, learners, device)


def barrier(group: Any, learners: int, device: torch.device) -> None:
    """Wait for all learners (an all-reduce: gloo and NCCL both have it)."""
    if learners > 1:
        dist.all_reduce(torch.zeros(1, device=device), group=group)


def all_agree(flag: threading.Event, group: Any, learners: int, device: torch.device) -> bool:
    """Whether ``flag`` is set on any learner: all learners get the same answer."""
    if learners == 1:
        return flag.is_set()
    raised = torch.tensor([float(flag.is_set())], device=device)
    dist.all_reduce(raised, op=dist.ReduceOp.MAX, group=group)
    return bool(raised.item())


def planned_frames(cfg: DictConfig, learners: int) -> int:
    """``total_frames`` rounded up to whole collector steps of all learners."""
    frames_per_step = cfg.collector.frames_per_batch * learners
    return math.ceil(cfg.total_frames / frames_per_step) * frames_per_step


def crossed(frames: int, step: int, every: int) -> bool:
    """Whether ``frames`` just passed a multiple of ``every`` (the same on all learners)."""
    return every > 0 and frames // every > (frames - step) // every


class Window:
    """Metrics since the last report: throughput, mean losses, finished episodes' returns."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.frames = 0
        self.sums: dict[str, float] = {}
        self.updates = 0
        self.returns: list[float] = []

    def add_episodes(self, batch) -> None:
        self.frames += batch.numel()
        done = batch["next", "done"].squeeze(-1)
        self.returns += batch["next", "episode_reward"].squeeze(-1)[done].tolist()

    def add_metrics(self, metrics: dict[str, torch.Tensor]) -> None:
        self.updates += 1
        for key, value in metrics.items():
            self.sums[key] = self.sums.get(key, 0.0) + value

    def flush(self) -> dict[str, float]:
        elapsed = time.monotonic() - self.started
        row = {
            "frames_per_s": self.frames / elapsed,
            "updates_per_s": self.updates / elapsed,
            "train_return": sum(self.returns) / len(self.returns) if self.returns else math.nan,
        }
        row.update({key: float(total) / self.updates for key, total in self.sums.items()})
        self.__init__()
        return row
