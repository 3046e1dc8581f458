"""Replay benchmark: replay processes over RPC against the same buffer in-process.

    python benchmarks/replay.py                    # batch 256; 1, 2 and 4 learners
    python benchmarks/replay.py --learners 1 8 --shards 2 --batches-per-request 1
    python benchmarks/replay.py --atari --learners 1 2   # Pong frames, batch 32 (needs [atari])
    python benchmarks/replay.py --alpha 0 --learners 1   # uniform shards: no sum tree, no priorities sent

Uses the project's ReplayShard and ReplayClient, with the project's defaults (with
``--atari``, DQN's on Atari: 8 batches of 32 per request). Each learner first extends for
``--seconds`` (256 CartPole-sized transitions per call; with ``--atari``, collector batches
of real Pong frames, 4 env copies x 32 steps, stored frame by frame), then samples and
sends priorities back for ``--seconds`` (prefetching, as the learner loop does; with
``--alpha 0`` the shards draw uniformly and the client sends none). Rates are summed over
learners. In-process means the same shard and client in this one process, without RPC.
With ``--atari`` the RPC runs are made twice: the sampled frames come through shared
memory (as from a replay process on the learner's machine) and over the socket (as from
one on another machine); it also prints what one stored transition costs in memory
against storing both stacks. Prints a table and, last, a JSON line.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from tensordict import TensorDict
from torchrl.collectors import Collector

from {{ cookiecutter.package_name }}.distributed import topology
from {{ cookiecutter.package_name }}.envs import EnvUnavailable, make_env
from {{ cookiecutter.package_name }}.replay import ReplayClient, ReplayShard
from {{ cookiecutter.package_name }}.replay.frames import NEXT_OBSERVATION, OBSERVATION

CAPACITY = 1_000_000
ATARI_CAPACITY = 50_000  # per shard: the bytes per transition do not depend on it
BETA = 0.4
ATARI_ENVS, ATARI_STEPS = 4, 32


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


def pong_batches(count: int, seed: int) -> list[TensorDict]:
    """``count`` collector batches ``[env copies, steps]`` of Pong with a random policy,
    from the env training steps (ale-py's preprocessing: 84x84 grey, 4-frame stack)."""
    try:
        env = make_env("ALE/Pong-v5", ATARI_ENVS, seed)
    except EnvUnavailable as error:
        sys.exit(f"error: {error}")
    frames = ATARI_ENVS * ATARI_STEPS
    collector = Collector(
        env, None, frames_per_batch=frames, total_frames=frames * count, track_traj_ids=False,
        auto_register_policy_transforms=False,
    )  # fmt: skip
    keys = [
        OBSERVATION,
        "action",
        NEXT_OBSERVATION,
        ("next", "reward"),
        ("next", "done"),
        ("next", "terminated"),
    ]
    batches = [batch.select(*keys) for batch in collector]
    collector.shutdown()
    return batches


def stored_bytes(shard: ReplayShard) -> float:
    """Bytes one transition takes in ``shard``: its row, its share of the frames (the shard
    keeps as many frames as transitions), its write count and its two priority-tree leaves
    (prioritized shards)."""
    row = shard.buffer.storage.get(torch.arange(1)).bytes()
    leaves = 2 * 4 if shard.prioritized else 0
    return row + frame_bytes(shard) + shard.generation.element_size() + leaves


def frame_bytes(shard: ReplayShard) -> int:
    return shard.frames.frames[0].nbytes if shard.frames.frames is not None else 0


def measure(client: ReplayClient, data: list[TensorDict], seconds: float) -> dict[str, float]:
    """Extends per second (transitions) and samples per second (transitions sampled and
    re-prioritised) through ``client``; ``data`` is written over and over."""
    extended, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        batch = data[(extended // data[0].numel()) % len(data)]
        client.extend(batch)
        extended += batch.numel()
    client.flush()
    extend_rate = extended / (time.perf_counter() - started)

    sampled, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        batch = client.sample()
        client.update_priority(batch, torch.rand(batch.shape))
        sampled += batch.numel()
    client.flush()
    return {"extends_per_s": extend_rate, "samples_per_s": sampled / (time.perf_counter() - started)}


def make_client(shards: list, args, first_shard: int = 0, share_frames: bool = False) -> ReplayClient:
    return ReplayClient(
        shards,
        args.batch_size,
        BETA,
        args.batches_per_request,
        first_shard,
        requests_ahead=args.requests_ahead,
        share_frames=share_frames,
        prioritized=args.alpha > 0,
    )


def workload(args, seed: int) -> list[TensorDict]:
    if args.atari:
        return pong_batches(args.atari_batches, seed)
    return [transitions(args.batch_size)]


def make_shard(args, capacity: int, shard: int = 0) -> ReplayShard:
    return ReplayShard(min(capacity, ATARI_CAPACITY) if args.atari else capacity, args.alpha, BETA, shard)


def in_process(args, data: list[TensorDict]) -> tuple[dict[str, float], dict[str, float]]:
    """The rates, and what one stored transition costs (Atari)."""
    shard = make_shard(args, CAPACITY)
    rates = measure(make_client([topology.LocalRef(shard)], args), data, args.seconds)
    footprint = {}
    if args.atari:
        transitions_in = shard.stats()["inserted"]
        naive = 2 * data[0][OBSERVATION][0, 0].numel()  # both stacks, uint8
        footprint = {
            "bytes_per_transition": stored_bytes(shard),
            "naive_bytes_per_transition": naive + stored_bytes(shard) - frame_bytes(shard),
            "frames_per_transition": shard.frames.written / transitions_in,
        }
    return rates, footprint


def rank_main(rank: int, learners: int, ports: tuple[int, int], args, share_frames: bool, results) -> None:
    """Learners first, then the replay processes, as in a run; written out rather than
    planned, since a run with one learner keeps its buffer in-process."""
    torch.set_num_threads(1)
    world_size = learners + args.shards
    plan = topology.Topology(rank, world_size, tuple(range(learners, world_size)), tuple(range(learners)))
    if plan.role == topology.LEARNER:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{ports[0]}", rank=rank, world_size=learners
        )
    else:
        topology.host("replay", make_shard(args, CAPACITY // args.shards, shard=rank - learners))
    data = workload(args, seed=rank) if plan.role == topology.LEARNER else None
    topology.connect(plan, "127.0.0.1", ports[1], timeout_s=120, collective_timeout_s=120)
    if plan.role == topology.LEARNER:
        shards = [topology.handle(plan, owner, "replay") for owner in plan.replay_ranks]
        client = make_client(shards, args, plan.learner_index, share_frames)
        results[rank] = measure(client, data, args.seconds)
        dist.destroy_process_group()
    topology.disconnect(plan)


def over_rpc(learners: int, args, share_frames: bool) -> dict[str, float]:
    ports = (free_port(), free_port())
    with mp.Manager() as manager:
        results = manager.dict()
        ranks = learners + args.shards
        mp.spawn(rank_main, args=(learners, ports, args, share_frames, results), nprocs=ranks)
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
    parser.add_argument("--batch-size", type=int, help="transitions per sample (default 256; --atari 32)")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--learners", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shards", type=int, default=1, help="replay processes in the RPC runs")
    parser.add_argument(
        "--batches-per-request", type=int, help="batches per request (default 4; --atari 8, DQN's on Atari)"
    )
    parser.add_argument("--requests-ahead", type=int, default=1, help="sample requests kept in flight")
    parser.add_argument("--atari", action="store_true", help="Pong frames instead of CartPole transitions")
    parser.add_argument("--alpha", type=float, default=0.6, help="the shards' replay.alpha (0: uniform)")
    parser.add_argument(
        "--atari-batches", type=int, default=8, help="--atari: Pong batches collected per learner"
    )
    args = parser.parse_args()
    args.batch_size = args.batch_size or (32 if args.atari else 256)
    args.batches_per_request = args.batches_per_request or (8 if args.atari else 4)
    topology.bind_to_loopback_unless_named("127.0.0.1")

    torch.set_num_threads(1)
    data = workload(args, seed=0)
    before, footprint = in_process(args, data)
    rows = {"in-process, before": {**before, "learners": 1}}
    # Pixels: a run's learners get the frames through shared memory from the replay
    # processes on their machine, over the socket from the others'. Both are measured.
    paths = {"": True} if not args.atari else {", shared memory": True, ", socket": False}
    for learners in args.learners:
        for path, share_frames in paths.items():
            rows[f"rpc, {args.shards} shard(s), {learners} learner(s){path}"] = {
                **over_rpc(learners, args, share_frames),
                "learners": learners,
            }
    # Measured again after the RPC runs, and the faster of the two is the baseline: on a
    # machine shared with other jobs, one measurement can fall on a busy moment.
    rows["in-process, after"] = {**in_process(args, data)[0], "learners": 1}
    baseline = max(
        rows["in-process, before"], rows["in-process, after"], key=lambda row: row["samples_per_s"]
    )

    workload_name = "Pong frames (uint8 4x84x84)" if args.atari else "CartPole transitions"
    print(
        f"{workload_name}; alpha {args.alpha}; batch {args.batch_size}, "
        f"{args.batches_per_request} batch(es) per request, "
        f"{args.requests_ahead} request(s) ahead"
    )
    print(
        f"{'setup':<46} {'extends/s':>10} {'samples/s':>10} {'vs in-process':>14} "
        f"{'per learner':>12} {'vs in-process':>14}"
    )
    for name, row in rows.items():
        per_learner = row["samples_per_s"] / row["learners"]
        total, each = (
            row["samples_per_s"] / baseline["samples_per_s"],
            per_learner / baseline["samples_per_s"],
        )
        print(
            f"{name:<46} {row['extends_per_s']:>10.0f} {row['samples_per_s']:>10.0f} {total:>14.2f} "
            f"{per_learner:>12.0f} {each:>14.2f}"
        )
    if footprint:
        print(
            f"bytes per stored transition: {footprint['bytes_per_transition']:,.0f} "
            f"(both stacks stored: {footprint['naive_bytes_per_transition']:,.0f}); "
            f"frames written per transition {footprint['frames_per_transition']:.3f}"
        )
    setup = {
        "batch_size": args.batch_size,
        "batches_per_request": args.batches_per_request,
        "requests_ahead": args.requests_ahead,
        "atari": args.atari,
        "alpha": args.alpha,
    }
    print(json.dumps({"benchmark": "replay", **setup, "shards": args.shards, "rows": rows, **footprint}))


if __name__ == "__main__":
    main()
