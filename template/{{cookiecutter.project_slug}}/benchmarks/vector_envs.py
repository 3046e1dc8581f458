"""Atari vector envs against each other: frames/s of random play, by backend and threads.

    python benchmarks/vector_envs.py                # Breakout, 8 games, 1 and 2 threads
    python benchmarks/vector_envs.py --env ALE/Pong-v5 --envs 16 --threads 1,2,4,8,16

The games are the project's (``envs.atari_vector_settings``: 84x84 grey frames stacked by
4, 4 frames a step, up to 30 no-ops, sticky actions as ``--sticky``), played with
uniformly random actions, so that the figure is the env alone. Backends:

- ``ale``: ale-py's ``AtariVectorEnv`` (``env.vectorization=ale``, the project's default
  for Atari), its C++ threads set to each of ``--threads``;
- ``async``: gymnasium's ``AsyncVectorEnv``, one process a game, the same preprocessing
  from gymnasium's wrappers (``env.vectorization=async``);
- ``envpool``: EnvPool's Atari (``pip install envpool``; not one of the project's
  backends), its threads set to each of ``--threads``. Left out where it is not installed.

Each setup's first ``WARM_UP`` steps are not timed. The setups take turns ``--rounds``
times, each on its share of ``--frames``, so that a change in the machine's load hits all
of them alike. Prints a table (frames/s, and each against ale-py's vector env on one
thread) and, last, a JSON line.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import sys
import time

import gymnasium as gym
import numpy as np

from {{ cookiecutter.package_name }}.envs import (
    ATARI,
    atari_preprocessing,
    atari_single_settings,
    atari_vector_settings,
    family_of,
    installed,
    missing_extra,
    register_envs,
)

WARM_UP = 32  # steps


def make_ale(env_id: str, num_envs: int, threads: int, kwargs: dict) -> gym.vector.VectorEnv:
    settings = atari_vector_settings({**kwargs, "num_threads": threads})
    envs = gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="vector_entry_point", **settings)
    envs.reset(seed=0)
    return envs


def make_async(env_id: str, num_envs: int, kwargs: dict) -> gym.vector.VectorEnv:
    envs = gym.make_vec(
        env_id, num_envs=num_envs, vectorization_mode="async", wrappers=[atari_preprocessing],
        **atari_single_settings(kwargs),
    )  # fmt: skip
    envs.reset(seed=0)
    return envs


def make_envpool(env_id: str, num_envs: int, threads: int, kwargs: dict) -> gym.vector.VectorEnv:
    import envpool

    # The same game as atari_vector_settings sets it, in EnvPool's names.
    settings = atari_vector_settings(kwargs)
    envs = envpool.make_gymnasium(
        env_id.removeprefix("ALE/"),
        num_envs=num_envs,
        num_threads=threads,
        seed=0,  # EnvPool seeds its games here; its reset takes no seed
        stack_num=settings["stack_num"],
        img_height=settings["img_height"],
        img_width=settings["img_width"],
        noop_max=settings["noop_max"],
        reward_clip=settings["reward_clipping"],
        episodic_life=settings["episodic_life"],
        use_fire_reset=settings["use_fire_reset"],
        repeat_action_probability=settings["repeat_action_probability"],
    )
    envs.reset()
    return envs


def play(make: functools.partial, frames: int) -> tuple[int, float]:
    """Frames and seconds of random play from the reset that ``make`` made, the warm-up not
    counted."""
    envs = make()
    num_envs = envs.num_envs
    rng = np.random.default_rng(0)
    actions_count = int(envs.single_action_space.n)
    steps = -(-frames // num_envs)
    for step in range(WARM_UP + steps):
        if step == WARM_UP:
            started = time.perf_counter()
        envs.step(rng.integers(0, actions_count, size=num_envs))
    elapsed = time.perf_counter() - started
    envs.close()
    return steps * num_envs, elapsed


def counts(text: str) -> list[int]:
    """``--threads``: comma-separated counts, each at least 1, sorted."""
    try:
        values = sorted({int(value) for value in text.split(",")})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"counts >= 1 separated by commas, got {text!r}")
    return values


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--env", default="ALE/Breakout-v5")
    parser.add_argument("--envs", type=int, default=8)
    parser.add_argument("--frames", type=int, default=48_000)
    parser.add_argument("--threads", type=counts, default="1,2", help="comma-separated counts (ale, envpool)")
    parser.add_argument("--sticky", type=float, default=0.25, help="repeat_action_probability")
    parser.add_argument("--rounds", type=int, default=3, help="turns each setup takes, on frames / rounds")
    args = parser.parse_args()
    if family_of(args.env) != ATARI:
        parser.error(f"--env must be an Atari game (ALE/...), got {args.env}")
    if args.rounds < 1 or args.envs < 1:
        parser.error("--rounds and --envs must be at least 1")
    if not installed("ale_py"):
        sys.exit(f"error: {missing_extra(args.env, ATARI)}")
    register_envs(ATARI)
    kwargs = {"repeat_action_probability": args.sticky}

    game = (args.env, args.envs)
    setups = {}
    for count in args.threads:
        setups[f"ale, {count} threads"] = functools.partial(make_ale, *game, count, kwargs)
    setups["async, a process a game"] = functools.partial(make_async, *game, kwargs)
    has_envpool = importlib.util.find_spec("envpool") is not None
    for count in args.threads if has_envpool else ():
        setups[f"envpool, {count} threads"] = functools.partial(make_envpool, *game, count, kwargs)
    share = args.frames // args.rounds
    timed = {name: [0, 0.0] for name in setups}
    for _ in range(args.rounds):
        for name, make in setups.items():
            frames, seconds = play(make, share)
            timed[name][0] += frames
            timed[name][1] += seconds
    rates = {name: frames / seconds for name, (frames, seconds) in timed.items()}
    baseline = rates[f"ale, {args.threads[0]} threads"]
    print(f"{'backend':<26} {'frames/s':>10} {'vs ale, ' + str(args.threads[0]) + ' threads':>18}")
    for name, rate in rates.items():
        print(f"{name:<26} {rate:>10.0f} {rate / baseline:>18.2f}")
    if not has_envpool:
        print("envpool: not installed (pip install envpool), left out")
    result = {"benchmark": "vector_envs", "env": args.env, "envs": args.envs, "frames": args.frames}
    print(json.dumps({**result, "rounds": args.rounds, "fps": rates}))


if __name__ == "__main__":
    main()
