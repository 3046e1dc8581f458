"""Prioritized replay: shards that live on replay ranks, and the learners' client for them.

Each shard is one ``TensorDictPrioritizedReplayBuffer`` that owns its writer cursor and sum
tree, so learners write through it over RPC and no cursor is shared between processes (the
failure of worker-local buffers on shared storage, where each cursor overwrites the
others). With several shards (as in Ape-X) each learner spreads its writes round-robin,
and every batch is drawn across the shards in proportion to their total priority, with
importance weights normalised over all shards: it is distributed like a batch from one
buffer holding everything.
"""

from __future__ import annotations

import collections
import math
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from tensordict import TensorDictBase
from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer

GENERATION = "generation"
SHARD = "shard"
WEIGHT = "priority_weight"


class ReplayShard:
    """One prioritized buffer served to learners; RPC calls arrive on several threads."""

    def __init__(self, capacity: int, alpha: float, beta: float, priority_key: str, shard: int = 0):
        self.buffer = TensorDictPrioritizedReplayBuffer(
            alpha=alpha, beta=beta, storage=LazyTensorStorage(capacity), priority_key=priority_key
        )
        self.shard = shard
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

    def sample(self, count: int) -> tuple[TensorDictBase | None, float, float]:
        """``count`` transitions drawn by priority (none for 0), and this shard's priority
        mass: the sum and the minimum of its priorities, as the weights were computed."""
        with self._lock:
            batch = None
            if count > 0:
                batch = self.buffer.sample(count)
                batch[GENERATION] = self.generation[batch["index"]]
                batch[SHARD] = torch.full((count,), self.shard)
            return batch, *self._mass()

    def update_priority(self, priorities: TensorDictBase) -> None:
        """``priorities`` holds ``index``, ``generation`` and the priority key of a sample."""
        if not torch.isfinite(priorities[self.buffer.priority_key]).all():
            # One NaN in the sum tree and every later sample is garbage: refuse, loudly.
            raise ValueError(f"shard {self.shard}: refusing non-finite priorities")
        with self._lock:
            current = self.generation[priorities["index"]] == priorities[GENERATION]
            self.stale_updates += int((~current).sum())
            if current.any():
                self.buffer.update_tensordict_priority(priorities[current])

    def save(self, folder: str) -> None:
        """Write the contents, priorities and write counts to ``folder`` (a checkpoint)."""
        with self._lock:
            self.buffer.dumps(folder)
            counts = {
                "generation": self.generation,
                "inserted": self.inserted,
                "stale_updates": self.stale_updates,
            }
            torch.save(counts, Path(folder) / "shard.pt")

    def load(self, folder: str) -> None:
        with self._lock:
            self.buffer.loads(folder)
            counts = torch.load(Path(folder) / "shard.pt", weights_only=True)
            self.generation = counts["generation"]
            self.inserted, self.stale_updates = counts["inserted"], counts["stale_updates"]

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"size": len(self.buffer), "inserted": self.inserted, "stale_updates": self.stale_updates}

    def _mass(self) -> tuple[float, float]:
        # torchrl keeps the sum and the minimum of the (transformed) priorities in its
        # sampler's segment trees and has no public accessor for them; sampling across
        # shards needs both. tests/test_replay.py fails loudly if torchrl changes this.
        size = len(self.buffer)
        if size == 0:
            return 0.0, math.inf
        sampler = self.buffer.sampler
        return float(sampler._sum_tree.query(0, size)), float(sampler._min_tree.query(0, size))


