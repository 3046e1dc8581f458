"""Baking: names, nothing left unrendered, clean failures, and the project's own tests."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cookiecutter.main import cookiecutter

from .conftest import REPO

UNRENDERED = ("{{ cookiecutter", "{{cookiecutter", "{%")
CPP_FRAME = re.compile(r"^[E >]*\s*frame #\d+: ")  # a line of a C++ stack in torch's warnings


def project_files(project: Path) -> list[Path]:
    return [p for p in project.rglob("*") if "__pycache__" not in p.parts]


def assert_fully_rendered(project: Path) -> None:
    for path in project_files(project):
        relative = str(path.relative_to(project))
        assert not any(mark in relative for mark in UNRENDERED), relative
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            assert not any(mark in text for mark in UNRENDERED), relative


def test_defaults(cookies):
    result = cookies.bake()
    assert result.exit_code == 0, result.exception
    project = result.project_path
    assert project.name == "my-rl-project"
    assert (project / "my_rl_project" / "recipes" / "dqn.py").is_file()
    assert (project / "my_rl_project" / "config.yaml").is_file()
    assert_fully_rendered(project)
    assert "from my_rl_project.train import main" in (project / "train.py").read_text()
    assert "from my_rl_project.evaluate import main" in (project / "evaluate.py").read_text()
    record = json.loads((project / ".cookiecutter.json").read_text())
    assert record["project_name"] == "My RL Project" and record["package_name"] == "my_rl_project"
    assert (project / ".pre-commit-config.yaml").is_file()
    assert "pytest" in (project / ".github" / "workflows" / "tests.yml").read_text()
    slurm = project / "slurm.sh"
    assert slurm.stat().st_mode & 0o111, "slurm.sh must stay executable"
    assert "#SBATCH --job-name=my-rl-project" in slurm.read_text()
    assert subprocess.run(["bash", "-n", str(slurm)]).returncode == 0


def test_names_follow_the_project_name(cookies):
    result = cookies.bake(extra_context={"project_name": "Cart Pole Lab"})
    assert result.exit_code == 0, result.exception
    assert result.project_path.name == "cart-pole-lab"
    assert (result.project_path / "cart_pole_lab" / "learner.py").is_file()
    assert_fully_rendered(result.project_path)


@pytest.mark.parametrize(
    ("project_name", "slug", "package"),
    [
        ("Ünïcode RL-Lab!", "unicode-rl-lab", "unicode_rl_lab"),
        ("3D Pong", "3d-pong", "rl_3d_pong"),
        ("class", "class", "rl_class"),
        ("!!!", "rl-project", "rl_project"),
    ],
)
def test_any_project_name_bakes_a_valid_package(cookies, project_name, slug, package):
    result = cookies.bake(extra_context={"project_name": project_name})
    assert result.exit_code == 0, result.exception
    assert result.project_path.name == slug
    assert (result.project_path / package / "learner.py").is_file()
    assert_fully_rendered(result.project_path)


def test_directory_option_bakes_the_same_project(tmp_path):
    project = Path(cookiecutter(str(REPO), directory="template", no_input=True, output_dir=str(tmp_path)))
    assert project.name == "my-rl-project"
    assert (project / "my_rl_project" / "recipes" / "dqn.py").is_file()
    assert_fully_rendered(project)


def test_generated_code_is_lint_clean(cookies):
    result = cookies.bake(extra_context={"project_name": "Cart Pole Lab"})
    ruff = Path(sys.executable).with_name("ruff")
    check = subprocess.run([str(ruff), "check", "."], cwd=result.project_path, capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


@pytest.mark.parametrize(
    ("context", "message"),
    [
        ({"package_name": "1bad-name"}, "package_name '1bad-name' is not a valid Python package name"),
        ({"package_name": "class"}, "package_name 'class' is not a valid Python package name"),
        ({"recipes": "dqn,nosuch"}, "recipes 'dqn,nosuch' must name some of: dqn, ppo, r2d2, sac"),
        ({"recipes": " , "}, "recipes ' , ' names no recipe"),
        ({"recipes": "dqn", "default_recipe": "ppo"}, "default_recipe 'ppo' is not among the chosen recipes"),
    ],
)
def test_bad_input_fails_cleanly_and_leaves_nothing(tmp_path, context, message):
    args = [f"{key}={value}" for key, value in context.items()]
    result = subprocess.run(
        [sys.executable, "-m", "cookiecutter", "--no-input", str(REPO), "--output-dir", str(tmp_path), *args],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert f"error: {message}" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_one_recipe_project_has_no_trace_of_the_others(cookies):
    result = cookies.bake(extra_context={"recipes": "ppo", "default_recipe": "ppo"})
    assert result.exit_code == 0, result.exception
    project = result.project_path
    assert sorted(p.name for p in (project / "my_rl_project" / "recipes").glob("*.py")) == [
        "__init__.py",
        "_parts.py",
        "ppo.py",
    ]
    assert (
        not (project / "tests" / "test_dqn.py").exists() and not (project / "tests" / "test_sac.py").exists()
    )
    assert (project / "tests" / "test_ppo.py").is_file()
    assert "recipe: ppo" in (project / "my_rl_project" / "config.yaml").read_text()
    for path in project_files(project):
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            for other in ("dqn", "sac"):
                assert not re.search(rf"\b{other}\b", text), f"{path.relative_to(project)} mentions {other}"


# Two test modules at a time: a run's ranks leave a core idle while they wait (start-up,
# heartbeats, a straggler's sleep), and each module keeps its shared runs on one worker.
PARALLEL = ["-n", "2", "--dist", "loadscope"]


def run_tests(project: Path, *arguments: str, python: Path | str = sys.executable) -> str:
    """The project's own pytest with ``arguments``; its output, once it passed."""
    tests = subprocess.run(
        [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *arguments],
        cwd=project,
        capture_output=True,
        text=True,
        # The default suite takes about 20 minutes on a quiet 2-core machine; a loaded one
        # takes longer.
        timeout=3600,
    )
    if tests.returncode != 0:
        # The failed tests' one-line reasons first: a tail alone shows the last failure's end,
        # often torch's C++ warnings, each with its stack of frames, which say nothing here.
        lines = tests.stdout.splitlines()
        failed = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
        tail = "\n".join(line for line in lines if not CPP_FRAME.match(line))[-5000:]
        pytest.fail("\n".join([*failed, tail, tests.stderr[-3000:]]), pytrace=False)
    return tests.stdout


