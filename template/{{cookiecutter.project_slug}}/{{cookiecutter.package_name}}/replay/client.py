"""A learner's client for the replay shards: asynchronous writes, prefetched samples.

With several shards (as in Ape-X) each learner spreads its writes round-robin, and every
batch is drawn across the shards in proportion to their total priority, with importance
weights normalised over all shards: it is distributed like a batch from one buffer
holding everything.

A sampled batch of Pong frames is 9 MB (8 batches of 32, five frames each). A shard on the
learner's machine gathers them straight into the learner's reply slots, files in shared
memory that both processes map, and the RPC reply carries the rest; from a shard on
another machine they come over the socket (docs/distributed.md, "The data path").
"""

from __future__ import annotations

import collections
import logging
import math
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from ..timing import timed
from .frames import NEXT_OBSERVATION, OBSERVATION, PIXELS, is_frame_stack, is_pixel_sequences, pack
from .shard import GENERATION, PRIORITY, SHARD, SHARED_MEMORY, WEIGHT

log = logging.getLogger(__name__)


Request = tuple[list[torch.futures.Future], int | None]
# How items go to the shards, decided by the first batch (see ReplayClient).
STACKS, SEQUENCES, ROWS = "stacks", "sequences", "rows"


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

    ``extend`` takes a collector batch ``[env copies, steps]`` of transitions, or a sequence
    recipe's ``[env copies, sequences]``. Stacked pixel observations (``is_frame_stack``)
    go frame by frame and sequences of pixel observations (``is_pixel_sequences``) step by
    step, each env copy always to the same shard (frames.py); anything else goes row by
    row, each batch to the next shard. The first batch decides which.

    With ``share_frames`` (shards in other processes), once the first sampled frames have
    come, each shard on this machine writes the next requests' frames into reply slots in
    shared memory: the frames of one request are one slot. A request ``n`` uses slot
    ``n % (requests_ahead + 2)``, so a batch's frames stay as they are until the learner
    has taken another ``batches_per_request`` batches: copy them to keep a batch longer.

    Without ``prioritized`` (shards of ``alpha`` 0, which draw uniformly) no priorities go
    back, and batches come without importance weights.
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
        prioritized: bool = True,
    ) -> None:
        self.shards = list(shards)
        self.prioritized = prioritized
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
        self._layout: str | None = None  # STACKS, SEQUENCES or ROWS: decided by the first batch
        self._writer = uuid.uuid4().hex  # names this client's streams and reply slots on the shards
        # Env copy -> what its next item may go on from: the next observation last written
        # (stacks), or the last sequence's last steps' observations (sequences).
        self._newest: dict[int, torch.Tensor] = {}
        self._frame_writes: dict[int, torch.futures.Future] = {}  # shard -> its last frame write
        self.inserted = 0  # items (transitions, or sequences) this client wrote
        self.sampled = 0  # items it sampled

    @timed("replay_insert")
    def extend(self, items: TensorDictBase, overlap: int = 0) -> None:
        """Write a collector batch ``[env copies, steps]`` of transitions, or a sequence
        recipe's ``[env copies, sequences]`` (each sequence's first ``overlap`` steps the
        previous one's last), to the shards, asynchronously."""
        if items.batch_size.numel() == 0:  # a sequence recipe's batch that completed no sequence
            return
        self.inserted += items.numel()
        if self._layout is None:
            self._layout = (
                STACKS if is_frame_stack(items) else SEQUENCES if is_pixel_sequences(items) else ROWS
            )
        if self._layout == STACKS:
            self._extend_frames(items)
            return
        if self._layout == SEQUENCES:
            self._extend_sequences(items, overlap)
            return
        shard = self.shards[self._next_shard]
        self._next_shard = (self._next_shard + 1) % len(self.shards)
        self._track(shard.rpc_async().extend(items.reshape(-1)))

    def _routes(self, copies: int) -> list[tuple[int, torch.Tensor]]:
        """Each shard and the env copies whose items it takes: copy ``n`` always goes to
        shard ``(first_shard + n) % shards``, where its stream goes on."""
        index = torch.arange(copies)
        route = (index + self._first_shard) % len(self.shards)
        return [(shard, index[route == shard]) for shard in route.unique().tolist()]

    def _stream_writer(self, shard_index: int) -> Any:
        """A shard's asynchronous calls (``rpc_async()``), once its previous stream write is
        done: RPC may run two calls of one caller in either order, and a stream must arrive
        in order."""
        previous = self._frame_writes.pop(shard_index, None)
        if previous is not None:
            previous.wait()
        return self.shards[shard_index].rpc_async()

    def _stream_written(self, shard_index: int, future: torch.futures.Future) -> None:
        self._frame_writes[shard_index] = future
        self._track(future)

    def _extend_frames(self, batch: TensorDictBase) -> None:
        """Each env copy's stream of frames goes on from its previous batch."""
        if not is_frame_stack(batch):
            raise ValueError("stacked pixel observations changed shape or stopped being a frame stack")
        routes = self._routes(batch.shape[0])
        for shard_index, mine in routes:
            part = batch if len(routes) == 1 else batch[mine]
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
            streams = [f"{self._writer}/{n}" for n in mine.tolist()]
            depth = part[OBSERVATION].shape[2]
            shard = self._stream_writer(shard_index)
            self._stream_written(shard_index, shard.extend_frames(rows, frames, counts, streams, depth))

    def _extend_sequences(self, items: TensorDictBase, overlap: int) -> None:
        """Each env copy's sequences go on from its previous one: a sequence whose first
        ``overlap`` observations are the previous one's last sends only the rest."""
        if not is_pixel_sequences(items):
            raise ValueError("sequences of pixel observations changed shape or stopped being pixels")
        length = items[OBSERVATION].shape[2]
        for shard_index, mine in self._routes(items.shape[0]):
            frames, linked, streams = [], [], []
            for n in mine.tolist():
                for observation in items[OBSERVATION][n]:  # this copy's sequences, in order
                    previous = self._newest.get(n)
                    goes_on = overlap > 0 and previous is not None
                    goes_on = goes_on and torch.equal(observation[:overlap], previous)
                    frames.append(observation[overlap:] if goes_on else observation)
                    linked.append(goes_on)
                    streams.append(f"{self._writer}/{n}")
                    self._newest[n] = observation[length - overlap :].clone()  # not a view of the batch
            rows = items[mine].exclude(OBSERVATION).reshape(-1)
            new = torch.cat(frames)
            shard = self._stream_writer(shard_index)
            future = shard.extend_sequences(rows, new, torch.tensor(linked), streams, length, overlap)
            self._stream_written(shard_index, future)

    @timed("sample_wait")
    def sample(self, prefetch: bool = True) -> TensorDictBase:
        """The next batch; with ``prefetch`` the next requests go out as a request arrives."""
        if not self._batches:
            request = self._requests.popleft() if self._requests else self._request()
            self._batches.extend(self._receive(request))
            while prefetch and len(self._requests) < self.requests_ahead:
                self._requests.append(self._request())
        batch = self._batches.popleft()
        self.sampled += batch.numel()
        if PIXELS in batch.keys() and self._layout == SEQUENCES:
            batch[OBSERVATION] = batch.pop(PIXELS)
        elif PIXELS in batch.keys():
            # One uint8 tensor came over the wire; the two stacks are views into it.
            pixels = batch.pop(PIXELS)
            batch[OBSERVATION], batch[NEXT_OBSERVATION] = pixels[:, :-1], pixels[:, 1:]
        return batch

    @timed("priority_update")
    def update_priority(self, batch: TensorDictBase, priorities: torch.Tensor) -> None:
        """Send the new ``priorities`` of the transitions of a sampled ``batch``."""
        if not self.prioritized:
            return
        update = batch.select("index", GENERATION, SHARD).cpu()
        update[PRIORITY] = priorities.reshape(update.shape)
        self._priorities.append(update)
        if len(self._priorities) >= self.batches_per_request:
            self._send_priorities()

    @timed("replay_insert")
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
