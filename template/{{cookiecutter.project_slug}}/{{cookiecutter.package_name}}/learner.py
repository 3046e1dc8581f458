"""The learner's two loops, one per kind of recipe, each read top to bottom.

``off_policy`` (recipes with replay): collect a batch, push it to replay, sample batches,
update with DDP, send priorities back. ``on_policy`` (PPO): collect a batch, then a few
epochs of DDP updates on minibatches of what was just collected.

Every learner runs the same number of collector steps and the same number of updates per
step, so the DDP all-reduces of all learners always pair up. On-policy rollouts may differ
in length between learners (DD-PPO's preemption threshold, see preemption.py); frames are
counted as collected. ``Learner`` holds what both loops share: the agent and its
optimizer, the counters, and what happens between steps (reports, evaluations,
checkpoints, a stop request).
"""

from __future__ import annotations

import math
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from lightning_fabric.utilities.seed import seed_everything
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDictBase
from torch.nn.parallel import DistributedDataParallel

from . import checkpoint, preemption
from .collector import POLICY_VERSION, make_collector, next_batch
from .config import ASYNC
from .envs import make_env
from .evaluation import evaluate
from .replay import ReplayClient
from .topology import Topology
from .watchdog import Watchdog


@dataclass
class Run:
    """What a learner needs to know about the run it is part of."""

    cfg: DictConfig
    recipe: ModuleType
    topology: Topology
    device: torch.device
    learner_group: Any  # the learners' process group (None with one learner)
    watchdog: Watchdog  # its ``stop`` is set by SIGINT/SIGTERM on any rank
    recorder: Any  # rank 0's Recorder, reached over RPC
    resumed: dict[str, Any] | None = None  # the checkpoint's meta when the run goes on from one

    @property
    def learners(self) -> int:
        return len(self.topology.learner_ranks)


def off_policy(run: Run, replay: ReplayClient) -> dict[str, Any]:
    """Train a replay recipe until ``total_frames`` or a stop request.

    In ``collector.mode=async`` the collector's process gathers the next batch while this
    loop trains on the current one, and waits until the loop asks for it: inserts and
    samples keep the ratio of ``sync`` mode (``updates_per_batch`` batches of
    ``batch_size`` per ``frames_per_batch`` collected), give or take the one batch in
    flight, whichever side is faster waiting for the other.
    """
    learner = Learner(run)
    agent, algo = learner.agent, learner.algo
    learning_starts = algo.learning_starts
    if run.resumed and not run.resumed["replay"]:
        learning_starts += learner.frames  # the checkpoint left replay out: refill it first
    for batch in learner.batches():
        agent.after_collect(batch, learner.step_frames)
        replay.extend(batch.select(*agent.batch_keys))  # [env copies, steps]: stacked frames go once
        learner.inserted += batch.numel()
        if learner.frames >= learning_starts:
            if learner.sampled == 0:
                replay.flush()  # the first sample must see this learner's own frames
            for _ in range(algo.updates_per_batch):
                sample = replay.sample()
                sample[agent.priority_key] = learner.update(sample.to(run.device))
                replay.update_priority(sample, agent.priority_key)
                learner.sampled += sample.numel()
        learner.between_steps(replay)
    return learner.finish(replay)


def on_policy(run: Run) -> dict[str, Any]:
    """Train an on-policy recipe (DD-PPO) until ``total_frames`` or a stop request.

    The learners' rollouts may differ in length (a straggler's is cut short): each learner
    computes its advantages on its own rollout, and all run the same number of minibatches,
    each learner's loss weighted by its share of the frames (``preemption.minibatches``).
    """
    learner = Learner(run)
    agent, algo = learner.agent, learner.algo
    for batch in learner.batches():
        batch = batch.to(run.device)
        agent.after_collect(batch, learner.step_frames)
        transitions = batch.reshape(-1)
        plan = preemption.minibatches(learner.step_sizes, learner.index, algo.minibatch_size)
        sizes, weights = zip(*plan, strict=True)
        for _ in range(algo.epochs):
            shuffled = transitions[torch.randperm(len(transitions))]
            for minibatch, weight in zip(shuffled.split(list(sizes)), weights, strict=True):
                learner.update(minibatch, weight)
        learner.between_steps(None)
    return learner.finish(None)


