"""Replay plumbing: the shard keeps every write, priorities come back to the right slots."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from {{ cookiecutter.package_name }}.replay import ReplayClient, ReplayShard
from {{ cookiecutter.package_name }}.topology import LocalRef


def transitions(start: int, count: int) -> TensorDict:
    return TensorDict({"observation": torch.arange(start, start + count, dtype=torch.float32)}, [count])


def make_shard(capacity: int = 1000, batch_size: int = 32) -> ReplayShard:
    return ReplayShard(capacity, alpha=1.0, beta=1.0, batch_size=batch_size, priority_key="td_error")


def test_prioritized_buffer_builds_and_samples_with_weights():
    shard = make_shard()
    shard.extend(transitions(0, 100))
    batch = shard.sample()
    assert batch.batch_size == torch.Size([32])
    assert {"index", "priority_weight", "observation"} <= set(batch.keys())


def test_client_writes_are_all_kept_in_order():
    shard = make_shard()
    client = ReplayClient(LocalRef(shard), max_in_flight=2)
    for start in range(0, 500, 50):
        client.extend(transitions(start, 50))
    client.flush()
    assert shard.stats() == {"size": 500, "inserted": 500}
    stored = shard.buffer[:]["observation"]
    assert torch.equal(stored, torch.arange(500, dtype=torch.float32))


def test_priority_updates_reach_the_sampled_transitions():
    shard = make_shard(batch_size=256)
    client = ReplayClient(LocalRef(shard))
    client.extend(transitions(0, 100))
    client.flush()
    batch = client.sample(prefetch=False)
    # Give one slot nearly all the priority mass: sampling must then return it almost always.
    favourite = int(batch["index"][0])
    priorities = torch.full((100,), 1e-6)
    priorities[favourite] = 1e3
    client.update_priority(TensorDict({"index": torch.arange(100), "td_error": priorities}, [100]))
    client.flush()
    resampled = client.sample(prefetch=False)
    share = (resampled["index"] == favourite).float().mean().item()
    assert share > 0.95, share
    assert torch.equal(resampled["observation"], resampled["index"].float())
