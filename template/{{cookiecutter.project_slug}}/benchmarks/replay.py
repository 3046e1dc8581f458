"""Replay benchmark: the replay rank over RPC against the same buffer in-process.

    python benchmarks/replay.py                    # batch 256; 1, 2 and 4 learners
    python benchmarks/replay.py --learners 1 8 --shards 2 --batches-per-request 1

Uses the project's ReplayShard and ReplayClient, with the project's defaults. Each learner
first extends for ``--seconds`` (256 CartPole-sized transitions per call), then samples
and sends priorities back for ``--seconds`` (prefetching, as the learner loop does).
Rates are summed over learners. In-process means the same shard and client in this one
process, without RPC. Prints a table and, last, a JSON line.
"""

from __future__ import annotations

import argparse
import json
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict

from {{ cookiecutter.package_name }} import topology
from {{ cookiecutter.package_name }}.replay import ReplayClient, ReplayShard

CAPACITY = 1_000_000
ALPHA, BETA = 0.6, 0.4


def transitions(count: int) -> TensorDict:
    observation = torch.randn(count, 4)
    return TensorDict(
        {
            "observation": observation,
            "action": torch.nn.functional.one_hot(torch.randint(0, 2, (count,)), 2),
            "next": {
                "observation": observation + 0.01,
                "reward": torch.ones(count, 1),
                "done": torch.zeros(count, 1, dtype=torch.bool),
                "terminated": torch.zeros(count, 1, dtype=torch.bool),
            },
        },
        [count],
    )


def measure(client: ReplayClient, batch_size: int, seconds: float) -> dict[str, float]:
    """Extends per second (transitions) and samples per second (transitions sampled and
    re-prioritised) through ``client``."""
    data = transitions(batch_size)
    extended, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        client.extend(data)
        extended += batch_size
    client.flush()
    extend_rate = extended / (time.perf_counter() - started)

    sampled, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        batch = client.sample()
        batch["td_error"] = torch.rand(batch.shape)
        client.update_priority(batch, "td_error")
        sampled += batch_size
    client.flush()
    return {"extends_per_s": extend_rate, "samples_per_s": sampled / (time.perf_counter() - started)}


def make_client(shards: list, args, first_shard: int = 0) -> ReplayClient:
    return ReplayClient(shards, args.batch_size, BETA, args.batches_per_request, first_shard)


def in_process(args) -> dict[str, float]:
    shard = ReplayShard(CAPACITY, ALPHA, BETA, "td_error")
    return measure(make_client([topology.LocalRef(shard)], args), args.batch_size, args.seconds)


def rank_main(rank: int, world_size: int, ports: tuple[int, int], args, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=world_size
    )
    plan = topology.Topology.plan(world_size, rank, replay_ranks=args.shards, uses_replay=True)
    if plan.role == topology.REPLAY:
        shard = ReplayShard(CAPACITY // args.shards, ALPHA, BETA, "td_error", shard=rank)
        topology.host("replay", shard)
    topology.connect(plan, "127.0.0.1", ports[1], timeout_s=120, collective_timeout_s=120)
    if plan.role == topology.LEARNER:
        shards = [topology.handle(plan, owner, "replay") for owner in plan.replay_ranks]
        client = make_client(shards, args, first_shard=plan.learner_index)
        results[rank] = measure(client, args.batch_size, args.seconds)
    topology.disconnect(plan)
    dist.destroy_process_group()


def over_rpc(learners: int, args) -> dict[str, float]:
    ports = (free_port(), free_port())
    with mp.Manager() as manager:
        results = manager.dict()
        world_size = args.shards + learners
        mp.spawn(rank_main, args=(world_size, ports, args, results), nprocs=world_size)
        rows = list(results.values())
    return {key: sum(row[key] for row in rows) for key in ("extends_per_s", "samples_per_s")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--learners", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shards", type=int, default=1, help="replay ranks in the RPC runs")
    parser.add_argument("--batches-per-request", type=int, default=4)
    args = parser.parse_args()
    topology.bind_to_loopback_unless_named("127.0.0.1")

    torch.set_num_threads(1)
    baseline = in_process(args)
    rows = {"in-process": baseline}
    for learners in args.learners:
        rows[f"rpc, {args.shards} shard(s), {learners} learner(s)"] = over_rpc(learners, args)

    print(f"batch {args.batch_size}, {args.batches_per_request} batch(es) per request")
    print(f"{'setup':<32} {'extends/s':>10} {'samples/s':>10} {'vs in-process (samples)':>24}")
    for name, row in rows.items():
        ratio = row["samples_per_s"] / baseline["samples_per_s"]
        print(f"{name:<32} {row['extends_per_s']:>10.0f} {row['samples_per_s']:>10.0f} {ratio:>24.2f}")
    setup = {"batch_size": args.batch_size, "batches_per_request": args.batches_per_request}
    print(json.dumps({"benchmark": "replay", **setup, "shards": args.shards, "rows": rows}))


if __name__ == "__main__":
    main()
