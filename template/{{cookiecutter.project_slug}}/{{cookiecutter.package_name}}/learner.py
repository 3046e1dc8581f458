"""The learner's two loops, one per kind of recipe, each read top to bottom.

``off_policy`` (recipes with replay): collect a batch, push it to replay, sample batches,
update with DDP, send priorities back. ``on_policy`` (PPO): collect a rollout, then a few
epochs of DDP updates on minibatches of what was just collected.

Every learner runs the same number of collector steps and the same number of updates per
step, so the all-reduces of all learners always pair up. Each one is a line of the loops
(the stop agreement, the rollout sizes, the checkpoint's barriers) or of
``Learner.update`` (the gradients' all-reduce, inside ``backward``, or after a CUDA
graph's replay). On-policy rollouts may differ in length between learners (DD-PPO's
straggler threshold, see distributed/stragglers.py); frames are counted as collected.
``Learner`` holds what both loops share, all of it made in its ``__init__``: the agent,
its optimizers, its collector, the counters.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
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

from . import checkpoint, config, graphs, recipes, timing
from .collector import (
    POLICY_VERSION,
    CollectorFailed,
    ProcessDied,
    collecting,
    death,
    died,
    make_collector,
    next_batch,
)
from .distributed import stragglers
from .distributed.topology import Topology
from .distributed.watchdog import Watchdog
from .evaluation import evaluate
from .recorder import Window
from .replay import ReplayClient
from .timing import phase, timed


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
    autocast: Callable[[], AbstractContextManager]  # Fabric's, for its ``fabric.precision``
    resumed: checkpoint.Checkpoint | None = None  # the checkpoint the run goes on from


def off_policy(run: Run, replay: ReplayClient) -> dict[str, Any]:
    """Train a replay recipe until ``total_frames`` or a stop request.

    With ``learners.batch_size_of=run`` (the default) N learners make N times one learner's
    updates a step, each on its ``batch_size`` transitions dealt out over them
    (``config.learner_batch``): per frame, the updates of one learner. In
    ``collector.mode=async`` the collector's process gathers the next batch while this
    loop trains on the current one, and waits until the loop asks for it: inserts and
    samples keep the ratio of ``sync`` mode, give or take the one batch in flight,
    whichever side is faster waiting for the other.
    """
    cfg = run.cfg
    learner = Learner(run)
    agent, algo = learner.agent, learner.algo
    learning_starts = algo.learning_starts
    if run.resumed and not run.resumed.replay:
        learning_starts += learner.frames  # the checkpoint left replay out: refill it first
    while learner.frames < learner.planned_frames:
        batch = learner.collect()  # [env copies, steps], from this learner's collector
        if learner.stop_agreed():  # all-reduce: every learner leaves at this same step
            break
        learner.count(batch, learner.frames_per_step)
        with phase("after_collect"):
            agent.after_collect(batch, learner.step_frames, learner.sum_over_learners)
        # Transitions, or a sequence recipe's sequences; asynchronous; pixels go once.
        replay.extend(recipes.replay_items(agent, batch), recipes.sequence_overlap(agent))
        # A sequence recipe's first items come sequence_length steps in, whatever
        # learning_starts says; every learner cuts as many, so all agree when to start.
        if learner.frames >= learning_starts and replay.inserted:
            if replay.sampled == 0:
                replay.flush()  # the first sample must see this learner's own frames
            for _ in range(learner.updates_per_step):
                sample = replay.sample()  # prioritized (alpha 0: uniform), across the shards; prefetched
                # Loss, backward (all-reduce), step.
                priorities = learner.update(sample.to(run.device), learner.batch_weight)
                replay.update_priority(sample, priorities)  # asynchronous; uniform replay sends none
        if learner.due(cfg.log_every):
            learner.report()
        if cfg.eval.episodes and learner.due(cfg.eval.every):
            learner.evaluate()
        if learner.due(cfg.checkpoint.every):
            learner.save_checkpoint(replay)  # barriers: every learner writes at this step
    return learner.finish(replay)


def on_policy(run: Run) -> dict[str, Any]:
    """Train an on-policy recipe (DD-PPO) until ``total_frames`` or a stop request.

    The learners' rollouts may differ in length (a straggler's is cut short): each learner
    computes its advantages on its own rollout, and all run the same number of minibatches,
    each learner's loss weighted by its share of the frames (``stragglers.minibatches``).
    """
    cfg = run.cfg
    learner = Learner(run)
    agent, algo = learner.agent, learner.algo
    while learner.frames < learner.planned_frames:
        batch = learner.collect()  # a rollout [env copies, steps], full or cut by the threshold
        if learner.stop_agreed():  # all-reduce: every learner leaves at this same step
            break
        sizes = learner.rollout_sizes(batch)  # all-reduce, when the threshold can cut rollouts
        learner.count(batch, sum(sizes))
        batch = batch.to(run.device)
        # Advantages along each copy's steps; statistics all-reduced through sum_over_learners.
        with phase("after_collect"):
            agent.after_collect(batch, learner.step_frames, learner.sum_over_learners)
        if recipes.recurrent(agent):  # minibatches of whole env copies' sequences
            samples = batch
            plan = stragglers.sequence_minibatches(sizes, learner.index, len(batch), algo.minibatch_size)
        else:  # minibatches of frames
            samples = batch.reshape(-1)
            plan = stragglers.minibatches(sizes, learner.index, algo.minibatch_size)
        for _ in range(algo.epochs):
            for minibatch, weight in learner.shuffled(samples, plan):
                learner.update(minibatch, weight)  # loss, backward (all-reduce), step
        if learner.due(cfg.log_every):
            learner.report()
        if cfg.eval.episodes and learner.due(cfg.eval.every):
            learner.evaluate()
        if learner.due(cfg.checkpoint.every):
            learner.save_checkpoint(None)  # barriers: every learner writes at this step
    return learner.finish(None)


class Learner:
    """One learner's agent, optimizers, collector and counters, and the steps of its loops."""

    def __init__(self, run: Run) -> None:
        cfg = self.cfg = run.cfg
        self.run = run
        self.index = run.topology.learner_index
        self.learners = len(run.topology.learner_ranks)
        self.label = run.watchdog.label(run.topology.rank)  # names this learner in errors
        self.algo = run.recipe.Config(**OmegaConf.to_container(cfg.algo))

        # Frames (all learners) and updates so far: a resumed run goes on from its checkpoint's.
        self.frames, self.updates = (run.resumed.frames, run.resumed.updates) if run.resumed else (0, 0)
        self.frames_per_step = cfg.collector.frames_per_batch * self.learners
        self.planned_frames = config.planned_frames(cfg, self.learners, self.frames)
        # The last step's frames, all learners: fewer than planned when the straggler
        # threshold cut rollouts short.
        self.step_frames = self.frames_per_step
        # This learner's rollouts in this process: their frames, how many, how many cut,
        # and the sum of the fractions of a full rollout they collected.
        self.collected, self.rollouts, self.rollouts_cut, self.rollout_fractions = 0, 0, 0, 0.0
        if run.recipe.Agent.uses_replay:  # replay's batches dealt out over the learners
            _, self.updates_per_step, self.batch_weight = config.learner_batch(cfg, self.learners, self.index)

        # The same seed on every learner gives identical initial weights (DDP also
        # broadcasts them from the first learner); the environments get their own seeds.
        seed_everything(cfg.seed, verbose=False)
        self.agent = recipes.make_agent(run.recipe, self.algo, cfg.env, cfg.env.num_envs).to(run.device)
        self.optimizers = self.agent.make_optimizers()
        if run.resumed:
            # A learner the checkpoint's run did not have is seeded as its environments are.
            checkpoint.restore_learner(
                run.resumed.folder, self.index, self.agent, self.optimizers, run.device,
                fresh_seed=self.env_seed(),
            )  # fmt: skip
        self.model = self.agent
        averaged = None
        if self.learners > 1 and cfg.cudagraphs:
            # The graph records the bare agent's backward; one all-reduce after it
            # averages the gradients (graphs.py says why not DDP's).
            graphs.broadcast_from_first(self.agent, run.learner_group, run.topology.learner_ranks[0])
            averaged = graphs.AveragedGradients(self.optimizers, run.learner_group, self.learners)
        elif self.learners > 1:
            # Plain DDP over the learner group rather than fabric.setup(): the group's own
            # timeout (learners.timeout) bounds every collective, gradients and checkpoint
            # barriers alike, apart from the RPC timeout.
            self.model = DistributedDataParallel(
                self.agent,
                device_ids=[run.device.index] if run.device.type == "cuda" else None,
                process_group=run.learner_group,
                forward_sync_buffers=False,
            )
        self.compile = bool(cfg.compile)
        self.compiled_paths: set = set()  # the update paths (recipes/__init__.py) compiled so far
        if cfg.compile:
            # The loss compiled, and through AOTAutograd its backward, around DDP as PyTorch
            # compiles DDP models (the all-reduce stays DDP's). The agent itself stays eager:
            # checkpoints keep their keys and the collector acts with the agent's own policy.
            self.model = torch.compile(self.model)
        # cudagraphs=true (a CUDA device, config.check_learners): each update's forward and
        # backward replay as a CUDA graph.
        self.graphs = None
        if cfg.cudagraphs:
            self.graphs = graphs.GraphedGradients(self.model, self.optimizers, run.autocast, averaged)

        # The straggler threshold, where it can cut rollouts (on-policy, several learners).
        self.stragglers = None
        threshold = stragglers.threshold(cfg, self.learners, self.agent.uses_replay)
        if threshold is not None:
            steps = cfg.collector.frames_per_batch // cfg.env.num_envs
            self.stragglers = stragglers.StragglerThreshold(
                run.watchdog.store, self.index, self.learners, steps, *threshold
            )
        # This learner's share of the frames still to collect, and of the recipe's
        # random_frames (all learners) still to come.
        frames = (self.planned_frames - self.frames) // self.learners
        random_frames = math.ceil(
            max(0, getattr(self.algo, "random_frames", 0) - self.frames) / self.learners
        )
        # The sync collector may act with a CPU copy of the policy, refreshed before each
        # batch in ``collect`` (collector.policy_device: by default on a GPU learner).
        policy, device, self.acting = self.agent.policy, run.device, None
        if config.acts_on_cpu(cfg, run.device):
            self.acting = policy = copy.deepcopy(self.agent.policy).cpu()
            device = torch.device("cpu")
        if cfg.collector.workers > 1:
            # A worker steps env.num_envs / workers copies: its policy is made for as many
            # (an exploration module's spec has the copies' shape), on the CPU.
            copies = cfg.env.num_envs // cfg.collector.workers
            policy = recipes.make_agent(run.recipe, self.algo, cfg.env, copies).policy
            policy.load_state_dict(self.agent.policy.state_dict())
        # Starting an async collector's process imports torch anew: allow it more time. A
        # collector resets its envs as it starts: an env's error there is collecting's too.
        with self.collector_deadline(startup=True), collecting(cfg.env.id):
            try:
                if self.stragglers is None:
                    self.collector = make_collector(
                        cfg, policy, self.env_seed(), frames, device, random_frames=random_frames
                    )
                else:  # rollouts of any length: the loop counts the frames
                    chunk = self.stragglers.chunk_steps * cfg.env.num_envs
                    self.collector = make_collector(cfg, policy, self.env_seed(), -1, device, chunk)
            except ProcessDied as status:
                raise CollectorFailed(died(self.label, cfg.env.id, str(status))) from None
        self.batches = iter(self.collector)
        # An async collector's process that dies stops the run at once, not at its deadline.
        run.watchdog.watch("collector", self.collector_death)
        # An async collector acts with its own copy of the policy, refreshed every
        # weight_sync_every updates. Each refresh is a policy version; the lag of a frame
        # is the number of updates made since the version it was collected with.
        self.weight_sync_every = (
            cfg.collector.weight_sync_every if cfg.collector.mode == config.COLLECT_ASYNC else 0
        )
        self.pushed_at = [self.updates]
        self.lags: list[float] = []

        self.reports: list[torch.futures.Future] = []  # rows on their way to rank 0's recorder
        self.saved_at = self.frames
        # Training time, rates and the phases' times start here: the collector's start-up is set-up.
        self.started = time.monotonic()
        self.window = Window()
        timing.reset()

    def collector_death(self) -> str | None:
        """Why this learner's collector process died, as the run's reason; None while it
        runs (or when it is no process)."""
        reason = death(self.collector, self.label, self.cfg.env.id)
        return None if reason is None else f"{self.label} failed: {reason}"

    def env_seed(self) -> int:
        """The seed of this learner's environments from here on. A resumed run starts new
        episodes (environments cannot be saved mid-episode), seeded by the frames so far."""
        return self.cfg.seed + 1000 * self.index + self.frames

    def collect(self) -> TensorDictBase:
        """This learner's next batch ``[env copies, steps]`` (time last): the collector's
        next, or under the straggler threshold a rollout that may be cut short. A collector
        that gives nothing for ``collector.timeout`` seconds stops the run."""
        # Sync workers' shared copy takes the latest weights (async ones', every weight_sync_every).
        if self.cfg.collector.workers > 1 and self.cfg.collector.mode != config.COLLECT_ASYNC:
            with phase("weight_sync"), self.collector_deadline():
                self.collector.update_policy_weights_(self.agent.policy)
        with phase("collect"):
            if self.acting is not None:  # the CPU copy the collector acts with takes the latest weights
                self.acting.load_state_dict(self.agent.policy.state_dict())
            with self.collector_deadline():
                if self.stragglers is None:
                    return next_batch(self.collector, self.batches, self.label, self.cfg.env.id)
                # A store that stops answering in rollout is rank 0's death: the watchdog names it.
                return self.stragglers.rollout(
                    lambda: next_batch(self.collector, self.batches, self.label, self.cfg.env.id)
                )

    @timed("agree")
    def stop_agreed(self) -> bool:
        """Whether any learner was asked to stop (SIGINT, SIGTERM, SIGUSR1): one all-reduce,
        so that all learners get the same answer at the same step."""
        stop = self.run.watchdog.stop
        if self.learners == 1:
            return stop.is_set()
        raised = torch.tensor([float(stop.is_set())], device=self.run.device)
        dist.all_reduce(raised, op=dist.ReduceOp.MAX, group=self.run.learner_group)
        agreed = bool(raised.item())
        if agreed:
            self.run.watchdog.take_up_stop()  # another learner's signal, maybe not yet heard here
        return agreed

    @timed("agree")
    def rollout_sizes(self, batch: TensorDictBase) -> list[int]:
        """Every learner's frames in this step's rollout, in learner order: one all-reduce
        where the straggler threshold can cut rollouts; otherwise all are full."""
        if self.stragglers is None:
            return [self.cfg.collector.frames_per_batch] * self.learners
        return stragglers.sizes_of_all(
            batch.numel(), self.index, self.learners, self.run.learner_group, self.run.device
        )

    @timed("shuffle")
    def shuffled(
        self, samples: TensorDictBase, plan: list[tuple[int, float]]
    ) -> list[tuple[TensorDictBase, float]]:
        """One epoch's minibatches of this learner's rollout, shuffled: ``plan`` gives each
        one's frames (or env copies' sequences) and loss weight (``stragglers.minibatches``,
        ``stragglers.sequence_minibatches``)."""
        sizes, weights = zip(*plan, strict=True)
        shuffled = samples[torch.randperm(len(samples))]
        return list(zip(shuffled.split(list(sizes)), weights, strict=True))

    def sum_over_learners(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over all learners, in place (an all-reduce): for statistics a
        recipe keeps the same on every learner, such as PPO's observation normalisation."""
        if self.learners > 1:
            dist.all_reduce(values, group=self.run.learner_group)
        return values

    def count(self, batch: TensorDictBase, step_frames: int) -> None:
        """Count a step of ``step_frames`` (all learners): this learner's rollout, the
        returns of its finished episodes, and how old the weights that collected it were."""
        self.step_frames = step_frames
        self.frames += step_frames
        fraction = batch.numel() / self.cfg.collector.frames_per_batch
        self.collected += batch.numel()
        self.rollouts += 1
        self.rollouts_cut += fraction < 1
        self.rollout_fractions += fraction
        self.window.add_episodes(batch)
        if POLICY_VERSION in batch.keys():
            versions = batch[POLICY_VERSION].flatten()
            self.lags.append(self.updates - float(torch.tensor(self.pushed_at)[versions].float().mean()))

    def update(self, batch: TensorDictBase, weight: float = 1.0) -> torch.Tensor | None:
        """One gradient step: the recipe's loss, ``backward`` (with DDP it all-reduces the
        gradients over the learners), then the recipe's ``optimizer_step``. ``weight``
        scales this learner's loss in that average, for batches of different sizes
        (on-policy: ``stragglers.minibatches``; replay: ``config.learner_batch``). Returns
        the new priorities on the CPU (replay recipes), or None.
        """
        self.updates += 1
        # With compile=true the loss compiles at the first update of each update path
        # (TD3: with and without the actor's loss): phase "compile".
        path = recipes.update_path(self.agent, self.updates)
        compiling = self.compile and path not in self.compiled_paths
        self.compiled_paths.add(path)
        if self.graphs is not None:
            # Forward and backward, replayed as one CUDA graph; the all-reduce after it.
            with phase("compile" if compiling else "graph"):
                loss, priorities, metrics = self.graphs(batch, weight, path)
                priorities = checked_priorities(loss, priorities, self.where())
        else:
            first = "compile" if compiling else None
            with phase(first or "forward"), self.run.autocast():
                loss, priorities, metrics = self.model(batch)
                priorities = checked_priorities(loss, priorities, self.where())
            with phase(first or "backward"):  # with DDP, the gradients' all-reduce too
                for optimizer in self.optimizers.values():
                    optimizer.zero_grad(set_to_none=True)
                (loss * weight).backward()
        with phase("optimizer"):
            self.agent.optimizer_step(self.optimizers, self.updates)  # the recipe's: optimizers, targets
        self.window.add_metrics(metrics)
        if self.weight_sync_every and self.updates % self.weight_sync_every == 0:
            # The collector's process acknowledges the copy.
            with phase("weight_sync"), self.collector_deadline():
                self.collector.update_policy_weights_(self.agent.policy)
            self.pushed_at.append(self.updates)
        return priorities

    def collector_deadline(self, startup: bool = False) -> AbstractContextManager:
        """Stop the run if the collector keeps this learner waiting for ``collector.timeout``
        seconds (four times that to start)."""
        timeout = self.cfg.collector.timeout * (4 if startup else 1)
        return self.run.watchdog.deadline(f"the collector of {self.label}", timeout)

    def where(self) -> str:
        return f"frame {self.frames}, update {self.updates}"

    def due(self, every: int) -> bool:
        """Whether the last step passed a multiple of ``every`` frames (the same on all learners)."""
        return every > 0 and self.frames // every > (self.frames - self.step_frames) // every

    @timed("report")
    def report(self) -> None:
        """Send this learner's metrics since the last report to rank 0's recorder."""
        row = self.window.flush(timing.take())
        self.reports.append(self.run.recorder.rpc_async().report(self.frames, row))

    @timed("evaluate")
    def evaluate(self) -> None:
        """Play greedy episodes and report their mean return."""
        returns = {"eval_return": mean(self.greedy_returns())}
        self.reports.append(self.run.recorder.rpc_async().report(self.frames, returns))

    def greedy_returns(self) -> list[float]:
        """Each learner plays its share of the evaluation episodes (rounded up), on its own
        seeds; none with eval.episodes=0."""
        cfg = self.cfg
        if not cfg.eval.episodes:
            return []
        episodes = math.ceil(cfg.eval.episodes / self.learners)
        seed = cfg.seed + 1_000_000 + 1000 * self.index
        return evaluate(self.agent.policy, cfg.env, episodes, seed, self.run.device)

    @timed("checkpoint")
    def save_checkpoint(self, replay: ReplayClient | None) -> None:
        """Write a training checkpoint; every learner calls this at the same step."""
        cfg = self.cfg
        torch.futures.wait_all(self.reports)  # the rows reported so far belong with it: rank 0 has them
        shards = []
        if replay is not None:
            replay.flush()  # this learner's writes are in the shards
            shards = replay.shards
        meta = checkpoint.Meta.of_run(cfg, self.frames, self.updates, self.learners, len(shards))
        checkpoint.save(cfg, meta, self.index, self.agent, self.optimizers, shards, self.barrier)
        self.saved_at = self.frames

    def barrier(self) -> None:
        """Wait for all learners (an all-reduce: gloo and NCCL both have it). Reading the
        result makes the CPU wait too: NCCL's all-reduce only queues work on the GPU, and a
        learner must not go on to read files the others are still writing."""
        if self.learners > 1:
            done = torch.zeros(1, device=self.run.device)
            dist.all_reduce(done, group=self.run.learner_group)
            done.item()

    def finish(self, replay: ReplayClient | None) -> dict[str, Any]:
        """Checkpoint a stopped run, close the collector, wait for every report, and return
        this learner's statistics for the summary, with the final evaluation's returns
        unless the run was stopped."""
        cfg, stop = self.cfg, self.run.watchdog.stop
        # Stopped early (SIGINT, SIGTERM, SIGUSR1), whatever checkpoint.every says: the run
        # can go on from here. A dead peer is no stop: the watchdog ends this process first.
        if stop.is_set() and self.saved_at != self.frames:
            self.save_checkpoint(replay)
        if self.window.frames:  # the frames since the last row: a run shorter than log_every gets one too
            self.report()
        train_s, phases = time.monotonic() - self.started, timing.totals()
        self.run.watchdog.unwatch("collector")
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
            "phase_seconds": phases,  # where train_s went (timing.py)
            "inserted": replay.inserted if replay is not None else 0,
            "sampled": replay.sampled if replay is not None else 0,
            "policy_lag": mean(self.lags) if self.lags else 0.0,
            # Weights and running statistics (buffers): the same on every learner.
            "param_checksum": sum(
                value.double().sum()
                for value in self.agent.state_dict().values()
                if value.is_floating_point()
            ).item(),
            # No final evaluation after a stop: a stop ends the run in seconds (`fabric run`
            # gives its ranks 30), where greedy episodes can take minutes (an Atari game to
            # its frame cap).
            "eval_returns": [] if stop.is_set() else self.greedy_returns(),
        }
        if self.index == 0:  # the learners' weights are identical: one of them saves
            path = checkpoint.save_agent(Path(cfg.run_dir) / checkpoint.FINAL, cfg, self.agent)
            stats["checkpoint"] = str(path)
        return stats


def checked_priorities(
    loss: torch.Tensor, priorities: torch.Tensor | None, where: str
) -> torch.Tensor | None:
    """``priorities`` on the CPU, once they and ``loss`` are found finite; NonFinite names
    ``where`` otherwise. Checked before the optimizers step, so the weights stay finite; a
    non-finite priority would poison the sum tree every later sample is drawn from.

    The loss and the priorities come to the CPU in one copy: on a GPU each copy waits for
    the work queued before it, so this is the update's one synchronisation.
    """
    # float32: under bf16-mixed precision the priorities may come in bfloat16.
    flat = (
        loss.new_empty(0, dtype=torch.float32)
        if priorities is None
        else priorities.detach().reshape(-1).float()
    )
    checked = torch.cat([loss.detach().reshape(1).float(), flat]).cpu()
    if not torch.isfinite(checked[0]):
        raise NonFinite(f"non-finite loss ({checked[0].item()}) at {where}")
    if not torch.isfinite(checked[1:]).all():
        raise NonFinite(f"non-finite priorities at {where}")
    return None if priorities is None else checked[1:]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


class NonFinite(FloatingPointError):
    """A loss or priority that is NaN or infinite; training cannot go on from it."""
