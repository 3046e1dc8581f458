"""Prioritized replay: a shard that lives on a replay rank, and the learners' client for it.

One ``TensorDictPrioritizedReplayBuffer`` owns the writer cursor and the sum tree, so every
learner writes through it over RPC and no cursor is shared between processes (the failure
of worker-local buffers on shared storage, where each cursor overwrites the others).
"""

from __future__ import annotations

import collections
import threading

import torch
from tensordict import TensorDictBase
from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer

GENERATION = "generation"


class ReplayShard:
    """A prioritized buffer served to learners; RPC calls arrive on several threads."""

    def __init__(self, capacity: int, alpha: float, beta: float, batch_size: int, priority_key: str):
        self.buffer = TensorDictPrioritizedReplayBuffer(
            alpha=alpha,
            beta=beta,
            storage=LazyTensorStorage(capacity),
            batch_size=batch_size,
            priority_key=priority_key,
        )
        # How often each slot has been written. A priority computed for a transition that
        # has since been overwritten belongs to the old occupant: it is dropped.
        self.generation = torch.zeros(capacity, dtype=torch.long)
        self.inserted = 0
        self.stale_updates = 0
        self._lock = threading.Lock()

    def extend(self, transitions: TensorDictBase) -> None:
        with self._lock:
            index = self.buffer.extend(transitions)
            self.generation[index] += 1
            self.inserted += transitions.numel()

    def sample(self) -> TensorDictBase:
        with self._lock:
            batch = self.buffer.sample()
            batch[GENERATION] = self.generation[batch["index"]]
            return batch

    def update_priority(self, priorities: TensorDictBase) -> None:
        """``priorities`` holds ``index``, ``generation`` and the priority key of a sample."""
        with self._lock:
            current = self.generation[priorities["index"]] == priorities[GENERATION]
            self.stale_updates += int((~current).sum())
            if current.any():
                self.buffer.update_tensordict_priority(priorities[current])

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"size": len(self.buffer), "inserted": self.inserted, "stale_updates": self.stale_updates}


class ReplayClient:
    """A learner's view of the replay shard: writes are asynchronous, samples prefetched.

    Futures are awaited in order (at most ``max_in_flight`` outstanding), so an error on
    the replay rank surfaces on the learner at the next call instead of vanishing.
    """

    def __init__(self, shard, max_in_flight: int = 8) -> None:
        self.shard = shard
        self.max_in_flight = max_in_flight
        self._writes: collections.deque[torch.futures.Future] = collections.deque()
        self._next_sample: torch.futures.Future | None = None

    def extend(self, transitions: TensorDictBase) -> None:
        self._track(self.shard.rpc_async().extend(transitions))

    def update_priority(self, batch: TensorDictBase, priority_key: str) -> None:
        """Send the new priorities of a sampled ``batch`` (the loss wrote them in place)."""
        priorities = batch.select("index", GENERATION, priority_key).cpu()
        self._track(self.shard.rpc_async().update_priority(priorities))

    def sample(self, prefetch: bool = True) -> TensorDictBase:
        """The next batch; with ``prefetch`` the one after it is requested right away."""
        future = self._next_sample or self.shard.rpc_async().sample()
        self._next_sample = self.shard.rpc_async().sample() if prefetch else None
        return future.wait()

    def flush(self) -> None:
        """Wait for every outstanding write and drop a prefetched batch."""
        while self._writes:
            self._writes.popleft().wait()
        if self._next_sample is not None:
            self._next_sample.wait()
            self._next_sample = None

    def _track(self, future: torch.futures.Future) -> None:
        self._writes.append(future)
        while len(self._writes) > self.max_in_flight:
            self._writes.popleft().wait()
