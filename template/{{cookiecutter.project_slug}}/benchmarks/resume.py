"""Resume benchmark: does a run that stopped halfway and resumed learn like one that did not?

    python benchmarks/resume.py                        # the default recipe, 2 learners, seed 1
    python benchmarks/resume.py --frames 40000 --seeds 1 2

For each seed, three `fabric run`s on CPU: the whole budget in one go; the first half with
a checkpoint at its end; then ``resume=`` from that checkpoint to the whole budget. Prints
the greedy evaluation returns of both at every evaluation and, last, one JSON line.
(The recipe's schedules that follow ``total_frames``, such as a decaying learning rate,
see a shorter budget in the first half.)
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]


def fabric_run(args: argparse.Namespace, run_dir: Path, *overrides: str) -> dict:
    fabric = shutil.which("fabric", path=str(Path(sys.executable).parent)) or "fabric"
    command = [
        fabric,
        *("run", "--accelerator", "cpu", "--strategy", "ddp", "--devices", str(args.devices)),
        *("--main-port", str(args.main_port)),
        "train.py",
        f"recipe={args.recipe}",
        f"eval.every={args.frames // 10}",
        f"run_dir={run_dir}",
        *overrides,
        *args.overrides,
    ]
    result = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(command[1:])} failed:\n{result.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def curve(summary: dict) -> dict[int, float]:
    return {row["frames"]: row["eval_return"] for row in summary["eval_history"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--recipe", default="{{ cookiecutter.default_recipe }}")
    parser.add_argument("--frames", type=int, default=50_000)
    parser.add_argument("--devices", type=int, default=2, help="learner ranks (replay processes come on top)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument(
        "--main-port", type=int, default=29400, help="fabric run's c10d port; RPC takes the next"
    )
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for train.py")
    args = parser.parse_args()

    rows = []
    for seed in args.seeds:
        base = PROJECT / "runs" / "benchmarks" / f"resume-{args.recipe}-seed{seed}"
        shutil.rmtree(base, ignore_errors=True)  # a rerun resumes from its own checkpoints only
        whole = fabric_run(args, base / "whole", f"seed={seed}", f"total_frames={args.frames}")
        half = args.frames // 2
        fabric_run(args, base / "resumed", f"seed={seed}", f"total_frames={half}", f"checkpoint.every={half}")
        resumed = fabric_run(
            args,
            base / "resumed",
            f"seed={seed}",
            f"total_frames={args.frames}",
            f"resume={base / 'resumed'}",
        )
        print(f"seed {seed}: greedy evaluation return by frame (resumed from {resumed['resumed_from']})")
        print(f"{'frames':>8} {'one run':>9} {'resumed':>9}")
        theirs = curve(resumed)
        for frames, value in curve(whole).items():
            print(f"{frames:>8} {value:>9.1f} {theirs.get(frames, float('nan')):>9.1f}")
        rows.append(
            {
                "seed": seed,
                "one_run": {"final": whole["eval_return"], "frames": whole["frames_collected"]},
                "resumed": {"final": resumed["eval_return"], "frames": resumed["frames_collected"]},
                "one_run_curve": curve(whole),
                "resumed_curve": theirs,
            }
        )
    print(json.dumps({"benchmark": "resume", "recipe": args.recipe, "frames": args.frames, "seeds": rows}))


if __name__ == "__main__":
    main()
