"""Collection benchmark: the project's collector against a plain gymnasium loop.

    python benchmarks/collection.py                 # 32 CartPole copies, 192,000 frames
    python benchmarks/collection.py --env HalfCheetah-v5 --envs 8 --frames 80000  # needs .[mujoco]

All step ``--envs`` copies in one synchronous gymnasium vector env and act with the same
network, in this one process with one torch thread (a learner's share of a 3-rank run on
2 cores): for discrete actions DQN's Q network with epsilon-greedy exploration, for
continuous ones a deterministic MLP actor with Gaussian noise (both built here, so the
benchmark runs in a project generated with any recipes). Three ways to collect:

- plain gymnasium loop: numpy observations in, one batched forward pass out, nothing kept;
- project collector: ``collector.make_collector`` in sync mode, what a learner runs;
- torchrl Collector, default settings: the same env and policy through ``Collector`` with
  its defaults (trajectory ids), on a vector env with same-step autoreset, for reference.

Prints a table and, last, a JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import gymnasium as gym
import torch
from omegaconf import OmegaConf
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase, TensorDictSequential
from torch import nn
from torchrl.collectors import Collector
from torchrl.modules import MLP, AdditiveGaussianModule, EGreedyModule, QValueActor

from {{ cookiecutter.package_name }}.collector import as_torchrl, make_collector, make_env

NOISE = 0.1  # epsilon, or the Gaussian noise's standard deviation
BATCH_STEPS = 32  # collector steps per batch


def make_policy(env_id: str, num_envs: int) -> tuple[nn.Module, TensorDictModuleBase]:
    """A network, and the exploring torchrl policy around it."""
    env = make_env(env_id, num_envs, seed=0)
    observations = env.observation_spec["observation"].shape[-1]
    action_spec = env.action_spec
    env.close()
    if isinstance(gym.spec(env_id).make().action_space, gym.spaces.Discrete):
        network = MLP(observations, action_spec.shape[-1], num_cells=[256, 256], activation_class=nn.ReLU)
        actor = QValueActor(network, in_keys=["observation"], spec=action_spec)
        return network, TensorDictSequential(actor, EGreedyModule(action_spec, eps_init=NOISE, eps_end=NOISE))
    network = nn.Sequential(
        MLP(observations, action_spec.shape[-1], num_cells=[256, 256], activation_class=nn.ReLU), nn.Tanh()
    )
    actor = TensorDictModule(network, in_keys=["observation"], out_keys=["action"])
    noise = AdditiveGaussianModule(action_spec, sigma_init=NOISE, sigma_end=NOISE, annealing_num_steps=1)
    return network, TensorDictSequential(actor, noise)


def plain_loop(network: nn.Module, env_id: str, num_envs: int, frames: int) -> float:
    """Frames/s of a hand-written loop: numpy observations in, one batched forward pass out."""
    envs = gym.make_vec(
        env_id,
        num_envs=num_envs,
        vectorization_mode="sync",
        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
    )
    discrete = isinstance(envs.single_action_space, gym.spaces.Discrete)
    observations, _ = envs.reset(seed=0)
    started = time.perf_counter()
    for _ in range(frames // num_envs):
        with torch.no_grad():
            output = network(torch.as_tensor(observations, dtype=torch.float32))
        if discrete:
            explore = torch.rand(num_envs) < NOISE
            random_actions = torch.randint(0, int(envs.single_action_space.n), (num_envs,))
            actions = torch.where(explore, random_actions, output.argmax(-1))
        else:
            actions = (output + NOISE * torch.randn_like(output)).clamp(-1, 1)
        observations, *_ = envs.step(actions.numpy())
    elapsed = time.perf_counter() - started
    envs.close()
    return frames // num_envs * num_envs / elapsed


def collector_rate(kind: str, policy: TensorDictModuleBase, env_id: str, num_envs: int, frames: int) -> float:
    frames_per_batch = BATCH_STEPS * num_envs
    total = -(-frames // frames_per_batch) * frames_per_batch  # whole batches
    if kind == "project":
        cfg = OmegaConf.create(
            {
                "env": {"id": env_id, "num_envs": num_envs},
                "collector": {"frames_per_batch": frames_per_batch, "mode": "sync"},
            }
        )
        collector = make_collector(cfg, policy, seed=0, total_frames=total, device=torch.device("cpu"))
    else:
        vector_env = gym.make_vec(
            env_id,
            num_envs=num_envs,
            vectorization_mode="sync",
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        )
        env = as_torchrl(vector_env, seed=0)
        collector = Collector(env, policy, frames_per_batch=frames_per_batch, total_frames=total)
    iterator = iter(collector)
    first: TensorDictBase = next(iterator)  # the first batch includes the collector's set-up
    collected = 0
    started = time.perf_counter()
    for batch in iterator:
        collected += batch.numel()
    elapsed = time.perf_counter() - started
    collector.shutdown()
    assert first.numel() == frames_per_batch
    return collected / elapsed


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
    network, policy = make_policy(args.env, args.envs)
    plain = plain_loop(network, args.env, args.envs, args.frames)
    project = collector_rate("project", policy, args.env, args.envs, args.frames)
    torchrl = collector_rate("torchrl", policy, args.env, args.envs, args.frames)
    print(f"{'setup':<36} {'frames/s':>10} {'vs plain':>9}")
    for name, rate in (
        ("plain gymnasium loop", plain),
        ("project collector", project),
        ("torchrl Collector, default settings", torchrl),
    ):
        print(f"{name:<36} {rate:>10.0f} {rate / plain:>9.2f}")
    result = {"benchmark": "collection", "env": args.env, "envs": args.envs, "frames": args.frames}
    rates = {"plain_fps": plain, "collector_fps": project, "torchrl_collector_fps": torchrl}
    print(json.dumps({**result, **rates, "ratio": project / plain}))


if __name__ == "__main__":
    main()
