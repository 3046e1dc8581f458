"""The two reads of torchrl's prioritized sampler that it has no public accessor for.

``PrioritizedSampler`` keeps each transition's priority, transformed as
``(priority + EPS) ** alpha``, in a sum tree and a min tree (C++ segment trees), and
exposes neither their totals nor a stored priority. This project needs both:

- drawing a batch across shards needs each shard's priority mass, the sum and the minimum
  of its priorities (``mass``): a shard's share of the batch follows its sum, and the
  importance weights are normalised by the smallest priority of all shards;
- dealing a checkpoint's replay onto another number of shards needs each transition's
  priority (``stored_priorities``).

Both read the sampler's private ``_sum_tree`` and ``_min_tree`` here and nowhere else;
tests/test_replay.py and tests/test_elastic.py fail loudly if torchrl changes them.
"""

from __future__ import annotations

import math

import torch
from torchrl.data import TensorDictPrioritizedReplayBuffer

# Added to every priority before the exponent: torchrl's default, named here because
# ``stored_priorities`` takes it off again.
EPS = 1e-8


def mass(buffer: TensorDictPrioritizedReplayBuffer) -> tuple[float, float]:
    """The sum and the minimum of the (transformed) priorities in ``buffer``."""
    size = len(buffer)
    if size == 0:
        return 0.0, math.inf
    sampler = buffer.sampler
    return float(sampler._sum_tree.query(0, size)), float(sampler._min_tree.query(0, size))


def stored_priorities(buffer: TensorDictPrioritizedReplayBuffer, slots: torch.Tensor) -> torch.Tensor:
    """The priorities of ``slots``, as they were given to ``update_priority``."""
    alpha = buffer.sampler.alpha
    if alpha == 0:  # every priority counts the same: any value restores it
        return torch.ones(len(slots))
    return (buffer.sampler._sum_tree[slots].double() ** (1 / alpha) - EPS).clamp(min=0).float()
