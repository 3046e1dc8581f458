"""Replay: shards keep every write, priorities come back to the right slots, and sampling
across shards is distributed like sampling one buffer with the same contents."""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, TensorDictPrioritizedReplayBuffer

from {{ cookiecutter.package_name }}.distributed.topology import (
    LocalRef,
    Topology,
    bind_to_loopback_unless_named,
    connect,
    disconnect,
    handle,
    host,
)
from {{ cookiecutter.package_name }}.learner import NonFinite, checked_priorities
from {{ cookiecutter.package_name }}.replay import ReplayClient, ReplayShard
from {{ cookiecutter.package_name }}.replay.shard import GENERATION, SHARD, WEIGHT

from .conftest import free_port

ALPHA, BETA = 0.7, 0.5


def transitions(start: int, count: int) -> TensorDict:
    return TensorDict({"observation": torch.arange(start, start + count, dtype=torch.float32)}, [count])


def make_shards(count: int, capacity: int = 1000) -> list[ReplayShard]:
    return [ReplayShard(capacity, ALPHA, BETA, shard=shard) for shard in range(count)]


def client_of(shards: list[ReplayShard], batch_size: int = 32, **kwargs) -> ReplayClient:
    return ReplayClient([LocalRef(shard) for shard in shards], batch_size, BETA, **kwargs)


def test_shard_samples_with_weights_and_reports_its_priority_mass():
    # The shard reads torchrl's private segment trees; this pins what it reads.
    (shard,) = make_shards(1)
    shard.extend(transitions(0, 100))
    priorities = torch.linspace(0.5, 5.0, 100)
    shard.buffer.update_priority(torch.arange(100), priorities)
    batch, total, lowest = shard.sample(32)
    assert batch.batch_size == torch.Size([32])
    assert {"index", WEIGHT, GENERATION, SHARD, "observation"} <= set(batch.keys())
    transformed = priorities.double() ** ALPHA
    assert total == pytest.approx(float(transformed.sum()), rel=1e-5)
    assert lowest == pytest.approx(float(transformed.min()), rel=1e-5)
    expected = (transformed[batch["index"]] / transformed.min()) ** -BETA
    torch.testing.assert_close(batch[WEIGHT].double(), expected, rtol=1e-4, atol=0)
    assert shard.sample(0)[0] is None


def test_client_writes_are_all_kept_in_order():
    (shard,) = make_shards(1)
    client = client_of([shard], max_in_flight=2)
    for start in range(0, 500, 50):
        client.extend(transitions(start, 50))
    client.flush()
    assert shard.stats() == {"size": 500, "inserted": 500, "stale_updates": 0, "shared_memory_readers": 0}
    assert torch.equal(shard.buffer[:]["observation"], torch.arange(500, dtype=torch.float32))


