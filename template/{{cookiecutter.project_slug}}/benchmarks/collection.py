"""Collection benchmark: the project's collector against the env stepped in a plain loop.

    python benchmarks/collection.py                 # 32 CartPole copies, 192,000 frames
    python benchmarks/collection.py --env HalfCheetah-v5 --envs 8 --frames 80000  # needs .[mujoco]
    python benchmarks/collection.py --env ALE/Pong-v5 --envs 8 --frames 20000 --policies random,network
                                                    # needs .[atari]
    python benchmarks/collection.py --env ALE/Breakout-v5 --envs 8 --frames 20000 --workers 1,2
                                                    # the collector in 1 and in 2 worker processes

All step ``--envs`` copies as one vector env and act with the same policy, in this one
process with one torch thread (a learner's share of a 3-rank run on 2 cores). Each setup's
first ``BATCH_STEPS`` steps (the collectors' first batch, with their set-up) are not timed.
The setups take turns ``--rounds`` times, each on its share of ``--frames``, so that a
change in the machine's load hits all of them alike; each figure is its frames over its
timed seconds, summed over the rounds. Policies:
``network``: for discrete actions DQN's Q network (an MLP; the Nature-DQN convolutions on
Atari frames) with epsilon-greedy exploration, for continuous ones a deterministic MLP actor
with Gaussian noise (both built here, so the benchmark runs in a project generated with any
recipes); ``random``: uniformly random actions. Three ways to collect:

- plain loop: the family's vector env stepped by hand (gymnasium's synchronous vector env;
  for Atari ale-py's ``AtariVectorEnv``, the DQN preprocessing included), numpy observations
  in, one batched forward pass out, nothing kept;
- project collector: ``collector.make_collector`` in sync mode, what a learner runs, on
  the vector env ``--vectorization`` picks (``auto``: for Atari ale-py's vector env too);
- torchrl Collector, default settings: the project's env with same-step autoreset through
  ``Collector`` with its defaults (trajectory ids), for reference.

``--workers 1,2,4``: the project collector with ``collector.workers`` at each of these
counts too (1: the collector above, in this process; K: K worker processes, each with
``--envs / K`` copies and a policy made for as many, one torch thread each), and each
count's frames/s over one process's.

Each setup's ``cores`` is the CPU time it used over its timed seconds: this process's
threads (ale-py's game threads among them) and, for worker setups, the worker processes'
(read from ``/proc``: blank where there is none). Frames/s over cores is what a core
collects in that setup, and bounds what more workers can reach on this machine.

Prints a table and, last, a JSON line.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import gymnasium as gym
import numpy as np
import torch
from omegaconf import OmegaConf
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase, TensorDictSequential
from torch import nn
from torchrl.collectors import Collector
from torchrl.modules import MLP, AdditiveGaussianModule, ConvNet, EGreedyModule, QValueActor

from {{ cookiecutter.package_name }}.collector import make_collector
from {{ cookiecutter.package_name }}.distributed.watchdog import exit_now, exit_status
from {{ cookiecutter.package_name }}.envs import ATARI, atari_vector_settings, family_of, make_env

NOISE = 0.1  # epsilon, or the Gaussian noise's standard deviation
BATCH_STEPS = 32  # collector steps per batch


class Pixels(nn.Module):
    """uint8 frames as floats in [0, 1], as DQN's network takes them."""

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return frames.float().div_(255.0)


def make_policy(env_id: str, num_envs: int) -> tuple[nn.Module, TensorDictModuleBase]:
    """A network, and the exploring torchrl policy around it."""
    env = make_env(env_id, num_envs, seed=0)
    observation_shape = env.observation_spec_unbatched["observation"].shape
    action_spec = env.action_spec
    discrete = not env.action_spec.dtype.is_floating_point
    env.close()
    if len(observation_shape) == 3:  # Atari frames: the Nature-DQN network
        convolutions = ConvNet(
            observation_shape[0], num_cells=[32, 64, 64], kernel_sizes=[8, 4, 3], strides=[4, 2, 1],
            activation_class=nn.ReLU,
        )  # fmt: skip
        features = convolutions(torch.zeros(1, *observation_shape)).shape[-1]
        head = MLP(features, action_spec.shape[-1], num_cells=[512], activation_class=nn.ReLU)
        network = nn.Sequential(Pixels(), convolutions, head)
    else:
        network = MLP(
            observation_shape[0], action_spec.shape[-1], num_cells=[256, 256], activation_class=nn.ReLU
        )
    if discrete:
        actor = QValueActor(network, in_keys=["observation"], spec=action_spec)
        return network, TensorDictSequential(actor, EGreedyModule(action_spec, eps_init=NOISE, eps_end=NOISE))
    network = nn.Sequential(network, nn.Tanh())
    actor = TensorDictModule(network, in_keys=["observation"], out_keys=["action"])
    noise = AdditiveGaussianModule(action_spec, sigma_init=NOISE, sigma_end=NOISE, annealing_num_steps=1)
    return network, TensorDictSequential(actor, noise)


