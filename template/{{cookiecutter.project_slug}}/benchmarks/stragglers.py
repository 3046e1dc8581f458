"""Stragglers benchmark: DD-PPO's straggler threshold against lockstep collection.

    python benchmarks/stragglers.py                        # frames/s, collector.sync_frac=1 vs 0.6
    python benchmarks/stragglers.py --seeds 1 2 3          # also: learning, with and without the threshold
    python benchmarks/stragglers.py --frames 20000 --step-ms 4
    python benchmarks/stragglers.py --env MinAtar/Breakout-v1 --frames 30000  # pixels

An on-policy recipe (PPO, its defaults and those of ``--env``'s family) on CartPole-v1 or
``--env`` with 3 learners (``fabric run``, CPU), one of which (rank ``--slow-rank``) has
environments ``--slowdown`` times slower than the others': the first run collects in
lockstep (``collector.sync_frac=1``), the second with the threshold (``--sync-frac``);
both report frames/s from their summary.json.
With ``--seeds``, each seed then trains with the straggler for ``--learning-frames``
frames, in lockstep and with the threshold, and reports for each whether its greedy
evaluation reached ``--target``, and the lowest of its last three evaluations: a curve
that reaches the target and falls back has not learnt.

CartPole and MinAtar step in microseconds, so "4 times slower" needs a simulator's cost
first: every rank's env takes ``--step-ms`` per step, the straggler's ``--slowdown`` times
that. The cost is a sleep, so that it takes no core from the ranks sharing the machine's
cores (a busy loop would make the ranks' speeds depend on the load instead of the
slowdown). This is the benchmark's business, not the product's: importing this module
registers ``StragglerCartPole-v1`` (or, for ``--env MinAtar/Breakout-v1``,
``MinAtar/StragglerBreakout-v1``), the env with a wrapper that sleeps ``SIMULATOR_STEP_S``
per step, or ``STRAGGLER_STEP_S`` in the process whose ``RANK`` is ``STRAGGLER_RANK``;
train.py reaches it through gymnasium's ``module:EnvId`` form of ``env.id``.
Prints a table and, last, a JSON line. Beside another benchmark, give it another ``--main-port``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
from gymnasium.envs.registration import WrapperSpec

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))

from {{ cookiecutter.package_name }} import recipes  # noqa: E402
from {{ cookiecutter.package_name }}.envs import EnvUnavailable, family_of  # noqa: E402

BASE_ENV = "CartPole-v1"
TARGET = 475.0


class Simulated(gym.Wrapper):
    """Sleeps ``SIMULATOR_STEP_S`` per step, or ``STRAGGLER_STEP_S`` on rank ``STRAGGLER_RANK``.

    The delay is owed per step and slept in slices of at least a millisecond: a sleep of a
    few tens of microseconds oversleeps by more than itself.
    """

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        slow = os.environ.get("RANK", "0") == os.environ.get("STRAGGLER_RANK")
        self.delay = float(os.environ.get("STRAGGLER_STEP_S" if slow else "SIMULATOR_STEP_S", "0"))
        self.owed = 0.0

    def step(self, action):
        self.owed += self.delay
        if self.owed >= 1e-3:
            started = time.perf_counter()
            time.sleep(self.owed)
            self.owed -= time.perf_counter() - started
        return self.env.step(action)


def straggler_id(env_id: str) -> str:
    """``CartPole-v1``: ``StragglerCartPole-v1``; ``MinAtar/Breakout-v1``: ``MinAtar/StragglerBreakout-v1``"""
    namespace, _, name = env_id.rpartition("/")
    return f"{namespace}/Straggler{name}" if namespace else f"Straggler{name}"


def register(env_id: str) -> None:
    """``env_id``'s registration under ``straggler_id``, with the wrapper: the same entry
    point, so the project gives it its family's defaults (``family_of`` registers the
    family's ids first)."""
    family_of(env_id)
    spec = gym.spec(env_id)
    wrapper = WrapperSpec("Simulated", f"{__name__}:Simulated", {})
    gym.register(
        straggler_id(env_id),
        spec.entry_point,
        reward_threshold=spec.reward_threshold,
        max_episode_steps=spec.max_episode_steps,
        additional_wrappers=(*spec.additional_wrappers, wrapper),
        kwargs=spec.kwargs,
    )


# The benchmark names its base env to the training processes through the environment.
base_env = os.environ.get("STRAGGLER_BASE_ENV", BASE_ENV)
if straggler_id(base_env) not in gym.registry:
    register(base_env)


