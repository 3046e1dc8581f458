"""Prioritized replay: shards in replay processes, and each learner's client for them.

- ``shard.py``: ``ReplayShard``, one prioritized buffer (uniform with ``alpha`` 0) that a
  replay process serves over RPC (or that one process keeps in-process);
- ``client.py``: ``ReplayClient``, a learner's writes (asynchronous) and samples
  (prefetched, drawn across shards by priority), with frames through shared memory from a
  shard on the same machine;
- ``frames.py``: stacked pixel observations stored frame by frame, each frame once;
- ``resharding.py``: a checkpoint's replay dealt onto another number of shards;
- ``sampler_trees.py``: the two reads of torchrl's sampler internals this needs.
"""

from .client import ReplayClient
from .shard import ReplayShard

__all__ = ["ReplayClient", "ReplayShard"]
