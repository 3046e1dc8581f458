"""docs/adding-a-recipe.md, followed literally: its recipe file, then its commands."""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import PROJECT, command_env, free_port

GUIDE = PROJECT / "docs" / "adding-a-recipe.md"
ON_POLICY = "## An on-policy example: A2C"
NOT_THE_PROJECT = shutil.ignore_patterns("runs", "__pycache__", ".pytest_cache", ".venv", "*.egg-info")


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def guide_commands(text: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def run(command: list[str], project: Path) -> subprocess.CompletedProcess:
    env = {**command_env(), "PYTHONPATH": str(project)}
    return subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=600)


def guide_recipe(text: str, tmp_path: Path) -> tuple[Path, str, str]:
    """A copy of the project with the recipe file that ``text`` saves written into it, and
    nothing else changed: the copy, the file's path in it and its code."""
    target, code = re.search(r"Save this as `([^`]+)`:\s*```python\n(.*?)```", text, re.S).groups()
    project = tmp_path / "project"
    shutil.copytree(PROJECT, project, ignore=NOT_THE_PROJECT)
    before = files(project)
    (project / target).write_text(code)
    after = files(project)
    assert set(after) - set(before) == {target}
    assert all(after[name] == content for name, content in before.items()), "the guide touches one file"
    return project, target, code


def fabric_run(command: str, project: Path, run_dir: Path) -> subprocess.CompletedProcess:
    """The guide's `fabric run`, on a free main port and into ``run_dir``."""
    words = shlex.split(command)
    fabric = shutil.which("fabric", path=str(Path(sys.executable).parent)) or "fabric"
    words[:2] = [fabric, "run", "--main-port", str(free_port())]
    return run([*words, f"run_dir={run_dir}"], project)


@pytest.mark.slow
def test_the_guide_adds_a_recipe_that_trains_on_two_learners(tmp_path):
    text = GUIDE.read_text().split(ON_POLICY)[0]
    project, target, code = guide_recipe(text, tmp_path)

    help_, print_config, fabric_run_command, benchmark, pytest_run = guide_commands(text)
    assert benchmark.startswith("python benchmarks/learning.py")  # minutes per seed: not run here

    shown = run([sys.executable, *shlex.split(help_)[1:]], project)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert re.search(r"algo\.target_update_period=128 +updates between copies of the Q network", shown.stdout)

    shown = run([sys.executable, *shlex.split(print_config)[1:]], project)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert "recipe: double_dqn" in shown.stdout and "updates_per_batch: 128" in shown.stdout

    trained = fabric_run(fabric_run_command, project, tmp_path / "run")
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["roles"] == {"0": "learner", "1": "learner", "2": "replay"}
    assert summary["frames_collected"] == summary["replay_size"] == 2048
    assert summary["updates"] > 0
    assert len(set(summary["learner_param_checksums"].values())) == 1

    tested = run([sys.executable, *shlex.split(pytest_run)[1:], "-p", "no:cacheprovider"], project)
    assert tested.returncode == 0, tested.stdout[-3000:]
    # One-process training, its phases adding up to its wall time, its update under bf16-mixed, its
    # collector acting with a CPU copy of its policy, its RUN_DEFAULTS twice (the command
    # line wins; config.yaml leaves them to it), an env of the other kind refused,
    # --print-config's sources, its --help, its first update checked, a longer run of it
    # kept as the same run, its run on one-hot discrete observations; the guide's fabric run
    # did the rest.
    assert re.search(r"\b12 passed\b", tested.stdout), tested.stdout[-500:]

    # The same recipe without what happens after backward is refused when it loads.
    start = code.index("    def optimizer_step(")
    (project / target).write_text(code[:start].rstrip() + "\n")
    refused = run([sys.executable, "train.py", "recipe=double_dqn", "--print-config"], project)
    assert refused.returncode == 2 and refused.stdout == ""
    expected = "error: recipe double_dqn: Agent has no optimizer_step (see docs/adding-a-recipe.md)\n"
    assert refused.stderr == expected, refused.stderr


@pytest.mark.slow
def test_the_guides_on_policy_recipe_trains_on_two_learners(tmp_path):
    text = GUIDE.read_text().split(ON_POLICY)[1]
    project, _, _ = guide_recipe(text, tmp_path)
    (command,) = guide_commands(text)
    trained = fabric_run(command, project, tmp_path / "run")
    assert trained.returncode == 0, trained.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["roles"] == {"0": "learner", "1": "learner"}
    assert summary["frames_collected"] == 1024
    # One gradient step per rollout: 1024 frames are 4 rollouts of 128 frames per learner.
    assert summary["updates"] == 4
    assert len(set(summary["learner_param_checksums"].values())) == 1
    assert math.isfinite(summary["eval_return"])