def train(args: argparse.Namespace, name: str, seed: int, overrides: list[str], step_ms: float) -> dict:
    run_dir = PROJECT / "runs" / "benchmarks" / f"stragglers-{name}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: train.py refuses another run's checkpoints
    fabric = shutil.which("fabric", path=str(Path(sys.executable).parent)) or "fabric"
    command = [
        fabric,
        "run",
        "--accelerator",
        "cpu",
        "--strategy",
        "ddp",
        "--devices",
        "3",
        "--main-port",
        str(args.main_port),
        "train.py",
        f"recipe={args.recipe}",
        f"env.id=benchmarks.stragglers:{straggler_id(args.env)}",
        f"seed={seed}",
        f"run_dir={run_dir}",
        *overrides,
        *args.overrides,
    ]
    environment = {
        **os.environ,
        "STRAGGLER_BASE_ENV": args.env,
        "SIMULATOR_STEP_S": str(step_ms / 1000),
        "STRAGGLER_RANK": str(args.slow_rank),
        "STRAGGLER_STEP_S": str(args.slowdown * step_ms / 1000),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT), os.environ.get("PYTHONPATH")])),
    }
    result = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, env=environment)
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(command[1:])} failed:\n{result.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def rollouts(summary: dict) -> dict:
    """Per learner: frames, rollouts, how many were cut, and the mean fraction collected."""
    rows = summary["learner_rollouts"].items()
    return {rank: {key: round(value, 3) for key, value in row.items()} for rank, row in rows}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    on_policy = [name for name in recipes.available() if not recipes.load(name).Agent.uses_replay]
    if not on_policy:
        sys.exit("error: this project has no on-policy recipe")
    parser.add_argument("--recipe", default=on_policy[0], choices=on_policy)
    parser.add_argument(
        "--env", default=BASE_ENV, help="the gymnasium id the ranks step (its family's defaults)"
    )
    parser.add_argument("--frames", type=int, default=15_000, help="frames of each throughput run")
    parser.add_argument("--step-ms", type=float, default=2.0, help="every rank's env step, milliseconds")
    parser.add_argument("--slowdown", type=float, default=4.0, help="the straggler's env step / the others'")
    parser.add_argument("--slow-rank", type=int, default=2)
    parser.add_argument("--sync-frac", type=float, default=0.6)
    parser.add_argument("--seeds", type=int, nargs="*", default=[], help="learning runs with the threshold")
    parser.add_argument("--learning-frames", type=int, default=200_000)
    parser.add_argument("--learning-step-ms", type=float, default=0.5, help="--step-ms of the learning runs")
    parser.add_argument("--target", type=float, default=TARGET)
    parser.add_argument(
        "--main-port", type=int, default=29400, help="fabric run's c10d port; RPC takes the next"
    )
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for train.py")
    args = parser.parse_args()
    try:
        family_of(args.env)
    except EnvUnavailable as error:
        sys.exit(f"error: --env: {error}")

    straggler_ms = args.slowdown * args.step_ms
    print(f"{args.env}, env step: {args.step_ms:g} ms, rank {args.slow_rank}'s {straggler_ms:g} ms")
    throughput = {}
    short = [f"total_frames={args.frames}", "eval.every=0", "eval.episodes=2"]
    header = f"{'sync_frac':>9} {'frames/s':>9} {'frames':>7} {'updates':>7}"
    print(f"{header}  per rank: rollouts cut / rollouts, mean fraction collected")
    for sync_frac in (1.0, args.sync_frac):
        overrides = [*short, f"collector.sync_frac={sync_frac}"]
        summary = train(args, f"sync{sync_frac:g}", 1, overrides, args.step_ms)
        throughput[f"sync_frac={sync_frac:g}"] = {
            "frames_per_s": round(summary["frames_per_s"], 1),
            "frames": summary["frames_collected"],
            "updates": summary["updates"],
            "train_s": round(summary["train_s"], 1),
            "rollouts": rollouts(summary),
        }
        cuts = ", ".join(
            f"{rank}: {row['cut']}/{row['rollouts']} {row['mean_fraction']:.2f}"
            for rank, row in summary["learner_rollouts"].items()
        )
        print(
            f"{sync_frac:>9g} {summary['frames_per_s']:>9.0f} {summary['frames_collected']:>7} "
            f"{summary['updates']:>7}  {cuts}",
            flush=True,
        )
    baseline, threshold = (row["frames_per_s"] for row in throughput.values())
    print(f"speed-up with the threshold: {threshold / baseline:.2f}x")

    learning = []
    for seed in args.seeds:
        for sync_frac in (1.0, args.sync_frac):
            overrides = [
                f"total_frames={args.learning_frames}",
                f"eval.every={args.learning_frames // 20}",
                f"collector.sync_frac={sync_frac}",
            ]
            summary = train(
                args, f"learning-seed{seed}-sync{sync_frac:g}", seed, overrides, args.learning_step_ms
            )
            history = [row["eval_return"] for row in summary["eval_history"]]
            reached = next(
                (row for row in summary["eval_history"] if row["eval_return"] >= args.target), None
            )
            learning.append(
                {
                    "seed": seed,
                    "sync_frac": sync_frac,
                    "reached": reached is not None,
                    "frames_to_target": reached["frames"] if reached else None,
                    "last_three_min": min(history[-3:]),
                    "final_eval_return": summary["eval_return"],
                    "frames": summary["frames_collected"],
                    "frames_per_s": round(summary["frames_per_s"], 1),
                    "wall_s": round(summary["wall_s"], 1),
                    "curve": history,
                    "rollouts": rollouts(summary),
                }
            )
            row = learning[-1]
            print(
                f"seed {seed}, sync_frac={sync_frac:g}: reached {args.target:g}: {row['reached']} at "
                f"{row['frames_to_target']} frames, last three at least {row['last_three_min']:.1f}, "
                f"final {row['final_eval_return']:.1f}, {row['frames_per_s']:.0f} frames/s, "
                f"{row['wall_s']} s",
                flush=True,
            )
    print(
        json.dumps(
            {
                "benchmark": "stragglers",
                "recipe": args.recipe,
                "env": args.env,
                "slowdown": args.slowdown,
                "step_ms": args.step_ms,
                "learning_step_ms": args.learning_step_ms,
                "throughput": throughput,
                "speedup": round(threshold / baseline, 3),
                "learning": learning,
                "all_held": all(row["last_three_min"] >= args.target for row in learning)
                if learning
                else None,
            }
        )
    )


if __name__ == "__main__":
    main()
