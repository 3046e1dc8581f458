"""The project as a package: `pip install .` holds everything a run needs, and a run works
from that install alone, away from the project folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from {{ cookiecutter.package_name }} import recipes

from .conftest import (
    PROJECT,
    REPLAY_RECIPE,
    failure_report,
    free_port,
    needs_replay,
    read_summary,
    tiny_overrides,
)

PACKAGE = "{{ cookiecutter.package_name }}"
SCRIPTS = "{{ cookiecutter.project_slug }}"


def build_wheel(destination: Path) -> Path:
    """The wheel `pip install .` builds, made from a copy of the project folder (a build
    leaves build/ and *.egg-info behind)."""
    source = destination / "source"
    ignore = shutil.ignore_patterns("runs", ".git", "__pycache__", "*.egg-info")
    shutil.copytree(PROJECT, source, ignore=ignore)
    # The build backend (setuptools) of this environment: no download.
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet"]
    build += ["--wheel-dir", str(destination), str(source)]
    result = subprocess.run(build, capture_output=True, text=True)
    assert result.returncode == 0, failure_report(result)
    (wheel,) = destination.glob("*.whl")
    return wheel


def fresh_venv(path: Path) -> Path:
    """A new virtual environment that sees this one's packages (torch and the rest of the
    project's dependencies) but not the project folder; its python."""
    venv.create(path, with_pip=False)
    python = path / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_the_wheel_holds_every_module_and_the_default_config(tmp_path):
    wheel = zipfile.ZipFile(build_wheel(tmp_path))
    names = wheel.namelist()
    sources = sorted(
        path.relative_to(PROJECT).as_posix()
        for path in (PROJECT / PACKAGE).rglob("*")
        if path.suffix in {".py", ".yaml"} and "__pycache__" not in path.parts
    )
    missing = [name for name in sources if name not in names]
    assert not missing, f"the wheel lacks {missing}"
    assert f"{PACKAGE}/recipes/{recipes.available()[0]}.py" in names
    assert not [name for name in names if name.startswith(("tests/", "benchmarks/"))]
    entry_points = next(name for name in names if name.endswith("entry_points.txt"))
    scripts = wheel.read(entry_points).decode()
    assert f"{SCRIPTS}-train = {PACKAGE}.train:main" in scripts
    assert f"{SCRIPTS}-evaluate = {PACKAGE}.evaluate:main" in scripts


@pytest.mark.slow
@needs_replay
def test_an_installed_project_trains_two_learners_and_evaluates_away_from_its_folder(tmp_path):
    wheel = build_wheel(tmp_path / "dist")
    python = fresh_venv(tmp_path / "venv")
    # --no-index: every dependency the wheel declares must already be satisfied.
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-index", "--quiet"]
    result = subprocess.run([*install, str(wheel)], capture_output=True, text=True)
    assert result.returncode == 0, failure_report(result)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(PYTHONUNBUFFERED="1", MASTER_PORT=str(free_port()))
    where = subprocess.run(
        [str(python), "-c", f"import {PACKAGE}; print({PACKAGE}.__file__)"],
        cwd=elsewhere, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert str(tmp_path / "venv") in where, where

    run_dir = elsewhere / "runs" / "installed"
    train = [str(python), "-m", f"{PACKAGE}.train", "fabric.devices=2", "fabric.accelerator=cpu"]
    train += ["fabric.strategy=ddp"]
    trained = subprocess.run(
        [*train, *tiny_overrides(REPLAY_RECIPE), f"run_dir={run_dir}"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    summary = read_summary(trained)
    assert sorted(summary["roles"].values()) == ["learner", "learner", "replay"]
    assert summary["frames_collected"] == 3072
    assert (run_dir / "checkpoints" / "final.pt").is_file()

    evaluate = tmp_path / "venv" / "bin" / f"{SCRIPTS}-evaluate"
    evaluated = subprocess.run(
        [str(evaluate), f"checkpoint={run_dir}", "episodes=2"],
        cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert evaluated.returncode == 0, failure_report(evaluated)
    assert evaluated.stdout.startswith("return ") and (run_dir / "evaluation.json").is_file()