class Learner:
    """One learner's agent, optimizer and counters, and what its loops share."""

    def __init__(self, run: Run) -> None:
        cfg = run.cfg
        self.run = run
        self.index = run.topology.learner_index
        self.algo = run.recipe.Config(**OmegaConf.to_container(cfg.algo))
        self.max_norm = getattr(self.algo, "max_grad_norm", None)
        self.frames, self.updates = (run.resumed["frames"], run.resumed["updates"]) if run.resumed else (0, 0)
        self.frames_per_step = cfg.collector.frames_per_batch * run.learners
        # This step's frames, all learners, and each learner's: less than planned when the
        # preemption threshold cut a rollout short.
        self.step_frames = self.frames_per_step
        self.step_sizes = [cfg.collector.frames_per_batch] * run.learners
        threshold = preemption.threshold(cfg, run.learners, run.recipe.Agent.uses_replay)
        self.preemption = None
        if threshold is not None:
            steps = cfg.collector.frames_per_batch // cfg.env.num_envs
            self.preemption = preemption.Preemption(
                run.watchdog.store, run.topology.learner_index, run.learners, steps, *threshold
            )
        # This learner's rollouts in this process: their frames, how many, how many cut,
        # and the sum of the fractions of a full rollout they collected.
        self.collected, self.rollouts, self.rollouts_cut, self.rollout_fractions = 0, 0, 0, 0.0
        # Transitions this learner inserted into replay and sampled from it.
        self.inserted, self.sampled = 0, 0
        # The same seed on every learner gives identical initial weights (DDP also
        # broadcasts them from the first learner); the environments get their own seeds.
        seed_everything(cfg.seed, verbose=False)
        spec_env = make_env(cfg.env, cfg.env.num_envs, seed=0)  # what the agent's layers are sized by
        self.agent = run.recipe.Agent(self.algo, spec_env).to(run.device)
        spec_env.close()
        self.optimizers = self.agent.make_optimizers()
        if run.resumed:
            # A learner the checkpoint's run did not have is seeded as its environments are.
            checkpoint.restore_learner(
                Path(run.resumed["folder"]), self.index, self.agent, self.optimizers, run.device,
                fresh_seed=self.env_seed(),
            )  # fmt: skip
        self.model = self.agent
        if run.learners > 1:
            # Plain DDP over the learner group rather than fabric.setup(): the group's own
            # timeout (learners.timeout) bounds every collective, gradients and checkpoint
            # barriers alike, apart from the RPC timeout.
            self.model = DistributedDataParallel(
                self.agent,
                device_ids=[run.device.index] if run.device.type == "cuda" else None,
                process_group=run.learner_group,
                forward_sync_buffers=False,
            )
        self.reports: list[torch.futures.Future] = []
        self.saved_at = self.frames
        # An async collector acts with its own copy of the policy, refreshed every
        # weight_sync_every updates. Each refresh is a policy version; the lag of a frame
        # is the number of updates made since the version it was collected with.
        self.weight_sync_every = cfg.collector.weight_sync_every if cfg.collector.mode == ASYNC else 0
        self.pushed_at = [self.updates]
        self.lags: list[float] = []
        self.label = run.watchdog.label(run.topology.rank)  # names this learner in errors

    def env_seed(self) -> int:
        """The seed of this learner's environments from here on. A resumed run starts new
        episodes (environments cannot be saved mid-episode), seeded by the frames so far."""
        return self.run.cfg.seed + 1000 * self.index + self.frames

    def batches(self) -> Iterator[TensorDictBase]:
        """The collector's batches until ``total_frames``, or until a learner is asked to
        stop; counts frames and records finished episodes. A collector that produces no
        batch for ``collector.timeout`` seconds stops the run."""
        cfg, run = self.run.cfg, self.run
        planned = planned_frames(cfg, run.learners, self.frames)
        # This learner's share of the frames still to collect.
        frames = (planned - self.frames) // run.learners
        seed = self.env_seed()
        # The recipe's random_frames (all learners) that are still to come, this learner's share.
        random_frames = math.ceil(max(0, getattr(self.algo, "random_frames", 0) - self.frames) / run.learners)
        cuts = self.preemption
        # Starting an async collector's process imports torch anew: allow it more time.
        with self.collector_deadline(startup=True):
            if cuts is None:
                self.collector = make_collector(
                    cfg, self.agent.policy, seed, frames, run.device, random_frames=random_frames
                )
            else:  # rollouts of any length: the loop below counts the frames
                chunk = cuts.chunk_steps * cfg.env.num_envs
                self.collector = make_collector(cfg, self.agent.policy, seed, -1, run.device, chunk)
        # Training time and rates start here: the collector's start-up is set-up.
        self.started = time.monotonic()
        self.window = Window()
        batches = iter(self.collector)
        while cuts is None or self.frames < planned:
            with self.collector_deadline():
                # A store that stops answering in cuts.rollout is rank 0's death: the
                # watchdog names it (next_batch would blame this learner's collector).
                batch = next_batch(batches, self.label) if cuts is None else cuts.rollout(batches)
            if batch is None or all_agree(run.watchdog.stop, run.learner_group, run.learners, run.device):
                return  # done, or asked to stop (SIGINT, SIGTERM): every learner leaves at this same step
            if cuts is not None:
                self.step_sizes = preemption.sizes_of_all(
                    batch.numel(), self.index, run.learners, run.learner_group, run.device
                )
                self.step_frames = sum(self.step_sizes)
            self.frames += self.step_frames
            fraction = batch.numel() / cfg.collector.frames_per_batch
            self.collected += batch.numel()
            self.rollouts += 1
            self.rollouts_cut += fraction < 1
            self.rollout_fractions += fraction
            self.window.add_episodes(batch)
            if POLICY_VERSION in batch.keys():
                versions = batch[POLICY_VERSION].flatten()
                self.lags.append(self.updates - float(torch.tensor(self.pushed_at)[versions].float().mean()))
            yield batch

    def update(self, batch: TensorDictBase, weight: float = 1.0) -> torch.Tensor | None:
        """One gradient step; with DDP, ``backward`` all-reduces the gradients over the
        learners. ``weight`` scales this learner's loss in that average (on-policy
        minibatches of different sizes, see ``preemption.minibatches``). Returns the new
        priorities on the CPU (replay recipes: the loss wrote them into ``batch``), or None.

        The loss and the priorities come to the CPU in one copy: on a GPU each copy waits
        for the work queued before it, so this is the update's one synchronisation.
        """
        self.updates += 1
        agent = self.agent
        loss, metrics = self.model(batch)
        priorities = loss.new_empty(0)
        if agent.uses_replay:
            priorities = batch[agent.priority_key].detach().reshape(-1)
        checked = torch.cat([loss.detach().reshape(1).to(priorities.dtype), priorities]).cpu()
        # Checked before the step: the weights stay finite. A non-finite priority would
        # poison the sum tree every later sample is drawn from.
        if not torch.isfinite(checked[0]):
            raise NonFinite(f"non-finite loss ({checked[0].item()}) at {self.where()}")
        if not torch.isfinite(checked[1:]).all():
            raise NonFinite(f"non-finite priorities at {self.where()}")
        for optimizer in self.optimizers.values():
            optimizer.zero_grad(set_to_none=True)
        (loss * weight).backward()
        if self.max_norm is not None:
            # After backward, DDP has all-reduced the gradients: every learner clips the same.
            torch.nn.utils.clip_grad_norm_(self.agent.parameters(), self.max_norm)
        # All gradients were all-reduced, so the learners' all-reduces pair up; the recipe
        # says which optimizers use theirs at this update (TD3 moves its actor every other).
        for name in agent.optimizers_to_step(self.updates):
            self.optimizers[name].step()
        agent.after_update(self.updates)
        self.window.add_metrics(metrics)
        if self.weight_sync_every and self.updates % self.weight_sync_every == 0:
            with self.collector_deadline():  # the collector's process acknowledges the copy
                self.collector.update_policy_weights_(self.agent.policy)
            self.pushed_at.append(self.updates)
        return checked[1:].reshape(batch[agent.priority_key].shape) if agent.uses_replay else None

    def collector_deadline(self, startup: bool = False) -> AbstractContextManager:
        """Stop the run if the collector keeps this learner waiting for ``collector.timeout``
        seconds (four times that to start)."""
        timeout = self.run.cfg.collector.timeout * (4 if startup else 1)
        return self.run.watchdog.deadline(f"the collector of {self.label}", timeout)

    def where(self) -> str:
        return f"frame {self.frames}, update {self.updates}"

    def between_steps(self, replay: ReplayClient | None) -> None:
        """Report metrics, evaluate and write a checkpoint when their frame comes."""
        cfg, recorder = self.run.cfg, self.run.recorder
        if crossed(self.frames, self.step_frames, cfg.log_every):
            self.reports.append(recorder.rpc_async().report(self.frames, self.window.flush()))
        if crossed(self.frames, self.step_frames, cfg.eval.every):
            returns = self.greedy_returns()
            self.reports.append(recorder.rpc_async().report(self.frames, {"eval_return": mean(returns)}))
        if crossed(self.frames, self.step_frames, cfg.checkpoint.every):
            self.save_checkpoint(replay)

    def greedy_returns(self) -> list[float]:
        """Each learner plays its share of the evaluation episodes (rounded up), on its own seeds."""
        cfg = self.run.cfg
        episodes = math.ceil(cfg.eval.episodes / self.run.learners)
        seed = cfg.seed + 1_000_000 + 1000 * self.index
        return evaluate(self.agent.policy, cfg.env, episodes, seed, self.run.device)

    def save_checkpoint(self, replay: ReplayClient | None) -> None:
        # The rows reported so far belong with the checkpoint: wait until rank 0 has them.
        torch.futures.wait_all(self.reports)
        run = self.run
        save_checkpoint(
            run.cfg, self.frames, self.updates, self.agent, self.optimizers, replay,
            run.topology, run.learner_group, run.device,
        )  # fmt: skip
        self.saved_at = self.frames

    def finish(self, replay: ReplayClient | None) -> dict[str, Any]:
        """Checkpoint a stopped run, close the collector, wait for every report, and return
        this learner's statistics for the summary."""
        cfg, stop = self.run.cfg, self.run.watchdog.stop
        if stop.is_set() and cfg.checkpoint.every > 0 and self.saved_at != self.frames:
            self.save_checkpoint(replay)  # stopped early: the run can go on from here
        if self.window.frames:  # the frames since the last row: a run shorter than log_every gets one too
            self.reports.append(self.run.recorder.rpc_async().report(self.frames, self.window.flush()))
        train_s = time.monotonic() - self.started
        self.collector.shutdown()
        if replay is not None:
            replay.flush()
        for report in self.reports:
            report.wait()
        stats = {
            "frames": self.frames,  # all learners: the same on every one
            "rollouts": {
                "frames": self.collected,
                "rollouts": self.rollouts,
                "cut": self.rollouts_cut,
                "mean_fraction": self.rollout_fractions / self.rollouts if self.rollouts else 1.0,
            },
            "stopped_by": stop.signal,
            "updates": self.updates,
            "train_s": train_s,
            "inserted": self.inserted,
            "sampled": self.sampled,
            "policy_lag": mean(self.lags) if self.lags else 0.0,
            "param_checksum": sum(p.detach().double().sum() for p in self.agent.parameters()).item(),
            "eval_returns": self.greedy_returns(),
        }
        if self.index == 0:  # the learners' weights are identical: one of them saves
            path = checkpoint.save_agent(Path(cfg.run_dir) / checkpoint.FINAL, cfg, self.agent)
            stats["checkpoint"] = str(path)
        return stats


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


