"""GPU benchmark: each recipe briefly on one GPU, eager, compiled, and compiled with CUDA
graphs, beside LeanRL's H100 figures; with several GPUs, 1, 2 and all of them as learners.

    python benchmarks/gpu.py                          # every recipe, 10,000 frames each run
    python benchmarks/gpu.py --recipes {{ cookiecutter.default_recipe }} --frames 20000

Each run is benchmarks/speed.py's (the recipe's MuJoCo, MinAtar or Atari workload, one
torch thread, updates from ``--learning-starts``, no evaluation) with the learner on
``cuda``: ``compile=false``; ``compile=true``; ``compile=true cudagraphs=true``. It prints
frames/s, updates/s, the milliseconds of one update (forward, backward and optimizers, or
the graph's replay and the optimizers), the compile time and the updates after which
compiling paid for itself. LeanRL's figures (CleanRL's scripts made fast with
torch.compile and CUDA graphs, https://github.com/pytorch-labs/LeanRL, on one H100) are
steps/s of CleanRL's eager script and of LeanRL's compiled one with CUDA graphs, on their
own workloads: a scale to read ours against, not the same run.

With several GPUs it also trains each recipe eagerly on 1, 2 and all of them (one learner
per GPU, ``--frames`` per learner) and prints frames/s and its ratio to one learner's.
Prints tables and, last, one JSON line. Needs a CUDA device; elsewhere it says so and stops.
"""

from __future__ import annotations

import argparse
import json
import sys

import speed
import torch

# LeanRL's README, steps/s on one H100: CleanRL's eager script, LeanRL's compile + CUDA graphs.
{%- set recipes = cookiecutter.recipes.split(",") | map("trim") | list %}
LEANRL = {
    # recipe: (LeanRL's script, its eager steps/s, compiled with CUDA graphs)
{%- if "ppo" in recipes %}
    "ppo": ("ppo_continuous_action", 652, 1_774),
{%- endif %}
{%- if "sac" in recipes %}
    "sac": ("sac_continuous_action", 127, 725),
{%- endif %}
{%- if "td3" in recipes %}
    "td3": ("td3_continuous_action", 272, 936),
{%- endif %}
}
ON_GPU = ("fabric.accelerator=cuda",)


def scaling(args: argparse.Namespace, recipe: str, gpus: int) -> dict[int, dict]:
    """Eager runs of ``recipe`` on 1, 2 and ``gpus`` learners, ``--frames`` per learner.
    With the default ``learners.batch_size_of=run`` a replay recipe makes one learner's updates
    per frame on any number of them: the speed-up is what more GPUs buy at its curve."""
    runs = {}
    for learners in sorted({1, 2, gpus}):
        extra = (*ON_GPU, "fabric.strategy=ddp", f"fabric.devices={learners}")
        frames = argparse.Namespace(**{**vars(args), "frames": args.frames * learners})
        runs[learners] = speed.train(frames, recipe, "eager", extra)
    return runs


def main() -> None:
    args = speed.parse(__doc__, 10_000, list(speed.MODES))
    if not torch.cuda.is_available():
        sys.exit("error: benchmarks/gpu.py needs a CUDA device; torch sees none")

    gpus, device = torch.cuda.device_count(), torch.cuda.get_device_name()
    print(f"{device} x {gpus}, torch {torch.__version__}")
    print(speed.HEADER)
    figures = {"benchmark": "gpu", "device": device, "frames": args.frames, "recipes": {}}
    for recipe in args.recipes:
        figures["recipes"][recipe] = speed.run_modes(args, recipe, ON_GPU)
        if recipe in LEANRL:
            script, eager, fast = LEANRL[recipe]
            print(f"{'':<6} LeanRL, H100: {script} {eager} steps/s eager, {fast} compiled with CUDA graphs")
    if gpus > 1:
        print(f"\n{'recipe':<6} {'learners':>8} {'frames/s':>9} {'x one':>6}")
        for recipe in args.recipes:
            runs = scaling(args, recipe, gpus)
            for learners, run in runs.items():
                ratio = run["frames_per_s"] / runs[1]["frames_per_s"]
                print(f"{recipe:<6} {learners:>8} {run['frames_per_s']:>9.0f} {ratio:>6.2f}")
            figures["recipes"][recipe]["learners"] = runs
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
