"""The learning curve drawn into run_dir at the end of a run."""

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
