"""One shard of the replay buffer, served over RPC from a replay process.

Each shard is one ``TensorDictPrioritizedReplayBuffer`` that owns its writer cursor and sum
tree (a ``TensorDictReplayBuffer`` drawing uniformly, with ``alpha`` 0), so learners write
through it over RPC and no cursor is shared between processes (the failure of
worker-local buffers on shared storage, where each cursor overwrites the others). Stacked
pixel observations are stored frame by frame, and sequences of pixel observations step by
step (frames.py); a checkpoint's shards resume on another number of shards, or with
another ``alpha`` (resharding.py).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from pathlib import Path

import torch
from tensordict import TensorDictBase
from torchrl.data import (
    LazyMemmapStorage,
    LazyTensorStorage,
    RandomSampler,
    TensorDictPrioritizedReplayBuffer,
    TensorDictReplayBuffer,
)
from torchrl.data.replay_buffers import Storage

from .frames import FRAMES, LOST, PIXELS, POSITION, FrameStore
from .resharding import Dealer, SavedShard
from .sampler_trees import EPS, mass

log = logging.getLogger(__name__)
GENERATION = "generation"
SHARD = "shard"
WEIGHT = "priority_weight"  # the importance weight of a sampled transition (torchrl's key)
PRIORITY = "priority"  # a transition's new priority, as a learner sends it back
MEMORY, MEMMAP = "memory", "memmap"  # replay.storage
# A sampled transition whose frames were overwritten is drawn again, this many times at most.
REDRAWS = 20
# Where a learner's reply slots live: memory, not disk, on Linux.
SHARED_MEMORY = Path("/dev/shm")


def make_storage(kind: str, capacity: int, directory: str | Path | None) -> Storage:
    """torchrl's storage for ``capacity`` items: in memory, or memory-mapped files in
    ``directory``, which the process removes when it exits (they are scratch space; a
    checkpoint copies what it keeps)."""
    if kind == MEMMAP:
        return LazyMemmapStorage(capacity, scratch_dir=directory, existsok=True, auto_cleanup=True)
    return LazyTensorStorage(capacity)


class ReplayShard:
    """One buffer served to learners, prioritized unless ``alpha`` is 0; RPC calls arrive
    on several threads."""

    def __init__(
        self,
        capacity: int,
        alpha: float,
        beta: float,
        shard: int = 0,
        storage: str = MEMORY,
        directory: str | Path | None = None,
    ) -> None:
        folder = Path(directory) if directory is not None else None
        transitions = make_storage(storage, capacity, folder and folder / "transitions")
        self.alpha = alpha
        self.prioritized = alpha > 0
        if self.prioritized:
            self.buffer = TensorDictPrioritizedReplayBuffer(
                alpha=alpha, beta=beta, eps=EPS, storage=transitions, priority_key=PRIORITY
            )
        else:
            # Priorities to the power 0 are all 1: the sum tree would draw uniformly, at a
            # price (TD3 on Hopper: 0.37 + 0.35 ms an update for sampling and sending the
            # priorities back, docs/benchmarks.md, "TD3 over 100,000 steps"). torchrl's
            # RandomSampler draws alike with no tree to keep, and the learners send no
            # priorities (ReplayClient's ``prioritized``).
            self.buffer = TensorDictReplayBuffer(storage=transitions, sampler=RandomSampler())
        # Allocated at the first write of pixels (extend_frames, extend_sequences). As many
        # frames as items times the frames an item adds to its stream (``frame_shift``): a
        # transition's stacks add a frame per step, plus a reset stack per episode, so the
        # oldest transitions of a full shard (4 / episode length of them) have lost a frame;
        # a sequence adds the steps it does not share with the one before. Sampling draws
        # items that lost a frame again.
        self.frame_shift = 1
        self.frames = FrameStore(capacity, folder / "frames.memmap" if storage == MEMMAP and folder else None)
        # Stream -> the stamps its next item may go on from: its newest stack (transitions),
        # or its last sequence's last ``overlap`` steps (sequences).
        self.tails: dict[str, torch.Tensor] = {}
        self.shard = shard
        # How often each slot has been written. A priority computed for a transition that
        # has since been overwritten belongs to the old occupant: it is dropped.
        self.generation = torch.zeros(capacity, dtype=torch.long)
        self.inserted = 0
        self.stale_updates = 0
        self.readers: dict[str, list[torch.Tensor]] = {}  # a learner's name -> its reply slots
        self._lock = threading.Lock()

    def extend(self, transitions: TensorDictBase) -> None:
        with self._lock:
            index = self.buffer.extend(transitions)
            self.generation[index] += 1
            self.inserted += transitions.numel()

    def extend_frames(
        self, rows: TensorDictBase, frames: torch.Tensor, counts: torch.Tensor, streams: list[str], depth: int
    ) -> None:
        """Store what ``pack`` made of a batch: ``rows`` ``[streams, steps]`` with each
        transition's ``POSITION`` in its stream, the streams' new ``frames`` one after the
        other (``counts`` of them per stream), the streams' names, and the stack's depth."""
        with self._lock:
            first = self.frames.write(frames)
            offsets = torch.cumsum(counts, 0) - counts
            missing = torch.full((depth,), -1, dtype=torch.long)
            tails = torch.stack([self.tails.get(name, missing) for name in streams])
            # Positions 0..depth-1 are the stream's newest stack so far, then its new frames.
            position = rows[POSITION].unsqueeze(-1) + torch.arange(depth + 1)
            new = first + offsets.view(-1, 1, 1) + position - depth
            old = tails.gather(1, position.clamp(max=depth - 1).flatten(1)).view_as(position)
            stamps = torch.where(position >= depth, new, old)
            if (stamps < 0).any():
                raise RuntimeError(f"shard {self.shard}: a stream goes on from frames this shard never got")
            for name, stream in zip(streams, stamps, strict=True):
                self.tails[name] = stream[-1, 1:].clone()
            transitions = rows.exclude(POSITION).reshape(-1)
            transitions[FRAMES] = stamps.reshape(-1, depth + 1)
            index = self.buffer.extend(transitions)
            self.generation[index] += 1
            self.inserted += transitions.numel()

    def extend_sequences(
        self,
        rows: TensorDictBase,
        frames: torch.Tensor,
        linked: torch.Tensor,
        streams: list[str],
        length: int,
        overlap: int,
    ) -> None:
        """Store sequences of ``length`` steps of pixel observations, each step's once:
        ``rows`` ``[sequences]`` without their observations, each stream's in order; the
        new observations, one after the other; per row, whether it is ``linked`` (it starts
        with the last ``overlap`` observations of its stream's previous sequence, and
        brings only the rest); and each row's stream."""
        with self._lock:
            self._frames_per_item(length - overlap)
            first = self.frames.write(frames)
            counts = torch.where(linked, length - overlap, length)
            starts = first + torch.cumsum(counts, 0) - counts
            stamps = torch.empty(len(rows), length, dtype=torch.long)
            for row, (name, goes_on) in enumerate(zip(streams, linked.tolist(), strict=True)):
                shared = overlap if goes_on else 0
                if goes_on and name not in self.tails:
                    raise RuntimeError(f"shard {self.shard}: a stream goes on from frames it never got")
                if shared:
                    stamps[row, :shared] = self.tails[name]
                stamps[row, shared:] = torch.arange(int(starts[row]), int(starts[row]) + length - shared)
                self.tails[name] = stamps[row, length - overlap :].clone()
            rows[FRAMES] = stamps
            index = self.buffer.extend(rows)
            self.generation[index] += 1
            self.inserted += len(rows)

    def _frames_per_item(self, shift: int) -> None:
        """Make the frame store hold ``shift`` frames per item (``frame_shift``), for items
        that each add ``shift`` frames to their stream; only before any frame is stored."""
        if shift == self.frame_shift:
            return
        if self.frames.written:
            before = self.frame_shift
            raise RuntimeError(f"shard {self.shard}: items went from {before} new frames each to {shift}")
        self.frame_shift = shift
        self.frames = FrameStore(len(self.generation) * shift, self.frames.file)

    def attach(self, reader: str, paths: list[str], nbytes: int) -> bool:
        """Map the reply slots (files of ``nbytes``) of the learner named ``reader``; False
        when they are not on this machine."""
        if any(Path(path).parent != SHARED_MEMORY for path in paths):
            # The shard writes into what it maps: nothing outside shared memory.
            raise ValueError(f"reply slots must be files in {SHARED_MEMORY}: {paths}")
        if not all(Path(path).is_file() for path in paths):
            return False
        slots = [torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8) for path in paths]
        with self._lock:
            self.readers[reader] = slots
        return True

    def sample(
        self, count: int, into: tuple[str, int] | None = None
    ) -> tuple[TensorDictBase | None, float, float]:
        """``count`` transitions drawn by priority (none for 0), and this shard's priority
        mass: the sum and the minimum of its priorities, as the weights were computed
        (drawing uniformly: its size, and 1). With ``into`` (a reader and one of its
        slots), the frames go into that slot, not into the batch."""
        with self._lock:
            batch = None
            if count > 0:
                batch = self.buffer.sample(count)
                if FRAMES in batch.keys():
                    batch = self._with_pixels(batch, self.readers[into[0]][into[1]] if into else None)
                batch[GENERATION] = self.generation[batch["index"]]
                batch[SHARD] = torch.full((count,), self.shard)
            if self.prioritized:
                return batch, *mass(self.buffer)
            size = len(self.buffer)
            return batch, float(size), (1.0 if size else math.inf)

    def _with_pixels(self, batch: TensorDictBase, slot: torch.Tensor | None) -> TensorDictBase:
        """``batch`` with each item's frames (``PIXELS``: a transition's observation stack
        and the next observation's newest frame, or a sequence's observations) in place of
        their stamps, or, given a reply ``slot``, without them: they are in the slot. An
        item whose frames were overwritten is drawn again: this is rejection sampling, so
        the draws stay distributed by priority (or uniformly) over the items that still
        have their frames."""
        for _ in range(REDRAWS):
            lost = ~self.frames.holds(batch[FRAMES])
            if not lost.any():
                break
            batch[lost] = self.buffer.sample(int(lost.sum()))
        else:
            raise RuntimeError(f"shard {self.shard}: too few items still have their frames")
        if slot is None:
            batch[PIXELS] = self.frames.read(batch[FRAMES])
        else:
            self.frames.read(batch[FRAMES], out=slot)
        return batch.exclude(FRAMES)

    def update_priority(self, priorities: TensorDictBase) -> None:
        """``priorities`` holds the ``index``, ``generation`` and new ``PRIORITY`` of
        sampled transitions (finite: the learner checks them before its step). Prioritized
        shards only."""
        index = priorities["index"]
        with self._lock:
            current = self.generation[index] == priorities[GENERATION]
            self.stale_updates += int((~current).sum())
            if current.any():
                # The tensors, not the tensordict: masking and reading a tensordict cost more
                # than the sum tree's update (143 against 260 us for 1,024 priorities).
                self.buffer.update_priority(index[current], priorities[PRIORITY][current])

    def save(self, folder: str) -> None:
        """Write the contents, priorities and write counts to ``folder`` (a checkpoint)."""
        with self._lock:
            self.buffer.dumps(folder)
            counts = {
                "alpha": self.alpha,
                "generation": self.generation,
                "inserted": self.inserted,
                "stale_updates": self.stale_updates,
                "frames_written": self.frames.written,
                "frame_shape": self.frames.frame_shape,
                "frame_shift": self.frame_shift,
            }
            self.frames.save(Path(folder))
            torch.save(counts, Path(folder) / "shard.pt")

    def load(self, folder: str) -> None:
        """Put back what ``save`` wrote. Streams start anew: a resumed run starts new episodes."""
        with self._lock:
            self.buffer.loads(folder)
            counts = torch.load(Path(folder) / "shard.pt", weights_only=True)
            self.generation = counts["generation"]
            self.inserted, self.stale_updates = counts["inserted"], counts["stale_updates"]
            self._frames_per_item(counts.get("frame_shift", 1))  # absent: saved before sequences had frames
            self.frames.load(Path(folder), counts["frames_written"], tuple(counts["frame_shape"]))

    def restore(self, saved: Sequence[str | Path], part: int, parts: int) -> None:
        """Go on from a checkpoint's shards (their folders, ``saved``) as shard ``part`` of
        ``parts``. With as many shards as were saved, each loads its own. Otherwise each
        reads every saved shard and keeps its part (``Dealer``): transitions that share
        frames stay together, and each goes with its priority and its frames. So do shards
        saved with another ``alpha``: their priorities go into this shard's sampler, which
        raises them to its own ``alpha`` (a uniform shard's are all 1). Write counts that
        are totals over the shards (``inserted``, ``stale_updates``) are split between the
        parts, so their sums stay as they were. Streams start anew, as after ``load``.
        """
        if len(saved) == parts and SavedShard.alpha_of(Path(saved[part])) == self.alpha:
            self.load(str(saved[part]))
            return
        dealer = Dealer(parts, len(self.generation))  # every part deals alike: each keeps its own
        inserted = stale_updates = 0
        with self._lock:
            for folder in saved:
                source = SavedShard(Path(folder))
                if source.frames.written:
                    self._frames_per_item(source.shift)
                inserted += source.counts["inserted"]
                stale_updates += source.counts["stale_updates"]
                self._write_restored(source, dealer.deal(source) == part)
            self.inserted = inserted // parts + (part < inserted % parts)
            self.stale_updates = stale_updates // parts + (part < stale_updates % parts)

    def _write_restored(self, source: SavedShard, mine: torch.Tensor) -> None:
        """Append the rows of ``source`` picked by ``mine``, oldest first, with their
        priorities; frame-stacked rows bring the frames they name, each once."""
        rows, priorities = source.rows[mine], source.priorities[mine]
        capacity = len(self.generation)
        if len(rows) > capacity:
            log.warning(
                "replay shard %d: %d saved transitions exceed its capacity of %d: the oldest are left out",
                self.shard, len(rows), capacity,
            )  # fmt: skip
            rows, priorities = rows[-capacity:], priorities[-capacity:]
        if len(rows) == 0:
            return
        if FRAMES in rows.keys():
            stamps = rows[FRAMES]
            held = source.frames.holds(stamps)
            needed = stamps[held].unique()  # sorted: oldest frame first
            first = self.frames.written
            # At most a store's worth per write: slots must not repeat within one write.
            for chunk in needed.split(self.frames.capacity):
                self.frames.write(source.frames.read(chunk))
            renamed = first + torch.searchsorted(needed, stamps)
            rows[FRAMES] = torch.where(held.unsqueeze(-1), renamed, torch.full_like(stamps, LOST))
        index = self.buffer.extend(rows, update_priority=False)
        if self.prioritized:
            self.buffer.update_priority(index, priorities)
        self.generation[index] += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "size": len(self.buffer),
                "inserted": self.inserted,
                "stale_updates": self.stale_updates,
                "shared_memory_readers": len(self.readers),
            }