@pytest.mark.slow
def test_generated_project_tests_pass(cookies):
    """The default project's whole suite, slow tests included."""
    result = cookies.bake()
    assert result.exit_code == 0, result.exception
    output = run_tests(result.project_path, *PARALLEL)
    assert " passed" in output.strip().splitlines()[-1]
    # Every env family's extra is installed here; the trackers' extras are not (their tests
    # run in a venv of their own, below).
    skipped_for_an_extra = [line for line in output.splitlines() if "needs the [" in line]
    assert all("test_trackers.py" in line for line in skipped_for_an_extra), output[-3000:]


# The venv with the generated project's [wandb] and [mlflow] extras on top of the main one
# (`make install` builds it; the Makefile says why it is apart). Absolute, as the project's
# tests run in its folder; not resolved, which would follow the venv's python symlink out.
TRACKERS_PYTHON = Path(os.environ.get("TRACKERS_PYTHON", REPO / ".venv-trackers/bin/python")).absolute()


@pytest.mark.slow
def test_generated_project_trackers_keep_a_real_run(cookies):
    """The default project's W&B and MLflow tests, where their extras are installed."""
    assert TRACKERS_PYTHON.is_file(), f"{TRACKERS_PYTHON} is missing: run make install"
    result = cookies.bake()
    assert result.exit_code == 0, result.exception
    output = run_tests(result.project_path, "tests/test_trackers.py", python=TRACKERS_PYTHON)
    assert "4 passed" in output.strip().splitlines()[-1], output[-3000:]


# The generated tests whose outcome depends on which recipes a project has: its config and
# --help, its runs, its checkpoints, evaluating its default recipe's agent, its benchmarks
# (the collection benchmark, which builds its own policies, aside).
RECIPE_DEPENDENT = ["test_config.py", "test_train.py", "test_checkpoint.py", "test_elastic.py",
                    "test_evaluate.py", "test_benchmarks.py", "test_ppo.py", "test_docs.py"]  # fmt: skip
RECIPE_INDEPENDENT = ["tests/test_benchmarks.py::test_collection_benchmark_prints_a_table_and_a_json_line"]


@pytest.mark.slow
def test_one_recipe_project_passes_what_differs_from_the_default_one(cookies):
    """A PPO-only project under another name. Every test module imports and collects in a
    project without a replay recipe; the fast tests whose outcome depends on the recipes
    run (its names, its config and --help, a one-process run of its default recipe, its
    checkpoints and evaluation); and the one distributed path the default project's suite
    does not take: an on-policy run killed and resumed (checkpoints without replay shards).
    The other tests run code that does not depend on the recipes chosen (replay, pixel
    replay, env families, collectors, the recorder, the faults' watchdog), or that the
    default project's multi-rank runs take with ppo among its recipes."""
    context = {"project_name": "Cart Pole Lab", "recipes": "ppo", "default_recipe": "ppo"}
    result = cookies.bake(extra_context=context)
    assert result.exit_code == 0, result.exception
    project = result.project_path
    # Every module is collected (an import error fails the run); only the recipe-dependent
    # ones run.
    modules = sorted(path.name for path in (project / "tests").glob("test_*.py"))
    others = [f"tests/{name}" for name in modules if name not in RECIPE_DEPENDENT]
    deselect = [option for node in [*others, *RECIPE_INDEPENDENT] for option in ("--deselect", node)]
    fast = run_tests(project, *PARALLEL, "-m", "not slow", "tests", *deselect)
    assert " passed" in fast.strip().splitlines()[-1]
    resume = "tests/test_checkpoint.py::test_a_run_killed_mid_training_goes_on_from_its_last_checkpoint"
    assert "1 passed" in run_tests(project, resume)
