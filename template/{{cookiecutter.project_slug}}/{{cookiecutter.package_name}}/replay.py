"""Prioritized replay: shards that live in replay processes, and the learners' client for them.

Each shard is one ``TensorDictPrioritizedReplayBuffer`` that owns its writer cursor and sum
tree, so learners write through it over RPC and no cursor is shared between processes (the
failure of worker-local buffers on shared storage, where each cursor overwrites the
others). With several shards (as in Ape-X) each learner spreads its writes round-robin,
and every batch is drawn across the shards in proportion to their total priority, with
importance weights normalised over all shards: it is distributed like a batch from one
buffer holding everything.

Stacked pixel observations (Atari: uint8 ``[4, 84, 84]``, newest frame last) are stored
frame by frame, each frame once, as Dopamine's circular buffer and torchrl's Atari buffers
do: a transition keeps the stamps of its observation's frames and of the next
observation's newest frame, and both stacks are gathered when it is sampled. Naively,
one transition would hold eight frames (56 KB); here it holds one (7 KB). Each env copy's
frames form a stream, which its learner always writes to the same shard, so a stream goes
on across collector batches; at an episode start the env's own reset stack is stored
whole (ale-py fills it with zeros), so no frame of an earlier episode can enter a stack.
torchrl's prioritized samplers draw whole stored rows (``PrioritizedSliceSampler``:
slices of trajectories), not single transitions over shared frames: that part is ours.

A sampled batch of Pong frames is 9 MB (8 batches of 32, five frames each). A shard on the
learner's machine gathers them straight into the learner's reply slots, files in shared
memory that both processes map, and the RPC reply carries the rest; from a shard on
another machine they come over the socket (``ReplayClient``, README "The data path").

A checkpoint's shards resume on another number of shards (``ReplayShard.restore``): each
new shard reads every saved one and keeps its part, each transition with its priority and
the frames it needs, so the buffer goes on as it was, spread over the new shards.
"""

from __future__ import annotations

import atexit
import collections
import logging
import math
import os
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
from tensordict import MemoryMappedTensor, TensorDictBase
from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictPrioritizedReplayBuffer
from torchrl.data.replay_buffers import Storage

