"""Speed benchmark: one learner's frames/s and updates/s per recipe, eager and compiled.

    python benchmarks/speed.py                          # every recipe on its workload, 20,000 frames
    python benchmarks/speed.py --recipes {{ cookiecutter.default_recipe }} --frames 40000
    python benchmarks/speed.py --modes eager            # no torch.compile

Each recipe trains in one process with one torch thread on the workload a user of its
family would run (the MuJoCo, MinAtar or Atari settings of its ``FAMILY_DEFAULTS``, which
need the project's extras), with updates from early on (``--learning-starts`` for replay
recipes) and no evaluation: ``compile=false``, then ``compile=true`` (benchmarks/gpu.py adds
``cudagraphs=true`` on a GPU). For each it prints
frames/s, updates/s, the milliseconds of one update (forward, backward and optimizers, from
the run's phase timings), the seconds compiling took and, for compile, the updates after
which it has paid for itself. Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))

from omegaconf import OmegaConf  # noqa: E402

from {{ cookiecutter.package_name }} import recipes  # noqa: E402

# Each recipe's workload: the env a user of its family trains on.
{%- set recipes = cookiecutter.recipes.split(",") | map("trim") | list %}
WORKLOADS = {
{%- if "dqn" in recipes %}
    "dqn": "MinAtar/Breakout-v1",
{%- endif %}
{%- if "ppo" in recipes %}
    "ppo": "Hopper-v5",
{%- endif %}
{%- if "sac" in recipes %}
    "sac": "HalfCheetah-v5",
{%- endif %}
{%- if "td3" in recipes %}
    "td3": "Hopper-v5",
{%- endif %}
}
UPDATE_PHASES = ("forward", "backward", "graph", "optimizer")
# Each mode's overrides: cudagraphs (a CUDA device only) compiles the loss too, as LeanRL does.
MODES = {
    "eager": ["compile=false", "cudagraphs=false"],
    "compiled": ["compile=true", "cudagraphs=false"],
    "cudagraphs": ["compile=true", "cudagraphs=true"],
}


def train(
    args: argparse.Namespace, recipe: str, mode: str, extra: tuple[str, ...] = (), run_name: str | None = None
) -> dict:
    """One run of ``recipe`` in ``mode`` (and ``extra`` overrides) in runs/benchmarks/``run_name``
    (by default speed-<recipe>-<mode>): its figures, from summary.json."""
    run_dir = PROJECT / "runs" / "benchmarks" / (run_name or f"speed-{recipe}-{mode}")
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: train.py refuses another run's checkpoints
    command = [
        sys.executable,
        "train.py",
        f"recipe={recipe}",
        f"env.id={WORKLOADS.get(recipe, 'CartPole-v1')}",
        f"total_frames={args.frames}",
        "threads=1",
        "eval.episodes=0",  # none: an untrained agent can play an Atari game to its 108,000-frame cap
        *MODES[mode],
        f"run_dir={run_dir}",
    ]
    module = recipes.load(recipe)
    if module.Agent.uses_replay:
        command += [f"algo.learning_starts={args.learning_starts}"]
        if "random_frames" in {field.name for field in dataclasses.fields(module.Config)}:
            command += [f"algo.random_frames={args.learning_starts}"]
    command += [*extra, *args.overrides]
    result = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(command[1:])} failed:\n{result.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    # Each learner's collector steps, over which summary.json averages its phases (with
    # several learners frames_collected counts all of theirs).
    rollouts = [learner["rollouts"] for learner in summary["learner_rollouts"].values()]
    steps = sum(rollouts) / len(rollouts)
    update_s = sum(summary["phase_ms_per_step"].get(name, 0.0) for name in UPDATE_PHASES) * steps / 1000
    return {
        "env": OmegaConf.load(run_dir / "config.yaml").env.id,  # the workload's, unless overridden
        "frames": summary["frames_collected"],
        "steps": steps,
        "train_s": summary["train_s"],
        "frames_per_s": summary["frames_per_s"],
        "updates_per_s": summary["updates_per_s"],
        "updates": summary["updates"],
        # The first update of a compiled loss is its compile time, not counted here.
        "update_ms": 1000 * update_s / max(summary["updates"] - (mode != "eager"), 1),
        "compile_s": summary["compile_s"],
        "phase_ms_per_step": summary["phase_ms_per_step"],
    }


HEADER = "{:<6} {:<20} {:<10} {:>8} {:>9} {:>10} {:>10} {:>10} {:>11}".format(
    "recipe", "env", "mode", "train s", "frames/s", "updates/s", "ms/update", "compile s", "pays after"
)


def print_row(recipe: str, mode: str, run: dict, eager: dict | None) -> None:
    """One run's row; a compiled one also gets the updates after which its compile time
    is paid back by its faster updates (``pays_after_updates``), against ``eager``."""
    pays = "-"
    if mode != "eager" and eager is not None:
        saved_ms = eager["update_ms"] - run["update_ms"]
        run["pays_after_updates"] = round(1000 * run["compile_s"] / saved_ms) if saved_ms > 0 else None
        pays = f"{run['pays_after_updates']} upd" if run["pays_after_updates"] else "never"
    print(
        f"{recipe:<6} {run['env']:<20} {mode:<10} {run['train_s']:>8.1f} "
        f"{run['frames_per_s']:>9.0f} {run['updates_per_s']:>10.1f} {run['update_ms']:>10.2f} "
        f"{run['compile_s']:>10.1f} {pays:>11}",
        flush=True,
    )


def run_modes(args: argparse.Namespace, recipe: str, extra: tuple[str, ...] = ()) -> dict[str, dict]:
    """``recipe`` in each of ``args.modes``, eager first (the others' reference), each
    row printed as its run ends: mode -> figures."""
    runs = {}
    for mode in sorted(args.modes, key=list(MODES).index):
        runs[mode] = train(args, recipe, mode, extra)
        print_row(recipe, mode, runs[mode], runs.get("eager"))
    return runs


def parse(description: str, frames: int, modes: list[str]) -> argparse.Namespace:
    """The command line of this benchmark and of gpu.py: ``frames`` per run by default, the
    modes it may run."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipes", nargs="+", default=recipes.available(), choices=recipes.available())
    parser.add_argument("--frames", type=int, default=frames)
    parser.add_argument(
        "--learning-starts", type=int, default=2_000, help="replay recipes: frames before the first update"
    )
    parser.add_argument("--modes", nargs="+", default=modes, choices=modes)
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for train.py")
    return parser.parse_args()


def main() -> None:
    args = parse(__doc__, 20_000, ["eager", "compiled"])

    print(HEADER)
    figures = {"benchmark": "speed", "frames": args.frames, "recipes": {}}
    for recipe in args.recipes:
        figures["recipes"][recipe] = run_modes(args, recipe)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
