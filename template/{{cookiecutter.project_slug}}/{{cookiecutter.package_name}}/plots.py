"""The learning curve drawn into run_dir at the end of a run, the curves of several runs in
one figure (benchmarks/curves.py), and frames/s against learners (benchmarks/scaling.py)."""

from __future__ import annotations

from pathlib import Path


def learning_curve(
    path: Path, train: list[tuple[int, float]], evaluation: list[tuple[int, float]], title: str
) -> Path:
    """Training and greedy evaluation returns against frames, as a PNG at ``path``."""
    # Imported here: matplotlib costs every process half a second to import, and only rank
    # 0 draws, once, at the end.
    from matplotlib.figure import Figure

    # Figure without pyplot: no GUI backend, no global state, safe on any rank or thread.
    figure = Figure(figsize=(7, 4), layout="constrained")
    axes = figure.subplots()
    if train:
        axes.plot(*zip(*train, strict=True), alpha=0.7, label="training return (episodes since last row)")
    if evaluation:
        axes.plot(*zip(*evaluation, strict=True), marker="o", label="greedy evaluation return")
    axes.set(xlabel="frames", ylabel="return", title=title)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    figure.savefig(path, dpi=100)
    return path


def compared_curves(
    path: Path, curves: dict[str, list[list[tuple[int, float]]]], title: str
) -> dict[str, list[tuple[int, float]]]:
    """Evaluation returns against frames, as a PNG at ``path``: for each label its runs
    (seeds) as thin lines and their mean as a thick one, one colour per label. Returns
    each label's mean curve (``mean_curve``)."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4), layout="constrained")
    axes = figure.subplots()
    means = {}
    for colour, (label, runs) in enumerate(curves.items()):
        for run in runs:
            axes.plot(*zip(*run, strict=True), color=f"C{colour}", alpha=0.35, linewidth=1)
        mean = means[label] = mean_curve(runs)
        axes.plot(
            *zip(*mean, strict=True),
            color=f"C{colour}",
            linewidth=2.5,
            label=f"{label} (mean of {len(runs)})",
        )
    axes.set(xlabel="frames", ylabel="greedy evaluation return", title=title)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    figure.savefig(path, dpi=100)
    return means


def mean_curve(runs: list[list[tuple[int, float]]]) -> list[tuple[int, float]]:
    """The mean return of ``runs`` at the frames every one of them was evaluated at."""
    points = [dict(run) for run in runs]
    common = sorted(set.intersection(*(set(run) for run in points)))
    return [(frames, sum(run[frames] for run in points) / len(points)) for frames in common]


def scaling(path: Path, rates: dict[str, dict[int, float]], counted: str, title: str) -> Path:
    """Frames/s against the number of ``counted`` (learners, collector workers), as a PNG at
    ``path``: one line per label, and dashed in its colour the linear scaling of its
    smallest count's rate. Both axes logarithmic, so that linear scaling is a straight line
    whatever the rates' sizes."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter

    figure = Figure(figsize=(7, 4), layout="constrained")
    axes = figure.subplots()
    counts = sorted({count for by_count in rates.values() for count in by_count})
    for colour, (label, by_count) in enumerate(rates.items()):
        points = sorted(by_count.items())
        base_count, base_rate = points[0]
        axes.plot(*zip(*points, strict=True), color=f"C{colour}", marker="o", label=label)
        ideal = [(count, base_rate * count / base_count) for count, _ in points]
        axes.plot(*zip(*ideal, strict=True), color=f"C{colour}", linestyle="--", alpha=0.6,
                  label="linear scaling" if colour == 0 else None)  # fmt: skip
    axes.set_xscale("log", base=2)
    axes.set_yscale("log")
    # Plain numbers at 1, 2, 3 and 5 times the powers of ten, not 10^3's minor ticks.
    axes.yaxis.set_major_locator(LogLocator(subs=(1, 2, 3, 5)))
    axes.yaxis.set_major_formatter(StrMethodFormatter("{x:,.0f}"))
    axes.yaxis.set_minor_formatter(NullFormatter())
    axes.set_xticks(counts, [str(count) for count in counts])
    axes.set(xlabel=counted, ylabel="frames/s", title=title)
    axes.grid(alpha=0.3, which="both")
    axes.legend(loc="upper left")
    figure.savefig(path, dpi=100)
    return path