log = logging.getLogger(__name__)
GENERATION = "generation"
SHARD = "shard"
WEIGHT = "priority_weight"
OBSERVATION, NEXT_OBSERVATION = "observation", ("next", "observation")
# A stored transition's frames: the stamps (write counts) of its observation's stack and of
# the next observation's newest frame. A sampled one carries the frames themselves.
FRAMES, PIXELS = "frames", "pixels"
# The position, in its stream, of the first frame of a transition's observation (see pack).
POSITION = "frame_position"
MEMORY, MEMMAP = "memory", "memmap"  # replay.storage
# A sampled transition whose frames were overwritten is drawn again, this many times at most.
REDRAWS = 20
# The stamp of a frame that no store holds: a restored transition whose frames were
# overwritten before the checkpoint keeps its place and priority, and is never sampled.
LOST = -(2**62)
# Added to every priority before the exponent (torchrl's default, named: ``stored_priorities`` takes it off).
EPS = 1e-8
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
    """One prioritized buffer served to learners; RPC calls arrive on several threads."""

    def __init__(
        self,
        capacity: int,
        alpha: float,
        beta: float,
        priority_key: str,
        shard: int = 0,
        storage: str = MEMORY,
        directory: str | Path | None = None,
    ) -> None:
        folder = Path(directory) if directory is not None else None
        self.buffer = TensorDictPrioritizedReplayBuffer(
            alpha=alpha,
            beta=beta,
            eps=EPS,
            storage=make_storage(storage, capacity, folder and folder / "transitions"),
            priority_key=priority_key,
        )
        # Created for stacked pixel observations, at their first write (see extend_frames).
        # As many frames as transitions: a frame per step, plus a reset stack per episode,
        # so the oldest transitions of a full shard (4 / episode length of them) have lost
        # a frame; sampling draws those again.
        self.frames = FrameStore(capacity, folder / "frames.memmap" if storage == MEMMAP and folder else None)
        self.tails: dict[str, torch.Tensor] = {}  # stream -> stamps of its newest stack
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
        mass: the sum and the minimum of its priorities, as the weights were computed.
        With ``into`` (a reader and one of its slots), the frames go into that slot, not
        into the batch."""
        with self._lock:
            batch = None
            if count > 0:
                batch = self.buffer.sample(count)
                if FRAMES in batch.keys():
                    batch = self._with_pixels(batch, self.readers[into[0]][into[1]] if into else None)
                batch[GENERATION] = self.generation[batch["index"]]
                batch[SHARD] = torch.full((count,), self.shard)
            return batch, *self._mass()

    def _with_pixels(self, batch: TensorDictBase, slot: torch.Tensor | None) -> TensorDictBase:
        """``batch`` with each transition's frames (``PIXELS``: its observation's stack and
        the next observation's newest frame) in place of their stamps, or, given a reply
        ``slot``, without them: they are in the slot. A transition whose frames were
        overwritten is drawn again: this is rejection sampling, so the draws stay
        distributed by priority over the transitions that still have their frames."""
        for _ in range(REDRAWS):
            lost = ~self.frames.holds(batch[FRAMES])
            if not lost.any():
                break
            batch[lost] = self.buffer.sample(int(lost.sum()))
        else:
            raise RuntimeError(f"shard {self.shard}: too few transitions still have their frames")
        if slot is None:
            batch[PIXELS] = self.frames.read(batch[FRAMES])
        else:
            self.frames.read(batch[FRAMES], out=slot)
        return batch.exclude(FRAMES)

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
                "frames_written": self.frames.written,
                "frame_shape": self.frames.frame_shape,
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
            self.frames.load(Path(folder), counts["frames_written"], tuple(counts["frame_shape"]))

    def restore(self, saved: Sequence[str | Path], part: int, parts: int) -> None:
        """Go on from a checkpoint's shards (their folders, ``saved``) as shard ``part`` of
        ``parts``. With as many shards as were saved, each loads its own. Otherwise each
        reads every saved shard and keeps its part (``Dealer``): transitions that share
        frames stay together, and each goes with its priority and its frames. Write counts that
        are totals over the shards (``inserted``, ``stale_updates``) are split between the
        parts, so their sums stay as they were. Streams start anew, as after ``load``.
        """
        if len(saved) == parts:
            self.load(str(saved[part]))
            return
        dealer = Dealer(parts, len(self.generation))  # every part deals alike: each keeps its own
        inserted = stale_updates = 0
        with self._lock:
            for folder in saved:
                source = SavedShard(Path(folder), self.buffer.priority_key)
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
            held = source.holds(stamps)
            needed = stamps[held].unique()  # sorted: oldest frame first
            first = self.frames.written
            # At most a store's worth per write: slots must not repeat within one write.
            for chunk in needed.split(self.frames.capacity):
                self.frames.write(source.read(chunk))
            renamed = first + torch.searchsorted(needed, stamps)
            rows[FRAMES] = torch.where(held.unsqueeze(-1), renamed, torch.full_like(stamps, LOST))
        index = self.buffer.extend(rows, update_priority=False)
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

    def _mass(self) -> tuple[float, float]:
        # torchrl keeps the sum and the minimum of the (transformed) priorities in its
        # sampler's segment trees and has no public accessor for them; sampling across
        # shards needs both. tests/test_replay.py fails loudly if torchrl changes this.
        size = len(self.buffer)
        if size == 0:
            return 0.0, math.inf
        sampler = self.buffer.sampler
        return float(sampler._sum_tree.query(0, size)), float(sampler._min_tree.query(0, size))


class SavedShard:
    """A shard as a checkpoint holds it, read for ``ReplayShard.restore``: its rows oldest
    first, their priorities, and its frames, read from the file only where needed."""

    def __init__(self, folder: Path, priority_key: str) -> None:
        self.counts = torch.load(folder / "shard.pt", weights_only=True)
        generation = self.counts["generation"]
        capacity = len(generation)
        buffer = TensorDictPrioritizedReplayBuffer(
            alpha=1.0, beta=1.0, storage=LazyTensorStorage(capacity), priority_key=priority_key
        )
        buffer.loads(folder)
        # Oldest first: a slot written in an earlier round of the circular writer, and
        # within a round, a lower slot. The shard's own write counts say which round.
        written = torch.nonzero(generation).squeeze(-1)
        slots = written[torch.argsort(generation[written] * capacity + written)]
        self.rows = buffer[slots].exclude("index")
        self.priorities = stored_priorities(buffer, slots)
        self.capacity = capacity  # of frames too, as ReplayShard makes its FrameStore
        self.written = self.counts["frames_written"]
        self.frame_shape = tuple(self.counts["frame_shape"])
        self.frames = None
        if self.written:
            kept = min(self.written, capacity)
            self.frames = MemoryMappedTensor.from_filename(
                folder / "frames.memmap", dtype=torch.uint8, shape=(kept, math.prod(self.frame_shape))
            )

    def holds(self, stamps: torch.Tensor) -> torch.Tensor:
        return stamps.min(-1).values >= self.written - self.capacity

    def framed(self) -> torch.Tensor:
        """Per row: whether it is made of frames that are still here."""
        if FRAMES not in self.rows.keys():
            return torch.zeros(len(self.rows), dtype=torch.bool)
        return self.holds(self.rows[FRAMES])

    def read(self, stamps: torch.Tensor) -> torch.Tensor:
        return self.frames.index_select(0, stamps % self.capacity).view(-1, *self.frame_shape)

    def groups(self) -> torch.Tensor:
        """A group per row: rows that share frames (one env copy's steps of an episode:
        each observation is the previous one moved on by a frame) name the same group, the
        position of its oldest row; other rows (and rows whose frames are gone) are groups
        of their own."""
        count = len(self.rows)
        own = torch.arange(count)
        if FRAMES not in self.rows.keys() or count == 0:
            return own
        stamps = self.rows[FRAMES]
        # A row goes on from the row whose observation's second frame is its first.
        firsts = stamps[:, 0].contiguous()
        seconds, order = stamps[:, 1].sort()
        at = torch.searchsorted(seconds, firsts).clamp(max=count - 1)
        goes_on = (seconds[at] == firsts) & self.framed()
        previous = torch.where(goes_on, order[at], own)
        while True:  # pointer jumping: every row reaches its group's first in log2(rows) rounds
            further = previous[previous]
            if torch.equal(further, previous):
                return previous
            previous = further


def stored_priorities(buffer: TensorDictPrioritizedReplayBuffer, slots: torch.Tensor) -> torch.Tensor:
    """The priorities of ``slots``, as given to ``update_priority``. torchrl keeps them
    transformed, ``(p + EPS) ** alpha``, in its sampler's sum tree, which has no public
    accessor (as in ``ReplayShard._mass``; tests/test_elastic.py fails loudly if this
    changes)."""
    alpha = buffer.sampler.alpha
    if alpha == 0:  # every priority counts the same: any value restores it
        return torch.ones(len(slots))
    return (buffer.sampler._sum_tree[slots].double() ** (1 / alpha) - EPS).clamp(min=0).float()


class Dealer:
    """Deals a checkpoint's rows to ``parts`` shards of ``capacity`` transitions (and as
    many frames) each, one saved shard after another, keeping count of what each part got.

    Rows with frames go first, group by group (``SavedShard.groups``), oldest first, each
    to the part with the fewest frames so far, whole while it fits; a group that fits
    nowhere is split, its older rows first (the newer piece stores again the frames the
    pieces share). Then the other rows (rows stored whole, or whose frames are gone) fill
    up the parts with the fewest rows, interleaved, so each part gets old and new ones.
    """

    def __init__(self, parts: int, capacity: int) -> None:
        self.capacity = capacity
        self.rows = torch.zeros(parts, dtype=torch.long)
        self.frames = [0] * parts

    def deal(self, source: SavedShard) -> torch.Tensor:
        """The part each row of ``source`` goes to."""
        owner = torch.empty(len(source.rows), dtype=torch.long)
        framed = source.framed()
        if framed.any():
            depth = source.rows[FRAMES].shape[1] - 1
            rows = torch.nonzero(framed).squeeze(-1)
            groups = source.groups()[rows]
            rows = rows[torch.argsort(groups, stable=True)]  # group by group, each oldest first
            start = 0
            for size in torch.unique(groups, return_counts=True)[1].tolist():
                while size:
                    part = min(range(len(self.frames)), key=self.frames.__getitem__)
                    room = self.capacity - self.frames[part] - depth  # a piece's frames: rows + depth
                    piece = size if room <= 0 else min(size, room)  # every part full: its oldest go
                    owner[rows[start : start + piece]] = part
                    self.frames[part] += piece + depth
                    self.rows[part] += piece
                    start, size = start + piece, size - piece
        rest = torch.nonzero(~framed).squeeze(-1)
        owner[rest] = self._fill(len(rest))
        return owner

    def _fill(self, count: int) -> torch.Tensor:
        """Parts for ``count`` rows, in the order of the rows: the parts with the fewest
        rows take them until all are level (water filling), each part's spread out."""
        low, high = int(self.rows.min()), int(self.rows.max()) + count
        while low < high:  # the highest level that count rows can fill every part up to
            middle = (low + high + 1) // 2
            if int((middle - self.rows).clamp(min=0).sum()) <= count:
                low = middle
            else:
                high = middle - 1
        shares = (low - self.rows).clamp(min=0)
        # Fewer left over than parts at the level: some of them take one more.
        shares[torch.argsort(self.rows + shares, stable=True)[: count - int(shares.sum())]] += 1
        self.rows += shares
        owners = torch.repeat_interleave(torch.arange(len(shares)), shares)
        # Part p's k-th row at k / shares[p] of the way: each part's rows spread over them all.
        spread = torch.cat([torch.arange(n) / max(n, 1) for n in shares.tolist()])
        return owners[torch.argsort(spread, stable=True)]


