"""cruft: a project made with `cruft create` takes in a later template commit with
`cruft update`. Real cruft and git, on a clone of this repository's committed state."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import REPO

TEMPLATE = Path("template", "{{cookiecutter.project_slug}}")
RECIPES = TEMPLATE / "{{cookiecutter.package_name}}" / "recipes"
ALL_RECIPES = sorted(path.stem for path in (REPO / RECIPES).glob("[!_]*.py"))


@pytest.fixture(autouse=True)
def git_identity(monkeypatch):
    """cruft and the tests run git, which needs a name to commit under on any machine."""
    for role in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{role}_NAME", "test")
        monkeypatch.setenv(f"GIT_{role}_EMAIL", "test@example.com")


def git(cwd: Path, *arguments: str) -> str:
    # Unsigned whatever the machine's git config says: the tests have no key.
    command = ["git", "-c", "commit.gpgsign=false", *arguments]
    return subprocess.run(command, cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def cruft(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cruft", *arguments], capture_output=True, text=True)


def assert_holds_only(project: Path, recipes: list[str]) -> None:
    """The project's recipe modules and recipe tests are those of ``recipes``."""
    modules = sorted(path.stem for path in (project / "my_rl_project" / "recipes").glob("[!_]*.py"))
    tests = [name for name in ALL_RECIPES if (project / "tests" / f"test_{name}.py").exists()]
    assert modules == tests == recipes


@pytest.fixture
def clone(tmp_path) -> Path:
    """The template repository as a user's project would see it: its last commit."""
    git(tmp_path, "clone", "--quiet", str(REPO), "template-repo")
    return tmp_path / "template-repo"


@pytest.mark.parametrize(
    ("context", "recipes"),
    [({}, ALL_RECIPES), ({"recipes": "ppo", "default_recipe": "ppo"}, ["ppo"])],
)
def test_cruft_update_brings_a_template_commit_into_the_project(tmp_path, clone, context, recipes):
    created = cruft(
        "create", str(clone), "--directory", "template", "--no-input",
        "--output-dir", str(tmp_path / "out"), "--extra-context", json.dumps(context),
    )  # fmt: skip
    assert created.returncode == 0, created.stderr[-3000:]
    project = tmp_path / "out" / "my-rl-project"
    package = project / "my_rl_project"

    assert_holds_only(project, recipes)
    state = json.loads((project / ".cruft.json").read_text())
    assert state["commit"] == git(clone, "rev-parse", "HEAD") and state["directory"] == "template"
    record = json.loads((project / ".cookiecutter.json").read_text())
    assert sorted(record["recipes"].split(",")) == recipes
    # cruft applies an update as a three-way merge into the project's own repository.
    git(project, "init", "--quiet")
    git(project, "add", "--all")
    git(project, "commit", "--quiet", "--message", "project")

    # The template's next commit: a line in the project's README, and one in every recipe
    # (those the project did not choose must stay out of it).
    readme_line = "A line from the template's next commit."
    with (clone / TEMPLATE / "README.md").open("a") as readme:
        readme.write(f"\n{readme_line}\n")
    for recipe in (clone / RECIPES).glob("[!_]*.py"):
        recipe.write_text(f"# Changed in the template's next commit.\n{recipe.read_text()}")
    git(clone, "commit", "--quiet", "--all", "--message", "template: next commit")

    check = cruft("check", "--project-dir", str(project))
    assert check.returncode != 0 and "out of date" in check.stdout, check.stdout + check.stderr
    update = cruft("update", "--project-dir", str(project), "--skip-apply-ask")
    assert update.returncode == 0, update.stdout + update.stderr[-3000:]

    assert (project / "README.md").read_text().endswith(f"{readme_line}\n")
    for name in recipes:
        assert (package / "recipes" / f"{name}.py").read_text().startswith("# Changed in the template's")
    assert_holds_only(project, recipes)
    assert not list(project.rglob("*.rej")), "the update did not apply cleanly"
    assert json.loads((project / ".cruft.json").read_text())["commit"] == git(clone, "rev-parse", "HEAD")
    check = cruft("check", "--project-dir", str(project))
    assert check.returncode == 0, check.stdout + check.stderr


def test_cruft_create_with_an_unknown_recipe_fails_cleanly_and_leaves_nothing(tmp_path, clone):
    output = tmp_path / "out"
    output.mkdir()
    created = cruft(
        "create", str(clone), "--directory", "template", "--no-input",
        "--output-dir", str(output), "--extra-context", json.dumps({"recipes": "dqn,nosuch"}),
    )  # fmt: skip
    assert created.returncode != 0
    assert "error: recipes 'dqn,nosuch' must name some of: dqn, ppo, r2d2, sac, td3" in created.stderr
    assert list(output.iterdir()) == []
