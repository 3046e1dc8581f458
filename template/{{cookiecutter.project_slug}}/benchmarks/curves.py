"""Several settings' learning curves in one figure, from learning.py's output.

    python benchmarks/learning.py --recipe ppo --devices 1 ... > one.log
    python benchmarks/learning.py --recipe ppo --devices 2 ... > two.log
    python benchmarks/curves.py --out curves.png "1 learner=one.log" "2 learners=two.log"

Each argument is LABEL=FILE, FILE the output of one learning.py command (its last line is
the JSON with every seed's evaluations); give a label several files to gather seeds run
one at a time. Draws each seed thin and the label's mean thick, and prints each label's
mean evaluation at every frame count all its seeds share, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(PROJECT))

from {{ cookiecutter.package_name }}.plots import compared_curves  # noqa: E402


def seeds_of(path: Path) -> list[dict]:
    """The seeds of learning.py's JSON line in ``path`` (its last line)."""
    if not path.is_file():
        sys.exit(f"error: no file {path}")
    lines = path.read_text().strip().splitlines()
    try:
        result = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        result = {}
    if result.get("benchmark") != "learning":
        sys.exit(f"error: {path} does not end with learning.py's JSON line")
    return result["seeds"]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", nargs="+", metavar="LABEL=FILE")
    parser.add_argument("--out", type=Path, default=Path("curves.png"))
    parser.add_argument("--title", default="")
    args = parser.parse_args()

    curves: dict[str, list[list[tuple[int, float]]]] = {}
    for argument in args.runs:
        label, separator, file = argument.rpartition("=")
        if not separator or not label:
            parser.error(f"expected LABEL=FILE, got {argument!r}")
        for seed in seeds_of(Path(file)):
            # JSON keys are strings: the frames of each evaluation.
            curves.setdefault(label, []).append(
                [(int(frames), value) for frames, value in seed["curve"].items()]
            )

    means = compared_curves(args.out, curves, args.title)
    for label, mean in means.items():
        print(f"{label} ({len(curves[label])} seeds): " + " / ".join(f"{value:.1f}" for _, value in mean))
    print(f"figure: {args.out}")
    print(json.dumps({"benchmark": "curves", "figure": str(args.out), "means": means}))


if __name__ == "__main__":
    main()