class FrameStore:
    """Frames in a circular uint8 tensor, each named by its stamp: the number of frames
    written before it. Slot ``stamp % capacity`` holds it until ``capacity`` more come.

    A plain tensor (or a memory-mapped file), not a torchrl storage: a storage gathers rows
    by advanced indexing, which copies a sampled batch's frames byte by byte, ten times
    slower here than ``index_select`` on rows of whole frames.
    """

    def __init__(self, capacity: int, file: Path | None = None) -> None:
        self.capacity = capacity
        self.file = file  # memory-mapped there, else in memory
        self.frames: torch.Tensor | None = None  # [capacity, height * width], made at the first write
        self.frame_shape: tuple[int, ...] = ()
        self.written = 0

    def write(self, frames: torch.Tensor) -> int:
        """Store ``frames`` (``[count, height, width]``); returns the first one's stamp."""
        if self.frames is None:
            self._allocate(tuple(frames.shape[1:]))
        first = self.written
        slots = torch.arange(first, first + len(frames)) % self.capacity
        self.frames.index_copy_(0, slots, frames.reshape(len(frames), -1))
        self.written += len(frames)
        return first

    def holds(self, stamps: torch.Tensor) -> torch.Tensor:
        """Per row of ``stamps``: whether all its frames are still here."""
        return stamps.min(-1).values >= self.written - self.capacity

    def read(self, stamps: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The frames of ``stamps``, shaped ``[*stamps.shape, *frame_shape]``, gathered into
        the start of the flat uint8 tensor ``out`` if given (a reply slot)."""
        rows = stamps.flatten() % self.capacity
        if out is None:
            frames = self.frames.index_select(0, rows)
        else:
            frames = torch.index_select(
                self.frames, 0, rows, out=out[: rows.numel() * self.frames.shape[1]].view(rows.numel(), -1)
            )
        return frames.view(*stamps.shape, *self.frame_shape)

    def save(self, folder: Path) -> None:
        if self.frames is not None:
            kept = min(self.written, self.capacity)
            # copy_existing: with replay.storage=memmap the frames already live in a file.
            MemoryMappedTensor.from_tensor(
                self.frames[:kept], filename=folder / "frames.memmap", copy_existing=True
            )

    def load(self, folder: Path, written: int, frame_shape: tuple[int, ...]) -> None:
        self.written = written
        if written:
            self._allocate(frame_shape)
            kept = min(written, self.capacity)
            saved = MemoryMappedTensor.from_filename(
                folder / "frames.memmap", dtype=torch.uint8, shape=(kept, self.frames.shape[1])
            )
            self.frames[:kept] = saved

    def _allocate(self, frame_shape: tuple[int, ...]) -> None:
        self.frame_shape = frame_shape
        shape = (self.capacity, math.prod(frame_shape))
        if self.file is None:
            self.frames = torch.empty(shape, dtype=torch.uint8)
            return
        self.file.parent.mkdir(parents=True, exist_ok=True)
        self.frames = MemoryMappedTensor.empty(shape, dtype=torch.uint8, filename=self.file)
        atexit.register(self.file.unlink, missing_ok=True)  # scratch space, as the transitions'


def is_frame_stack(batch: TensorDictBase) -> bool:
    """Whether ``batch`` (``[env copies, steps]``) holds stacked pixel observations: uint8
    ``[stack, height, width]`` in which each next observation is the observation shifted by
    one frame. Such observations are stored frame by frame; any other, whole."""
    if batch.ndim != 2 or OBSERVATION not in batch.keys():
        return False
    observation = batch[OBSERVATION]
    if observation.dtype != torch.uint8 or observation.ndim != 5 or observation.shape[2] < 2:
        return False
    return torch.equal(batch[NEXT_OBSERVATION][:, :, :-1], observation[:, :, 1:])


def pack(batch: TensorDictBase, linked: torch.Tensor) -> tuple[TensorDictBase, torch.Tensor, torch.Tensor]:
    """The frames of ``batch`` (``[streams, steps]``) that a shard has not seen, and where
    each transition's observation starts among them.

    A stream's frames, as the shard sees them: its newest stack so far (positions
    ``0..depth-1``; only where ``linked``, i.e. the first observation goes on from it), then
    the frames written here. An observation that does not go on from the previous next
    observation (an episode start, or the stream's first) is written whole, the env's own
    stack; every step then writes the next observation's newest frame. Returns the rows
    (the batch without pixels, with ``POSITION``), the new frames, and their count per stream.
    """
    observation, following = batch[OBSERVATION], batch[NEXT_OBSERVATION]
    streams, steps, depth = observation.shape[:3]
    starts = torch.ones(streams, steps, dtype=torch.bool)
    starts[:, 1:] = (observation[:, 1:] != following[:, :-1]).flatten(2).any(-1)
    starts[:, 0] = ~linked
    written = starts.long() * depth + 1  # frames written at each step
    before = torch.cumsum(written, 1) - written
    rows = batch.exclude(OBSERVATION, NEXT_OBSERVATION)
    # Going on, an observation is the previous next observation, whose stack starts at
    # ``before``; a whole stack written at this step starts after the stream's old stack.
    rows[POSITION] = before + starts.long() * depth
    keep = torch.cat(
        [starts.unsqueeze(-1).expand(-1, -1, depth), torch.ones(streams, steps, 1, dtype=torch.bool)], -1
    )
    frames = torch.cat([observation, following[:, :, -1:]], 2)[keep]
    return rows, frames, written.sum(1)


Request = tuple[list[torch.futures.Future], int | None]


def shared_memory_tensor(path: Path, nbytes: int) -> torch.Tensor:
    """A uint8 tensor in a new file ``path`` that other processes can map. Its pages are
    reserved here, so a full /dev/shm is an OSError now, not a SIGBUS at a later write."""
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(descriptor, 0, nbytes)
    finally:
        os.close(descriptor)
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


class ReplayClient:
    """A learner's view of the replay shards: writes are asynchronous, samples prefetched.

    One request fetches ``batches_per_request`` batches, and ``requests_ahead`` more
    requests stay in flight (a new one goes out as one arrives), so the learner trains
    while the network works; priorities go back in one call per request. Futures are
    awaited in order (at most ``max_in_flight`` outstanding writes), so an error on a
    replay process surfaces on the learner at the next call instead of vanishing.

    ``extend`` takes a collector batch ``[env copies, steps]``. Stacked pixel observations
    (``is_frame_stack``, decided at the first batch) go frame by frame, each env copy always
    to the same shard; anything else goes row by row, each batch to the next shard.

    With ``share_frames`` (shards in other processes), once the first sampled frames have
    come, each shard on this machine writes the next requests' frames into reply slots in
    shared memory: the frames of one request are one slot. A request ``n`` uses slot
    ``n % (requests_ahead + 2)``, so a batch's frames stay as they are until the learner
    has taken another ``batches_per_request`` batches: copy them to keep a batch longer.
    """

    def __init__(
        self,
        shards: Sequence,
        batch_size: int,
        beta: float,
        batches_per_request: int = 1,
        first_shard: int = 0,
        max_in_flight: int = 8,
        requests_ahead: int = 1,
        share_frames: bool = False,
    ) -> None:
        self.shards = list(shards)
        self.batch_size = batch_size
        self.beta = beta
        self.batches_per_request = batches_per_request
        self.max_in_flight = max_in_flight
        self.requests_ahead = requests_ahead
        self._first_shard = first_shard
        self._next_shard = first_shard % len(self.shards)
        self._writes: collections.deque[torch.futures.Future] = collections.deque()
        self._priorities: list[TensorDictBase] = []
        self._batches: collections.deque[TensorDictBase] = collections.deque()
        # Requests in flight: each shard's future and the request's reply slot (or None).
        self._requests: collections.deque[Request] = collections.deque()
        self.share_frames = share_frames
        self.slots: dict[int, list[torch.Tensor]] = {}  # shard -> its reply slots (shared frames)
        self._slot_count = requests_ahead + 2  # see above: a batch outlives the next request's
        self._pixel_shape: torch.Size | None = None  # one sampled transition's frames
        self._sent = 0  # requests with reply slots sent so far
        self._mass_sum = torch.zeros(len(self.shards), dtype=torch.float64)
        self._mass_min = torch.full((len(self.shards),), math.inf, dtype=torch.float64)
        self._frame_stack: bool | None = None  # decided by the first batch
        self._writer = uuid.uuid4().hex  # names this client's streams and reply slots on the shards
        self._newest: dict[int, torch.Tensor] = {}  # env copy -> the next observation last written
        self._frame_writes: dict[int, torch.futures.Future] = {}  # shard -> its last frame write

    def extend(self, transitions: TensorDictBase) -> None:
        """Write a collector batch ``[env copies, steps]`` (or flat transitions) to the
        shards, asynchronously."""
        if self._frame_stack is None:
            self._frame_stack = is_frame_stack(transitions)
        if self._frame_stack:
            self._extend_frames(transitions)
            return
        shard = self.shards[self._next_shard]
        self._next_shard = (self._next_shard + 1) % len(self.shards)
        self._track(shard.rpc_async().extend(transitions.reshape(-1)))

    def _extend_frames(self, batch: TensorDictBase) -> None:
        """Env copy ``n`` writes to shard ``(first_shard + n) % shards``, where its stream of
        frames goes on from its previous batch."""
        if batch.ndim != 2 or not torch.equal(
            batch[NEXT_OBSERVATION][:, :, :-1], batch[OBSERVATION][:, :, 1:]
        ):
            raise ValueError("stacked pixel observations changed shape or stopped being a frame stack")
        copies = torch.arange(batch.shape[0])
        route = (copies + self._first_shard) % len(self.shards)
        groups = route.unique().tolist()
        for shard_index in groups:
            mine = copies[route == shard_index]
            part = batch if len(groups) == 1 else batch[mine]
            first = part[OBSERVATION][:, 0]
            linked = torch.tensor(
                [
                    n in self._newest and torch.equal(first[i], self._newest[n])
                    for i, n in enumerate(mine.tolist())
                ]
            )
            rows, frames, counts = pack(part, linked)
            for i, n in enumerate(mine.tolist()):
                self._newest[n] = part[NEXT_OBSERVATION][i, -1].clone()
            # RPC may run two calls of one caller in either order; a stream must arrive in order.
            previous = self._frame_writes.get(shard_index)
            if previous is not None:
                previous.wait()
            streams = [f"{self._writer}/{n}" for n in mine.tolist()]
            depth = part[OBSERVATION].shape[2]
            future = self.shards[shard_index].rpc_async().extend_frames(rows, frames, counts, streams, depth)
            self._frame_writes[shard_index] = future
            self._track(future)

    def sample(self, prefetch: bool = True) -> TensorDictBase:
        """The next batch; with ``prefetch`` the next requests go out as a request arrives."""
        if not self._batches:
            request = self._requests.popleft() if self._requests else self._request()
            self._batches.extend(self._receive(request))
            while prefetch and len(self._requests) < self.requests_ahead:
                self._requests.append(self._request())
        batch = self._batches.popleft()
        if PIXELS in batch.keys():
            # One uint8 tensor came over the wire; the two stacks are views into it.
            pixels = batch.pop(PIXELS)
            batch[OBSERVATION], batch[NEXT_OBSERVATION] = pixels[:, :-1], pixels[:, 1:]
        return batch

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
        while self._requests:
            torch.futures.wait_all(self._requests.popleft()[0])
        self._batches.clear()
        if len(self.shards) > 1:
            self._receive(self._ask([0] * len(self.shards)))  # the shards' masses as of now

    def _request(self) -> Request:
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
        slot = None
        if self.slots:
            slot = self._sent % self._slot_count
            self._sent += 1
        return self._ask(counts, slot)

    def _ask(self, counts: list[int], slot: int | None = None) -> Request:
        futures = []
        for index, (shard, count) in enumerate(zip(self.shards, counts, strict=True)):
            into = (self._writer, slot) if slot is not None and index in self.slots else None
            futures.append(shard.rpc_async().sample(count, into))
        return futures, slot

    def _receive(self, request: Request) -> list[TensorDictBase]:
        futures, slot = request
        replies = [future.wait() for future in futures]
        for shard, (_, total, lowest) in enumerate(replies):
            self._mass_sum[shard], self._mass_min[shard] = total, lowest
        global_min = float(self._mass_min.min())
        parts = []
        for shard, (batch, _, lowest) in enumerate(replies):
            if batch is None:
                continue
            if PIXELS in batch.keys() and self._pixel_shape is None:
                self._pixel_shape = batch[PIXELS].shape[1:]
                if self.share_frames:
                    self._share_frames()
            elif slot is not None and shard in self.slots:
                # The frames are in the slot, in the batch's order; views, no copy.
                frames = len(batch) * math.prod(self._pixel_shape)
                batch[PIXELS] = self.slots[shard][slot][:frames].view(len(batch), *self._pixel_shape)
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

    def _share_frames(self) -> None:
        """Make reply slots with each shard that can map this machine's shared memory; the
        others go on sending frames over the socket."""
        if not SHARED_MEMORY.is_dir():
            return
        nbytes = self.batch_size * self.batches_per_request * math.prod(self._pixel_shape)
        for index, shard in enumerate(self.shards):
            paths = [SHARED_MEMORY / f"replay-{self._writer}-{index}-{n}" for n in range(self._slot_count)]
            try:
                slots = [shared_memory_tensor(path, nbytes) for path in paths]
                if shard.rpc_sync().attach(self._writer, [str(path) for path in paths], nbytes):
                    self.slots[index] = slots
            except OSError as error:
                log.warning(
                    "replay: no room in %s for reply slots of %d MB (%s; a container's default is "
                    "64 MB, see docker run --shm-size): frames come over the socket",
                    SHARED_MEMORY,
                    len(paths) * nbytes >> 20,
                    error.strerror,
                )
                return
            finally:
                # Both processes have them mapped: the memory goes when the last one unmaps.
                for path in paths:
                    path.unlink(missing_ok=True)

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