class NonFinite(FloatingPointError):
    """A loss or priority that is NaN or infinite; training cannot go on from it."""


def save_checkpoint(
    cfg: DictConfig,
    frames: int,
    updates: int,
    agent: Any,
    optimizers: dict[str, torch.optim.Optimizer],
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
        optimizer_states = {name: optimizer.state_dict() for name, optimizer in optimizers.items()}
        torch.save({"agent": agent.state_dict(), "optimizers": optimizer_states}, partial / "agent.pt")
        shards = replay.shards if replay is not None else []
        if cfg.checkpoint.replay:
            for shard_index, shard in enumerate(shards):
                shard.rpc_sync().save(str(partial / f"replay-{shard_index}"))
        meta = {
            "recipe": cfg.recipe,
            "env_id": cfg.env.id,
            "frames": frames,
            "updates": updates,
            "learners": learners,
            "replay_shards": len(shards),
            "replay": bool(shards) and cfg.checkpoint.replay,
            "frames_per_batch": cfg.collector.frames_per_batch,
        }
        checkpoint.write_meta(partial, meta)  # last: a folder without meta.json is incomplete
        checkpoint.commit(partial, final, cfg.checkpoint.keep)
    barrier(group, learners, device)


def barrier(group: Any, learners: int, device: torch.device) -> None:
    """Wait for all learners (an all-reduce: gloo and NCCL both have it). Reading the result
    makes the CPU wait too: NCCL's all-reduce only queues work on the GPU, and a learner
    must not go on to read files the others are still writing."""
    if learners > 1:
        done = torch.zeros(1, device=device)
        dist.all_reduce(done, group=group)
        done.item()


def all_agree(flag: threading.Event, group: Any, learners: int, device: torch.device) -> bool:
    """Whether ``flag`` is set on any learner: all learners get the same answer."""
    if learners == 1:
        return flag.is_set()
    raised = torch.tensor([float(flag.is_set())], device=device)
    dist.all_reduce(raised, op=dist.ReduceOp.MAX, group=group)
    return bool(raised.item())


def planned_frames(cfg: DictConfig, learners: int, start: int = 0) -> int:
    """``total_frames`` rounded up to whole collector steps of all learners, counted on
    from ``start`` (a resumed run's frames, in steps of however many learners it had)."""
    frames_per_step = cfg.collector.frames_per_batch * learners
    return start + math.ceil(max(0, cfg.total_frames - start) / frames_per_step) * frames_per_step


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