class ReplayClient:
    """A learner's view of the replay shards: writes are asynchronous, samples prefetched.

    One request fetches ``batches_per_request`` batches, and the next request is sent as
    soon as one arrives, so the learner trains while the network works; priorities go
    back in one call per request. Futures are awaited in order (at most ``max_in_flight``
    outstanding writes), so an error on a replay rank surfaces on the learner at the next
    call instead of vanishing.
    """

    def __init__(
        self,
        shards: Sequence,
        batch_size: int,
        beta: float,
        batches_per_request: int = 1,
        first_shard: int = 0,
        max_in_flight: int = 8,
    ) -> None:
        self.shards = list(shards)
        self.batch_size = batch_size
        self.beta = beta
        self.batches_per_request = batches_per_request
        self.max_in_flight = max_in_flight
        self._next_shard = first_shard % len(self.shards)
        self._writes: collections.deque[torch.futures.Future] = collections.deque()
        self._priorities: list[TensorDictBase] = []
        self._batches: collections.deque[TensorDictBase] = collections.deque()
        self._next_request: list[torch.futures.Future] | None = None
        self._mass_sum = torch.zeros(len(self.shards), dtype=torch.float64)
        self._mass_min = torch.full((len(self.shards),), math.inf, dtype=torch.float64)

    def extend(self, transitions: TensorDictBase) -> None:
        """Write to the shards in turn (starting from ``first_shard``), asynchronously."""
        shard = self.shards[self._next_shard]
        self._next_shard = (self._next_shard + 1) % len(self.shards)
        self._track(shard.rpc_async().extend(transitions))

    def sample(self, prefetch: bool = True) -> TensorDictBase:
        """The next batch; with ``prefetch`` the next request goes out as a request arrives."""
        if not self._batches:
            request = self._next_request or self._request()
            self._next_request = None
            self._batches.extend(self._receive(request))
            if prefetch:
                self._next_request = self._request()
        return self._batches.popleft()

    def update_priority(self, batch: TensorDictBase, priority_key: str) -> None:
        """Send the new priorities of a sampled ``batch`` (the loss wrote them in place)."""
        self._priorities.append(batch.select("index", GENERATION, SHARD, priority_key).cpu())
        if len(self._priorities) >= self.batches_per_request:
            self._send_priorities()

    def flush(self) -> None:
        """Send pending priorities, wait for every write, and drop prefetched batches, so
        the next sample sees everything written so far."""
        self._send_priorities()
        while self._writes:
            self._writes.popleft().wait()
        if self._next_request is not None:
            torch.futures.wait_all(self._next_request)
            self._next_request = None
        self._batches.clear()
        if len(self.shards) > 1:
            self._receive(self._ask([0] * len(self.shards)))  # the shards' masses as of now

    def _request(self) -> list[torch.futures.Future]:
        """Ask every shard for its share of the next ``batches_per_request`` batches.

        Shares are drawn from a multinomial over the shards' priority mass as of their last
        reply; a shard with no share still replies with its mass, so it stays current.
        """
        total = self.batch_size * self.batches_per_request
        if len(self.shards) == 1:
            counts = [total]
        else:
            if self._mass_sum.sum() <= 0:
                self._receive(self._ask([0] * len(self.shards)))  # the first request: learn the masses
            if self._mass_sum.sum() <= 0:
                raise RuntimeError("every replay shard is empty: nothing to sample")
            counts = torch.distributions.Multinomial(total, self._mass_sum).sample().long().tolist()
        return self._ask(counts)

    def _ask(self, counts: list[int]) -> list[torch.futures.Future]:
        return [shard.rpc_async().sample(count) for shard, count in zip(self.shards, counts, strict=True)]

    def _receive(self, request: list[torch.futures.Future]) -> list[TensorDictBase]:
        replies = [future.wait() for future in request]
        for shard, (_, total, lowest) in enumerate(replies):
            self._mass_sum[shard], self._mass_min[shard] = total, lowest
        global_min = float(self._mass_min.min())
        parts = []
        for batch, _, lowest in replies:
            if batch is None:
                continue
            if lowest != global_min:
                # torchrl normalised the weights by this shard's smallest priority,
                # (p / p_min_shard) ** -beta; one buffer would use the smallest of all.
                batch[WEIGHT] = batch[WEIGHT] * (lowest / global_min) ** -self.beta
            parts.append(batch)
        if not parts:
            return []
        if len(parts) == 1:
            return list(parts[0].split(self.batch_size))
        # Shuffled, the shards' shares make independent draws from the whole mixture.
        chunk = torch.cat(parts)
        return list(chunk[torch.randperm(chunk.numel())].split(self.batch_size))

    def _send_priorities(self) -> None:
        if not self._priorities:
            return
        priorities = torch.cat(self._priorities)
        self._priorities.clear()
        if len(self.shards) == 1:
            self._track(self.shards[0].rpc_async().update_priority(priorities))
            return
        for shard, ref in enumerate(self.shards):
            rows = priorities[SHARD] == shard
            if rows.any():
                self._track(ref.rpc_async().update_priority(priorities[rows]))

    def _track(self, future: torch.futures.Future) -> None:
        self._writes.append(future)
        while len(self._writes) > self.max_in_flight:
            self._writes.popleft().wait()