def cpu_seconds() -> float | None:
    """CPU seconds used so far by this process (all its threads) and its live child
    processes (the collector workers), None where a child's cannot be read (no ``/proc``)."""
    total = time.process_time()
    for child in multiprocessing.active_children():
        try:
            with open(f"/proc/{child.pid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # the name before may hold spaces
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return total


def cpu_since(before: float | None) -> float | None:
    """CPU seconds used since ``cpu_seconds()`` read ``before``."""
    now = cpu_seconds()
    return None if before is None or now is None else now - before


def plain_loop(
    network: nn.Module | None, env_id: str, num_envs: int, frames: int
) -> tuple[int, float, float | None]:
    """Frames, seconds and CPU seconds of a hand-written loop: numpy observations in, one batched
    forward pass out (or random actions without a network)."""
    if family_of(env_id) == ATARI:
        envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="vector_entry_point",
                            **atari_vector_settings({}))  # fmt: skip
    else:
        envs = gym.make_vec(
            env_id,
            num_envs=num_envs,
            vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        )
    space = envs.single_action_space
    discrete = isinstance(space, gym.spaces.Discrete)
    rng = np.random.default_rng(0)
    observations, _ = envs.reset(seed=0)
    steps = -(-frames // (BATCH_STEPS * num_envs)) * BATCH_STEPS  # whole batches, as collected
    for step in range(BATCH_STEPS + steps):
        if step == BATCH_STEPS:  # the warm-up is over, as after the collectors' first batch
            started, cpu_before = time.perf_counter(), cpu_seconds()
        if network is None:
            if discrete:
                actions = rng.integers(0, int(space.n), size=num_envs)
            else:
                actions = rng.uniform(space.low, space.high, size=(num_envs, *space.shape))
            observations, *_ = envs.step(actions)
            continue
        inputs = torch.as_tensor(observations)
        with torch.no_grad():  # Atari's uint8 frames go in as they are, like the collector's
            output = network(inputs if inputs.dtype == torch.uint8 else inputs.float())
        if discrete:
            explore = torch.rand(num_envs) < NOISE
            random_actions = torch.randint(0, int(space.n), (num_envs,))
            actions = torch.where(explore, random_actions, output.argmax(-1))
        else:
            actions = (output + NOISE * torch.randn_like(output)).clamp(-1, 1)
        observations, *_ = envs.step(actions.numpy())
    elapsed = time.perf_counter() - started
    cpu = cpu_since(cpu_before)
    envs.close()
    return steps * num_envs, elapsed, cpu


def collector_rate(
    kind: str, policy: TensorDictModuleBase | None, env: dict, num_envs: int, frames: int, workers: int = 1
) -> tuple[int, float, float | None]:
    """Frames, seconds and CPU seconds of a collector, its first batch not counted."""
    frames_per_batch = BATCH_STEPS * num_envs
    total = (-(-frames // frames_per_batch) + 1) * frames_per_batch  # whole batches, and the first
    with workers_watched():
        if kind == "project":
            cfg = OmegaConf.create(
                {
                    "env": {**env, "num_envs": num_envs},
                    "collector": {"frames_per_batch": frames_per_batch, "mode": "sync", "workers": workers},
                }
            )
            collector = make_collector(cfg, policy, seed=0, total_frames=total, device=torch.device("cpu"))
        else:
            same_step = make_env(env, num_envs, seed=0, training=False)
            collector = Collector(same_step, policy, frames_per_batch=frames_per_batch, total_frames=total)
        iterator = iter(collector)
        first: TensorDictBase = next(iterator)  # the first batch includes the collector's set-up
        collected = 0
        started, cpu_before = time.perf_counter(), cpu_seconds()
        for batch in iterator:
            collected += batch.numel()
        elapsed = time.perf_counter() - started
        cpu = cpu_since(cpu_before)
    collector.shutdown()
    assert first.numel() == frames_per_batch
    return collected, elapsed, cpu


@contextmanager
def workers_watched() -> Iterator[None]:
    """Exit with one line if a worker process that the block starts dies: torchrl's
    MultiSyncCollector would wait for it forever, while it starts or for its batch, and this
    script has no watchdog (a learner's stops the run)."""
    done = threading.Event()

    def watch() -> None:
        seen: set[multiprocessing.Process] = set()
        while not done.wait(1.0):
            alive = multiprocessing.active_children()
            seen.update(alive)
            for process in seen.difference(alive):
                if process.exitcode:
                    status = exit_status(process.exitcode)
                    print(f"error: collector worker {process.name} died: {status}", file=sys.stderr)
                    exit_now(1, [])  # the main thread waits in torchrl and cannot be woken

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--envs", type=int, default=32)
    parser.add_argument("--frames", type=int, default=192_000)
    parser.add_argument("--policies", default="network", help="comma-separated: network, random")
    parser.add_argument("--vectorization", default="auto", help="the collectors' env.vectorization")
    parser.add_argument("--rounds", type=int, default=3, help="turns each setup takes, on frames / rounds")
    parser.add_argument("--workers", default="1", help="comma-separated collector.workers counts to measure")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    try:
        workers = sorted({int(count) for count in args.workers.split(",")} | {1})
    except ValueError:
        workers = [0]
    if workers[0] < 1 or any(args.envs % count for count in workers):
        parser.error(f"--workers must be counts >= 1 that divide --envs ({args.envs}), got {args.workers}")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    env = {"id": args.env, "vectorization": args.vectorization}
    result = {"benchmark": "collection", "env": args.env, "vectorization": args.vectorization}
    result.update({"envs": args.envs, "frames": args.frames, "rounds": args.rounds})
    print(f"{'policy':<8} {'setup':<36} {'frames/s':>10} {'vs plain':>9} {'cores':>6}")
    for kind in args.policies.split(","):
        if kind not in ("network", "random"):
            parser.error(f"unknown policy '{kind}' (network, random)")
        network, policy = make_policy(args.env, args.envs) if kind == "network" else (None, None)
        share = args.frames // args.rounds
        setups = {
            "plain": functools.partial(plain_loop, network, args.env, args.envs, share),
            "project": functools.partial(collector_rate, "project", policy, env, args.envs, share),
            "torchrl": functools.partial(collector_rate, "torchrl", policy, env, args.envs, share),
        }
        for count in workers[1:]:
            # A worker steps envs / count copies: its policy is made for as many (the
            # exploration module's spec has their shape), with the same weights.
            worker_network, worker_policy = (
                make_policy(args.env, args.envs // count) if kind == "network" else (None, None)
            )
            if network is not None:
                worker_network.load_state_dict(network.state_dict())
            setups[f"workers={count}"] = functools.partial(
                collector_rate, "project", worker_policy, env, args.envs, share, count
            )
        timed = {name: [0, 0.0, 0.0] for name in setups}
        for _ in range(args.rounds):
            for name, measure in setups.items():
                frames, seconds, cpu = measure()
                timed[name][0] += frames
                timed[name][1] += seconds
                timed[name][2] = None if cpu is None or timed[name][2] is None else timed[name][2] + cpu
        rate = {name: frames / seconds for name, (frames, seconds, _) in timed.items()}
        busy = {name: None if cpu is None else cpu / seconds for name, (_, seconds, cpu) in timed.items()}
        plain, project, torchrl = rate["plain"], rate["project"], rate["torchrl"]
        rows = {
            "plain": "plain loop",
            "project": "project collector",
            "torchrl": "torchrl Collector, default settings",
        }
        rows.update({f"workers={count}": f"project collector, {count} workers" for count in workers[1:]})
        for name, label in rows.items():
            used = f"{busy[name]:>6.2f}" if busy[name] is not None else f"{'':>6}"
            print(f"{kind:<8} {label:<36} {rate[name]:>10.0f} {rate[name] / plain:>9.2f} {used}")
        rates = {"plain_fps": plain, "collector_fps": project, "torchrl_collector_fps": torchrl}
        rates["cores"] = {label: busy[name] for name, label in rows.items()}
        if len(workers) > 1:
            by_count = {count: rate[f"workers={count}"] if count > 1 else project for count in workers}
            rates["workers_fps"] = by_count
            rates["workers_speedup"] = {count: value / project for count, value in by_count.items()}
            for count in workers[1:]:
                print(f"{kind:<8} {count} workers against 1 process: {by_count[count] / project:.2f}")
        # The first policy's figures at the top level (the table's first block), each by name.
        result.setdefault("ratio", project / plain)
        for key, value in rates.items():
            result.setdefault(key, value)
        result[kind] = {**rates, "ratio": project / plain}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
