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
    assert shard.stats() == {"size": 500, "inserted": 500, "stale_updates": 0}
    stored = shard.buffer[:]["observation"]
    assert torch.equal(stored, torch.arange(500, dtype=torch.float32))


def favour(client: ReplayClient, batch, slot: int) -> None:
    """Send priorities for ``batch`` that give ``slot`` nearly all the mass."""
    batch["td_error"] = torch.where(batch["index"] == slot, 1e3, 1e-6)
    client.update_priority(batch, "td_error")
    client.flush()


def share_of(client: ReplayClient, slot: int) -> float:
    return (client.sample(prefetch=False)["index"] == slot).float().mean().item()


def full_buffer_and_a_sample() -> tuple[ReplayShard, ReplayClient, TensorDict]:
    shard = make_shard(capacity=100, batch_size=256)
    client = ReplayClient(LocalRef(shard))
    client.extend(transitions(0, 100))
    client.flush()
    return shard, client, client.sample(prefetch=False)


def test_priority_updates_reach_the_sampled_transitions():
    _, client, batch = full_buffer_and_a_sample()
    favourite = int(batch["index"][0])
    favour(client, batch, favourite)
    assert share_of(client, favourite) > 0.95
    resampled = client.sample(prefetch=False)
    assert torch.equal(resampled["observation"], resampled["index"].float())


def test_priority_update_for_an_overwritten_slot_is_dropped():
    shard, client, batch = full_buffer_and_a_sample()
    favourite = int(batch["index"][0])
    client.extend(transitions(100, 100))  # the buffer is full: every slot gets a new occupant
    client.flush()
    favour(client, batch, favourite)
    assert shard.stats()["stale_updates"] == batch.numel()
    # New transitions keep their equal (maximal) priority: the stale update changed nothing.
    assert share_of(client, favourite) < 0.1
