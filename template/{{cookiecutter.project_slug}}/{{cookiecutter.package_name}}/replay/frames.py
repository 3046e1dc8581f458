"""Pixel observations stored once: stacked ones frame by frame, sequences step by step.

Atari observations are uint8 ``[4, 84, 84]`` stacks, newest frame last, and each next
observation is the observation moved on by one frame. Stored naively, a transition holds
eight frames (56 KB); here it holds one (7 KB), as in Dopamine's circular buffer and
torchrl's Atari buffers: a transition keeps the stamps of its observation's frames and of
the next observation's newest frame, and both stacks are gathered when it is sampled.

Each env copy's frames form a stream, which its learner always writes to the same shard,
so a stream goes on across collector batches. At an episode start the env's own reset
stack is stored whole (ale-py fills it with zeros), so no frame of an earlier episode can
enter a stack. torchrl's prioritized samplers draw whole stored rows
(``PrioritizedSliceSampler``: slices of trajectories), not single transitions over shared
frames: that part is ours.

Sequences of pixel observations (R2D2's replay items, ``[copies, sequences]``, each entry
a sequence's steps) are stored step by step, each step's observation once: each env copy's
sequences form a stream, and a sequence that starts with the previous one's last
``overlap`` steps (R2D2's overlapping sequences) names their stored observations and
brings only the rest. Each step's observation is stored whole, so with stacked frames
(``env.frame_stack`` above 1) a frame is in several stacks; R2D2 plays single frames.
"""

from __future__ import annotations

import atexit
import math
from pathlib import Path

import torch
from tensordict import MemoryMappedTensor, TensorDictBase

OBSERVATION, NEXT_OBSERVATION = "observation", ("next", "observation")
# A stored transition's frames: the stamps (write counts) of its observation's stack and of
# the next observation's newest frame. A sampled one carries the frames themselves.
FRAMES, PIXELS = "frames", "pixels"
# The position, in its stream, of the first frame of a transition's observation (see pack).
POSITION = "frame_position"
# The stamp of a frame that no store holds: a restored transition whose frames were
# overwritten before the checkpoint keeps its place and priority, and is never sampled.
LOST = -(2**62)


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
        """Put back what ``save`` wrote, copied into this store."""
        self.written = written
        if written:
            self._allocate(frame_shape)
            saved = FrameStore.saved(folder, self.capacity, written, frame_shape)
            self.frames[: len(saved.frames)] = saved.frames

    @classmethod
    def saved(cls, folder: Path, capacity: int, written: int, frame_shape: tuple[int, ...]) -> FrameStore:
        """A store of ``capacity`` frames as ``save`` wrote it into ``folder``, read from the
        file where needed, not copied (a checkpoint's frames, to deal to other shards)."""
        store = cls(capacity)
        store.written, store.frame_shape = written, frame_shape
        if written:
            store.frames = MemoryMappedTensor.from_filename(
                folder / "frames.memmap",
                dtype=torch.uint8,
                shape=(min(written, capacity), math.prod(frame_shape)),
            )
        return store

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


def is_pixel_sequences(items: TensorDictBase) -> bool:
    """Whether ``items`` (``[copies, sequences]``) are sequences of pixel observations:
    uint8 images ``[channels, height, width]`` at each of a sequence's steps."""
    if items.ndim != 2 or OBSERVATION not in items.keys():
        return False
    observation = items[OBSERVATION]
    return observation.dtype == torch.uint8 and observation.ndim == 6


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
