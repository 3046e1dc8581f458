"""DD-PPO's straggler threshold: a slow learner no longer holds the others back.

On-policy learners train together on what they just collected, so in lockstep each would
wait for the slowest one's rollout. Wijmans et al. (2020), who call it the preemption
threshold, stop collection for everyone once a fraction of the learners
(``collector.sync_frac``) have collected a full rollout; the others keep what they have,
provided it is at least ``collector.min_rollout_frac`` of a rollout, and everyone trains.

The count of finished rollouts lives in the run's key-value store (the watchdog's
``TCPStore`` on rank 0; the paper uses a TCPStore counter too). A learner that finishes
adds one to its step's key; a learner still collecting reads the key between chunks of its
rollout (``add(key, 0)``: one round trip, no wait). No learner ever waits on the counter:
it only decides whether to collect the next chunk. A learner that dies leaves the others
collecting full rollouts and then waiting in the next collective, where the watchdog ends
the run; a store that is gone raises, and the watchdog ends the run too.

torchrl's ``Collector`` yields batches of one fixed size, so a rollout is collected as
consecutive chunks of a few time steps, concatenated along time. The collector carries its
environments over from one chunk to the next, so a cut rollout is an ordinary, shorter
rollout: GAE bootstraps from the value of its last step's next state, as it does at the
end of any rollout.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from tensordict import TensorDictBase

KEY = "rollouts_done"
# Chunks per full rollout, about: how often a learner reads the counter. More chunks stop a
# straggler sooner, at the cost of one more collector batch and one store round trip each.
CHUNKS = 8


class StragglerThreshold:
    """One learner's side of the threshold: cuts its rollouts and counts what it collected."""

    def __init__(
        self,
        store: dist.Store,
        learner_index: int,
        learners: int,
        rollout_steps: int,
        sync_frac: float,
        min_rollout_frac: float,
    ) -> None:
        self.store = store
        self.index = learner_index
        # The rounding guards against 0.7 * 10 = 7.000000000000001 asking for 8 learners.
        self.needed = math.ceil(round(sync_frac * learners, 9))
        self.chunk_steps = chunk_steps(rollout_steps)
        self.full_chunks = rollout_steps // self.chunk_steps
        self.min_chunks = max(1, math.ceil(round(min_rollout_frac * self.full_chunks, 9)))
        self.step = 0

    def rollout(self, next_chunk: Callable[[], TensorDictBase]) -> TensorDictBase:
        """The next rollout ``[num_envs, steps]``, full or cut, of the collector's chunks
        (``next_chunk()`` gives the next one).

        Every learner collects the same number of rollouts, so step ``n`` has its own key.
        The learners run a collective after each rollout, so once the first learner starts
        step ``n + 1`` none reads step ``n - 1``'s key any more: it deletes it.
        """
        step, self.step = self.step, self.step + 1
        if self.index == 0 and step >= 2:
            self.store.delete_key(f"{KEY}/{step - 2}")
        key = f"{KEY}/{step}"
        collected = [next_chunk()]
        while len(collected) < self.full_chunks:
            if len(collected) >= self.min_chunks and self.store.add(key, 0) >= self.needed:
                return torch.cat(collected, dim=-1)
            collected.append(next_chunk())
        self.store.add(key, 1)
        return torch.cat(collected, dim=-1)


def chunk_steps(rollout_steps: int) -> int:
    """Time steps per chunk: the largest divisor of the rollout's steps that is at most
    ``1 / CHUNKS`` of it, so that whole chunks make a full rollout."""
    most = max(1, rollout_steps // CHUNKS)
    return max(steps for steps in range(1, most + 1) if rollout_steps % steps == 0)


def threshold(cfg: DictConfig, learners: int, uses_replay: bool) -> tuple[float, float] | None:
    """``(sync_frac, min_rollout_frac)`` when the threshold can cut a rollout in this run:
    on-policy learners, more than one, and fewer needed to finish than there are learners."""
    sync_frac = cfg.collector.sync_frac
    if uses_replay or learners == 1 or math.ceil(round(sync_frac * learners, 9)) >= learners:
        return None
    return sync_frac, cfg.collector.min_rollout_frac


def sizes_of_all(size: int, index: int, learners: int, group: Any, device: torch.device) -> list[int]:
    """Every learner's rollout size, in learner order (one all-reduce over the learners)."""
    sizes = torch.zeros(learners, dtype=torch.long, device=device)
    sizes[index] = size
    dist.all_reduce(sizes, group=group)
    return sizes.tolist()


def minibatches(sizes: list[int], index: int, minibatch_size: int) -> list[tuple[int, float]]:
    """This learner's minibatches for one epoch: ``(frames, loss weight)`` each.

    Every learner runs the same number of minibatches (so DDP's all-reduces pair up): as
    many as give about ``minibatch_size`` frames per learner on average, and no more than the
    smallest rollout has frames. Each learner splits its rollout into that many near-equal
    parts, so the j-th minibatches of all learners together form one minibatch of
    ``total_j`` frames. DDP averages the learners' gradients with equal weights; a learner
    whose part holds ``own_j`` frames scales its (per-frame mean) loss by
    ``learners * own_j / total_j``, so that the average is the gradient of the mean loss over
    all ``total_j`` frames, each frame counting once, whoever collected it. With equal
    rollouts every weight is exactly 1: the updates of a run without cuts.

    PPO's loss normalises the advantages per learner's minibatch, as it did before
    rollouts could differ; a cut learner's smaller parts normalise over fewer frames.
    """
    learners = len(sizes)
    count = max(1, min(min(sizes), math.ceil(sum(sizes) / (learners * minibatch_size))))
    parts = [[size // count + (j < size % count) for j in range(count)] for size in sizes]
    totals = [sum(column) for column in zip(*parts, strict=True)]
    return [(own, learners * own / total) for own, total in zip(parts[index], totals, strict=True)]


def sequence_minibatches(
    sizes: list[int], index: int, copies: int, minibatch_size: int
) -> list[tuple[int, float]]:
    """This recurrent learner's minibatches for one epoch: ``(env copies, loss weight)``
    each, a copy's whole sequence of the rollout going to one minibatch.

    As ``minibatches``, with copies in place of frames: every learner has ``copies``
    sequences, as long as its rollout (``sizes[i] / copies`` steps, cut or not), and splits
    them into the same number of near-equal parts, about ``minibatch_size`` frames per
    learner on average and at least one copy each. The j-th parts of all learners hold the
    same number of copies, so a learner's share of the j-th minibatch's frames, and its
    weight, is its rollout's share of all the learners' frames.
    """
    learners = len(sizes)
    count = max(1, min(copies, math.ceil(sum(sizes) / (learners * minibatch_size))))
    weight = learners * sizes[index] / sum(sizes)
    return [(copies // count + (j < copies % count), weight) for j in range(count)]
