"""Collection benchmark: the project's collector against a plain gymnasium loop.

    python benchmarks/collection.py                 # 32 CartPole copies (the default), 192,000 frames
    python benchmarks/collection.py --envs 64 --frames 200000

All step ``--envs`` copies in one synchronous gymnasium vector env and act with the same
Q network and epsilon-greedy exploration (DQN's policy, built here so the benchmark runs
in a project generated with any recipes), in this one process with one torch thread (a
learner's share of a 3-rank run on 2 cores). torchrl's own ``Collector`` on the same env
is measured too, for reference: it is what the project's collector replaces. Prints a
table and, last, a JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import gymnasium as gym
import torch
from tensordict.nn import TensorDictModuleBase, TensorDictSequential
from torch import nn
from torchrl.collectors import Collector
from torchrl.modules import MLP, EGreedyModule, QValueActor

from {{ cookiecutter.package_name }}.collector import VectorCollector, make_env

EPSILON = 0.1


def make_policy(env_id: str, num_envs: int) -> tuple[nn.Module, TensorDictModuleBase]:
    """A Q network, and the epsilon-greedy torchrl policy around it."""
    action_spec = make_env(env_id, num_envs, seed=0).action_spec
    observations = gym.spec(env_id).make().observation_space.shape[0]
    q_network = MLP(observations, action_spec.shape[-1], num_cells=[256, 256], activation_class=nn.ReLU)
    actor = QValueActor(q_network, in_keys=["observation"], spec=action_spec)
    return q_network, TensorDictSequential(
        actor, EGreedyModule(action_spec, eps_init=EPSILON, eps_end=EPSILON)
    )


def plain_loop(q_network: nn.Module, env_id: str, num_envs: int, frames: int, epsilon: float) -> float:
    """Frames/s of a hand-written loop: numpy observations in, one batched forward pass out."""
    envs = gym.make_vec(
        env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    observations, _ = envs.reset(seed=0)
    started = time.perf_counter()
    for _ in range(frames // num_envs):
        with torch.no_grad():
            actions = q_network(torch.as_tensor(observations)).argmax(-1)
        explore = torch.rand(num_envs) < epsilon
        random_actions = torch.randint(0, int(envs.single_action_space.n), (num_envs,))
        actions = torch.where(explore, random_actions, actions)
        observations, *_ = envs.step(actions.numpy())
    elapsed = time.perf_counter() - started
    envs.close()
    return frames // num_envs * num_envs / elapsed


def collector_rate(kind: str, policy: TensorDictModuleBase, env_id: str, num_envs: int, frames: int) -> float:
    env = make_env(env_id, num_envs, seed=0)
    frames_per_batch = 32 * num_envs
    total = -(-frames // frames_per_batch) * frames_per_batch  # whole batches
    if kind == "project":
        collector = VectorCollector(env, policy, frames_per_batch, total, torch.device("cpu"))
    else:
        collector = Collector(
            env,
            policy,
            frames_per_batch=frames_per_batch,
            total_frames=total,
            auto_register_policy_transforms=False,
        )
    collected = 0
    iterator = iter(collector)
    collected += next(iterator).numel()  # the first batch includes the collector's set-up
    started = time.perf_counter()
    for batch in iterator:
        collected += batch.numel()
    elapsed = time.perf_counter() - started
    collector.shutdown()
    return (collected - frames_per_batch) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--env", default="CartPole-v1")
    parser.add_argument("--envs", type=int, default=32)
    parser.add_argument("--frames", type=int, default=192_000)
    args = parser.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(1)
    q_network, policy = make_policy(args.env, args.envs)
    plain = plain_loop(q_network, args.env, args.envs, args.frames, epsilon=EPSILON)
    project = collector_rate("project", policy, args.env, args.envs, args.frames)
    torchrl = collector_rate("torchrl", policy, args.env, args.envs, args.frames)
    print(f"{'setup':<32} {'frames/s':>10} {'vs plain':>9}")
    for name, rate in (
        ("plain gymnasium loop", plain),
        ("project collector", project),
        ("torchrl Collector", torchrl),
    ):
        print(f"{name:<32} {rate:>10.0f} {rate / plain:>9.2f}")
    result = {"benchmark": "collection", "env": args.env, "envs": args.envs, "frames": args.frames}
    rates = {"plain_fps": plain, "collector_fps": project, "torchrl_collector_fps": torchrl}
    print(json.dumps({**result, **rates, "ratio": project / plain}))


if __name__ == "__main__":
    main()
