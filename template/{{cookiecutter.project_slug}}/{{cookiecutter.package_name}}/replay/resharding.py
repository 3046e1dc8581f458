"""A checkpoint's replay dealt onto another number of shards (or another ``replay.alpha``).

When a run resumes with as many shards as its checkpoint saved, and the same alpha, each
shard loads its own. Otherwise each new shard reads every saved one (``SavedShard``) and
keeps its part (``Dealer``), each transition with its priority and the frames it needs, so
the buffer goes on as it was, spread over the new shards (``ReplayShard.restore``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer, TensorDictReplayBuffer

from .frames import FRAMES, FrameStore
from .sampler_trees import stored_priorities


class SavedShard:
    """A shard as a checkpoint holds it, read for ``ReplayShard.restore``: its rows oldest
    first, their priorities, and its frames, read from the file only where needed."""

    def __init__(self, folder: Path) -> None:
        self.counts = torch.load(folder / "shard.pt", weights_only=True)
        generation = self.counts["generation"]
        capacity = len(generation)
        uniform = self.counts.get("alpha") == 0  # None: see alpha_of
        storage = LazyTensorStorage(capacity)
        if uniform:
            buffer = TensorDictReplayBuffer(storage=storage)
        else:  # the saved sampler's alpha replaces this one as it loads
            buffer = TensorDictPrioritizedReplayBuffer(alpha=1.0, beta=1.0, storage=storage)
        buffer.loads(folder)
        # Oldest first: a slot written in an earlier round of the circular writer, and
        # within a round, a lower slot. The shard's own write counts say which round.
        written = torch.nonzero(generation).squeeze(-1)
        slots = written[torch.argsort(generation[written] * capacity + written)]
        self.rows = buffer[slots].exclude("index")
        self.priorities = torch.ones(len(slots)) if uniform else stored_priorities(buffer, slots)
        # The frames a row adds to its stream, as ReplayShard's ``frame_shift`` (absent:
        # saved before sequences had frames), and as many frames per row as it kept.
        self.shift = self.counts.get("frame_shift", 1)
        self.frames = FrameStore.saved(
            folder, capacity * self.shift, self.counts["frames_written"], tuple(self.counts["frame_shape"])
        )

    @staticmethod
    def alpha_of(folder: Path) -> float | None:
        """The ``alpha`` of the shard saved in ``folder``; None for a checkpoint written
        before shards recorded it (a prioritized buffer, whatever its alpha)."""
        return torch.load(folder / "shard.pt", weights_only=True).get("alpha")

    def framed(self) -> torch.Tensor:
        """Per row: whether it is made of frames that are still here."""
        if FRAMES not in self.rows.keys():
            return torch.zeros(len(self.rows), dtype=torch.bool)
        return self.frames.holds(self.rows[FRAMES])

    def groups(self) -> torch.Tensor:
        """A group per row: rows that share frames (one env copy's steps of an episode,
        each observation the previous one moved on by a frame; or one env copy's
        overlapping sequences) name the same group, the position of its oldest row; other
        rows (and rows whose frames are gone) are groups of their own."""
        count = len(self.rows)
        own = torch.arange(count)
        if FRAMES not in self.rows.keys() or count == 0 or self.shift >= self.rows[FRAMES].shape[1]:
            return own
        stamps = self.rows[FRAMES]
        # A row goes on from the row whose frame ``shift`` places in is its first (a
        # transition's observation's second frame; the first step a sequence passes on).
        firsts = stamps[:, 0].contiguous()
        seconds, order = stamps[:, self.shift].sort()
        at = torch.searchsorted(seconds, firsts).clamp(max=count - 1)
        goes_on = (seconds[at] == firsts) & self.framed()
        previous = torch.where(goes_on, order[at], own)
        while True:  # pointer jumping: every row reaches its group's first in log2(rows) rounds
            further = previous[previous]
            if torch.equal(further, previous):
                return previous
            previous = further


class Dealer:
    """Deals a checkpoint's rows to ``parts`` shards of ``capacity`` items (and as many
    frames times the frames each adds) each, one saved shard after another, keeping count
    of what each part got.

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
            # A group's piece of ``piece`` rows holds piece * shift frames, plus those its
            # first row shares with the row before (a transition's stack less one frame).
            shift, shared = source.shift, source.rows[FRAMES].shape[1] - source.shift
            room_for = self.capacity * shift
            rows = torch.nonzero(framed).squeeze(-1)
            groups = source.groups()[rows]
            rows = rows[torch.argsort(groups, stable=True)]  # group by group, each oldest first
            start = 0
            for size in torch.unique(groups, return_counts=True)[1].tolist():
                while size:
                    part = min(range(len(self.frames)), key=self.frames.__getitem__)
                    room = (room_for - self.frames[part] - shared) // shift
                    piece = size if room <= 0 else min(size, room)  # every part full: its oldest go
                    owner[rows[start : start + piece]] = part
                    self.frames[part] += piece * shift + shared
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
