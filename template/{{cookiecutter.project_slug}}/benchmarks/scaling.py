"""Scaling benchmark: each recipe's frames/s and updates/s on 1, 2, 4 and 8 learners, or on
one learner with 1, 2, 4 and 8 collector workers, and a figure of frames/s against them.

    python benchmarks/scaling.py                      # every recipe, 1 2 4 8 CPU learners (gloo)
    python benchmarks/scaling.py --recipes {{ cookiecutter.default_recipe }} --learners 1 2 --frames 4096
    python benchmarks/scaling.py --accelerator cuda --workers 1 2 4 8   # one GPU learner, K workers
    python benchmarks/scaling.py --learning --recipes {{ cookiecutter.default_recipe }} --learners 1 8   # the per-frame curve, 3 seeds

Each run is benchmarks/speed.py's (the recipe's MuJoCo, MinAtar or Atari workload, one
torch thread per learner, no evaluation) launched by train.py on ``fabric.devices=N``
(``fabric.strategy=ddp``, gloo on the CPU; one learner is the plain one-process run), or,
with ``--workers``, one learner on ``--accelerator`` with the override
``collector.workers=K``. Replay recipes keep ``learners.batch_size_of=run``, the default: N
learners make one learner's updates per frame, so the frames/s compare at the same
learning per frame.

``--frames`` is per learner (by default the recipe's ``FRAMES``), and so is
``--learning-starts`` (a replay recipe's frames before its first update): every learner of
every run collects the same steps, the same share of them before updates begin, and each
rate is measured over as many steps whatever N. With a fixed total, 8 learners would each
make an eighth of the steps, their first ones (DDP's first all-reduce, replay's first
requests) weighing 8 times as much. The price: a run that scales badly takes longer than
one learner's.

The rates are summary.json's: frames and updates over the training time, which starts
once the learner's collector has started (process start-up, imports, rendezvous and the
collector's set-up are left out), less the updates that compiled the loss
(``--mode compiled`` or ``cudagraphs``). Efficiency is frames/s at N over N times one
learner's (one worker's). The phases are each learner's milliseconds per collector step
(``frames_per_batch`` frames, the same at every N: linear scaling keeps every phase's
time): collecting; updating (forward, backward with its all-reduce, optimizers); replay
(inserting, waiting for samples, sending priorities back); agreeing across learners; and
the rest. Prints a table, writes the figure to ``--out`` and, last, prints one JSON line.

``--learning``: instead of speed, whether learning per frame holds on more learners:
benchmarks/learning.py's runs (the recipe's default env and frame budget, or ``--frames``
in all, evaluated 20 times) for each of ``--seeds`` on one learner and on the most of
``--learners``. Prints, at each evaluation, one learner's mean and seed range and the
scaled runs' mean, whether it lies within that range, and draws both sets of curves to
``<out>-learning-<recipe>.png``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import learning
import speed

from {{ cookiecutter.package_name }} import plots, recipes

# Frames per learner and run by default, in whole collector steps: 3 of PPO's 2,048-frame
# rollouts; 24 and 8 steps with updates after the learning start for DQN and SAC or TD3,
# whose learners make N times the updates a step on N learners (learners.batch_size_of=run). Each
# run also starts and stops its processes, which on a 16-core machine took 15 s beside
# the training (one learner) to 55 s (4 learners and a replay process): small budgets keep
# the table within minutes.
{%- set recipes = cookiecutter.recipes.split(",") | map("trim") | list %}
FRAMES = {
{%- if "dqn" in recipes %}
    "dqn": 1_024,
{%- endif %}
{%- if "ppo" in recipes %}
    "ppo": 6_144,
{%- endif %}
{%- if "sac" in recipes %}
    "sac": 768,
{%- endif %}
{%- if "td3" in recipes %}
    "td3": 768,
{%- endif %}
}
OTHER_FRAMES = 4_096  # a recipe added to the project, on CartPole
# The phases of timing.py in the table's columns; the rest of the step is "other".
PHASES = {
    "collect": ("collect", "after_collect"),
    "update": speed.UPDATE_PHASES,
    "replay": ("replay_insert", "sample_wait", "priority_update"),
    "agree": ("agree",),
}
COLUMNS = "{:<6} {:<20} {:>8} {:>7} {:>9} {:>9} {:>6} {:>5} {:>8} {:>10} {:>9} {:>9} {:>8} {:>8}"


def measure(args: argparse.Namespace, recipe: str, count: int) -> dict:
    """One run of ``recipe`` on ``count`` learners (or one learner with ``count`` workers):
    its rates, less compiling, and its phases per step."""
    learners = count if args.axis == "learners" else 1
    per_learner = args.frames or FRAMES.get(recipe, OTHER_FRAMES)
    scaled = argparse.Namespace(
        **{**vars(args), "frames": per_learner * learners, "learning_starts": args.learning_starts * learners}
    )
    extra = [f"fabric.accelerator={args.accelerator}", f"fabric.devices={learners}"]
    if learners > 1:
        extra.append("fabric.strategy=ddp")
    if args.axis == "workers":
        extra.append(f"collector.workers={count}")
    run = speed.train(scaled, recipe, args.mode, tuple(extra), f"scaling-{recipe}-{count}-{args.axis}")
    seconds = run["train_s"] - run["compile_s"]
    step_ms = 1000 * run["train_s"] / run["steps"]
    ms_per_step = run["phase_ms_per_step"]
    phases = {group: sum(ms_per_step.get(name, 0.0) for name in names) for group, names in PHASES.items()}
    phases["other"] = step_ms - sum(phases.values())
    return {
        "env": run["env"],
        "frames": run["frames"],
        "updates": run["updates"],
        "train_s": run["train_s"],
        "compile_s": run["compile_s"],
        "frames_per_s": run["frames"] / seconds,
        "updates_per_s": run["updates"] / seconds,
        "step_ms": step_ms,
        "phase_groups_ms_per_step": phases,
        "phase_ms_per_step": run["phase_ms_per_step"],
    }


def speed_table(args: argparse.Namespace) -> dict:
    """Each recipe at each count, a row as its run ends; the figure; the figures."""
    phases = (f"{name} ms" for name in [*PHASES, "other"])
    print(COLUMNS.format("recipe", "env", args.axis, "train s", "frames/s", "updates/s", "x one", "eff",
                         "step ms", *phases))  # fmt: skip
    figures = {"benchmark": "scaling", "axis": args.axis, "counts": args.counts}
    figures.update({"accelerator": args.accelerator, "mode": args.mode, "frames_per_learner": {}})
    figures["recipes"] = {}
    for recipe in args.recipes:
        figures["frames_per_learner"][recipe] = args.frames or FRAMES.get(recipe, OTHER_FRAMES)
        runs = figures["recipes"][recipe] = {}
        for count in args.counts:
            run = runs[count] = measure(args, recipe, count)
            one = runs[1]["frames_per_s"]
            run["speedup"] = run["frames_per_s"] / one
            run["efficiency"] = run["speedup"] / count
            print(
                COLUMNS.format(
                    recipe, run["env"], count, f"{run['train_s']:.1f}", f"{run['frames_per_s']:.0f}",
                    f"{run['updates_per_s']:.1f}", f"{run['speedup']:.2f}", f"{run['efficiency']:.2f}",
                    f"{run['step_ms']:.0f}", *(f"{ms:.1f}" for ms in run["phase_groups_ms_per_step"].values())
                ),
                flush=True,
            )  # fmt: skip
    rates = {
        f"{recipe} ({runs[1]['env']})": {count: run["frames_per_s"] for count, run in runs.items()}
        for recipe, runs in figures["recipes"].items()
    }
    counted = "learners" if args.axis == "learners" else "collector workers of one learner"
    title = f"{args.accelerator}, {args.mode}, {counted}"
    figures["figure"] = str(plots.scaling(args.out, rates, counted, title))
    print(f"figure: {args.out}")
    return figures


def learning_check(args: argparse.Namespace) -> dict:
    """For each recipe, learning.py's seeds on one learner and on the most of ``--learners``;
    the scaled runs' mean at each evaluation against one learner's seed range."""
    most = max(args.counts)
    figures = {"benchmark": "scaling_learning", "learners": [1, most], "seeds": args.seeds, "recipes": {}}
    for recipe in args.recipes:
        defaults = recipes.load(recipe).RUN_DEFAULTS
        frames = args.frames or defaults["total_frames"]
        curves = {}
        for learners in (1, most):
            setting = argparse.Namespace(
                recipe=recipe, env=defaults["env"]["id"], frames=frames, devices=learners,
                main_port=args.main_port, eval_every=frames // 20, overrides=args.overrides,
                target=learning.TARGETS.get(recipe, float("inf")),
            )  # fmt: skip
            seeds = [learning.run_seed(setting, seed) for seed in args.seeds]
            curves[learners] = [[(int(f), value) for f, value in seed["curve"].items()] for seed in seeds]
        one = [dict(curve) for curve in curves[1]]
        scaled = dict(plots.mean_curve(curves[most]))
        print(f"\n{recipe} on {defaults['env']['id']}, {frames} frames, seeds {args.seeds}")
        print(f"{'frames':>8} {'1 learner':>10} {'range':>17} {f'{most} learners':>11} {'within':>6}")
        rows = []
        for frames_at, mean in plots.mean_curve(curves[1]):
            if frames_at not in scaled:
                continue
            low, high = min(run[frames_at] for run in one), max(run[frames_at] for run in one)
            within = low <= scaled[frames_at] <= high
            rows.append({"frames": frames_at, "one": mean, "low": low, "high": high,
                         "scaled": scaled[frames_at], "within": within})  # fmt: skip
            print(f"{frames_at:>8} {mean:>10.1f} {f'{low:.1f} to {high:.1f}':>17} {scaled[frames_at]:>11.1f} "
                  f"{'yes' if within else 'no':>6}")  # fmt: skip
        inside = sum(row["within"] for row in rows)
        print(f"{most} learners' mean within one learner's seed range at {inside} of {len(rows)} evaluations")
        path = args.out.with_name(f"{args.out.stem}-learning-{recipe}{args.out.suffix}")
        labelled = {"1 learner": curves[1], f"{most} learners": curves[most]}
        plots.compared_curves(path, labelled, f"{recipe}, learning per frame")
        print(f"figure: {path}")
        figures["recipes"][recipe] = {"frames": frames, "evaluations": rows, "within": inside}
        figures["recipes"][recipe]["figure"] = str(path)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipes", nargs="+", default=recipes.available(), choices=recipes.available())
    parser.add_argument("--learners", type=int, nargs="+", help="learner counts (default 1 2 4 8)")
    parser.add_argument("--workers", type=int, nargs="+", help="collector workers of one learner")
    parser.add_argument("--frames", type=int, help="per learner and run (--learning: per run)")
    parser.add_argument("--learning-starts", type=int, default=256, help="replay recipes: per learner")
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--mode", default="eager", choices=list(speed.MODES))
    parser.add_argument("--out", type=Path, default=Path("scaling.png"))
    parser.add_argument("--learning", action="store_true", help="learning per frame instead of speed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="--learning's seeds")
    parser.add_argument("--main-port", type=int, default=29400, help="--learning: fabric run's c10d port")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for train.py")
    args = parser.parse_args()
    if args.learners and args.workers:
        parser.error("--learners and --workers are two tables: give one of them")
    args.axis = "workers" if args.workers else "learners"
    args.counts = sorted(set(args.workers or args.learners or [1, 2, 4, 8]))
    if args.counts[0] < 1:
        parser.error(f"--{args.axis}: counts must be at least 1, got {args.counts[0]}")
    if args.counts[0] != 1:
        parser.error(f"--{args.axis} must include 1: the efficiency is against one")
    if args.frames is not None and args.frames < 1:
        parser.error(f"--frames must be at least 1, got {args.frames}")
    if args.learning and args.workers:
        parser.error("--learning compares learners: give --learners, not --workers")

    figures = learning_check(args) if args.learning else speed_table(args)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