def test_four_concurrent_writers_over_two_shards_lose_nothing():
    shards = make_shards(2)
    chunks, chunk = 25, 10

    def write(writer: int) -> None:
        client = client_of(shards, first_shard=writer, max_in_flight=4)
        for step in range(chunks):
            client.extend(transitions((writer * chunks + step) * chunk, chunk))
        client.flush()

    threads = [threading.Thread(target=write, args=(writer,)) for writer in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    sizes = [shard.stats()["size"] for shard in shards]
    assert sizes == [500, 500]  # writes alternate between shards
    stored = torch.cat([shard.buffer[:]["observation"] for shard in shards]).sort().values
    assert torch.equal(stored, torch.arange(4 * chunks * chunk, dtype=torch.float32))


def favour(client: ReplayClient, batch, key: str, value: float) -> None:
    """Send priorities for ``batch`` that give the rows where ``key`` is ``value`` nearly
    all the mass."""
    client.update_priority(batch, torch.where(batch[key] == value, 1e6, 1e-6))
    client.flush()


def share_of(client: ReplayClient, key: str, value: float) -> float:
    return (client.sample(prefetch=False)[key] == value).float().mean().item()


def filled(shard_count: int, capacity: int) -> tuple[list[ReplayShard], ReplayClient, TensorDict]:
    shards = make_shards(shard_count, capacity)
    client = client_of(shards, batch_size=256)
    for start in range(0, 100 * shard_count, 100):
        client.extend(transitions(start, 100))
    client.flush()
    return shards, client, client.sample(prefetch=False)


@pytest.mark.parametrize("shard_count", [1, 3])
def test_priority_updates_reach_the_sampled_transitions(shard_count):
    shards, client, batch = filled(shard_count, capacity=100)
    favourite = float(batch["observation"][-1])
    favour(client, batch, "observation", favourite)
    assert share_of(client, "observation", favourite) > 0.95
    resampled = client.sample(prefetch=False)
    for shard in range(shard_count):  # every row comes from the slot its index names
        rows = resampled[resampled[SHARD] == shard]
        assert torch.equal(rows["observation"], shards[shard].buffer[rows["index"]]["observation"])


def test_priority_update_for_an_overwritten_slot_is_dropped():
    (shard,), client, batch = filled(1, capacity=100)
    slot = int(batch["index"][0])
    client.extend(transitions(100, 100))  # the buffer is full: every slot gets a new occupant
    client.flush()
    favour(client, batch, "index", slot)
    assert shard.stats()["stale_updates"] == batch.numel()
    # New transitions keep their equal (maximal) priority: the stale update changed nothing.
    assert share_of(client, "index", slot) < 0.1


def test_a_learner_stops_at_non_finite_priorities_before_they_reach_a_shard():
    """One NaN in a shard's sum tree and every later sample is garbage: the learner checks
    each update's priorities (with its loss) before it steps or sends them."""
    loss = torch.tensor(0.5)
    priorities = torch.tensor([1.0, 2.0])
    assert torch.equal(checked_priorities(loss, priorities, "frame 1, update 1"), priorities)
    assert checked_priorities(loss, None, "frame 1, update 1") is None  # on-policy: no priorities
    with pytest.raises(NonFinite, match=r"^non-finite priorities at frame 7, update 3$"):
        checked_priorities(loss, torch.tensor([1.0, float("nan")]), "frame 7, update 3")
    with pytest.raises(NonFinite, match=r"^non-finite loss \(inf\) at frame 7, update 3$"):
        checked_priorities(torch.tensor(float("inf")), priorities, "frame 7, update 3")


def test_sampling_across_shards_matches_one_buffer_with_the_same_contents():
    torch.manual_seed(0)
    # Three shards of different sizes and priority scales: sampling them equally would be
    # far from sampling their union by priority.
    sizes, scales = [10, 20, 30], [8.0, 1.0, 0.2]
    shards = make_shards(3)
    ids, priorities = [], []
    start = 0
    for shard, size, scale in zip(shards, sizes, scales, strict=True):
        shard.extend(transitions(start, size))
        shard_priorities = scale * (0.5 + torch.rand(size))
        shard.buffer.update_priority(torch.arange(size), shard_priorities)
        ids.append(torch.arange(start, start + size))
        priorities.append(shard_priorities)
        start += size
    ids, priorities = torch.cat(ids), torch.cat(priorities)

    one_buffer = TensorDictPrioritizedReplayBuffer(alpha=ALPHA, beta=BETA, storage=LazyTensorStorage(100))
    one_buffer.extend(transitions(0, len(ids)))
    one_buffer.update_priority(torch.arange(len(ids)), priorities)
    reference = one_buffer.sample(20_000)
    reference_weight = dict(
        zip(reference["observation"].long().tolist(), reference[WEIGHT].tolist(), strict=True)
    )

    client = client_of(shards, batch_size=256, batches_per_request=8)
    draws = torch.cat([client.sample() for _ in range(320)])  # 81,920 draws
    counts = torch.bincount(draws["observation"].long(), minlength=len(ids)).double()

    transformed = priorities.double() ** ALPHA
    expected = counts.sum() * transformed / transformed.sum()
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    dof = len(ids) - 1
    # A 6-sigma bound of the chi-square distribution with `dof` degrees of freedom.
    assert chi_square < dof + 6 * (2 * dof) ** 0.5, chi_square
    # The test has power: an equal share per shard is rejected by far.
    shard_of = torch.repeat_interleave(torch.arange(3), torch.tensor(sizes))
    shard_mass = torch.zeros(3, dtype=torch.float64).index_add_(0, shard_of, transformed)
    equal_shares = counts.sum() / 3 * transformed / shard_mass[shard_of]
    assert float(((counts - equal_shares) ** 2 / equal_shares).sum()) > 100 * (dof + 6 * (2 * dof) ** 0.5)

    # Importance weights are normalised over all shards, as one buffer normalises them.
    for row in draws[:2000]:
        assert float(row[WEIGHT]) == pytest.approx(reference_weight[int(row["observation"])], rel=1e-4)


def test_uniform_shards_draw_every_transition_alike_and_get_no_priorities():
    """With alpha 0 a shard draws with torchrl's RandomSampler: batches carry no importance
    weights, a shard's mass is its size (so a batch across shards of different sizes draws
    every transition alike), and the client sends no priorities back."""
    torch.manual_seed(0)
    shards = [ReplayShard(1000, 0.0, BETA, shard=shard) for shard in range(2)]
    shards[0].extend(transitions(0, 10))
    shards[1].extend(transitions(10, 30))
    batch, total, lowest = shards[1].sample(16)
    assert {"index", GENERATION, SHARD} <= set(batch.keys()) and WEIGHT not in batch.keys()
    assert (total, lowest) == (30.0, 1.0)

    client = client_of(shards, batch_size=256, batches_per_request=8, prioritized=False)
    draws = [client.sample() for _ in range(160)]  # 40,960 draws
    with warnings.catch_warnings():
        # A priority reaching a uniform shard would make torchrl warn.
        warnings.simplefilter("error")
        client.update_priority(draws[0], torch.rand(256))
        client.flush()
    counts = torch.bincount(torch.cat(draws)["observation"].long(), minlength=40).double()
    expected = counts.sum() / 40
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    dof = 39
    assert chi_square < dof + 6 * (2 * dof) ** 0.5, chi_square  # 6 sigma, as above


def surface_a_remote_error(rank: int, ports: tuple[int, int], result: dict) -> None:
    """Rank 0 is the learner, rank 1 a replay process (which, as in a run, is in no process
    group: it joins the RPC world only)."""
    plan = Topology(rank, world_size=2, replay_ranks=(1,), learner_ranks=(0,))
    if plan.role == "learner":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=0, world_size=1)
    else:
        host("replay", ReplayShard(100, ALPHA, BETA))
    connect(plan, "127.0.0.1", ports[1], timeout_s=60, collective_timeout_s=60)
    if plan.role == "learner":
        client = ReplayClient([handle(plan, 1, "replay")], batch_size=8, beta=BETA)
        client.extend(transitions(0, 10))
        client.extend(TensorDict({"observation": torch.zeros(10, 3)}, [10]))  # the wrong shape
        try:
            client.flush()
        except Exception as error:  # the replay process's error, carried back by the future
            result["error"] = str(error)
        dist.destroy_process_group()
    disconnect(plan)


def test_an_error_in_the_replay_process_surfaces_on_the_learner():
    bind_to_loopback_unless_named("127.0.0.1")
    with mp.Manager() as manager:
        result = manager.dict()
        mp.spawn(surface_a_remote_error, args=((free_port(), free_port()), result), nprocs=2)
        assert "shape" in result.get("error", ""), dict(result)
