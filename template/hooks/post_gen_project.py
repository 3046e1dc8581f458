"""Copy the chosen recipes from the template repository's ``recipes/`` into the project,
and remove the tests of the recipes that were not chosen.

Recipes live once, as plain Python, at the top of the template repository (where they are
linted and tested in place); a project receives only the ones its author chose.
"""

import shutil
from pathlib import Path

TEMPLATE_DIR = Path("{{ cookiecutter._repo_dir }}")
PACKAGE_NAME = "{{ cookiecutter.package_name }}"
RECIPES = "{{ cookiecutter.recipes }}"


# `_repo_dir` is the local copy of the template folder (".../template"), whether cookiecutter
# was pointed at the repository root or given `--directory template`.
source = TEMPLATE_DIR.parent / "recipes"
if not source.is_dir():
    raise SystemExit(f"error: cannot find the recipes folder next to {TEMPLATE_DIR}")
chosen = {name.strip() for name in RECIPES.split(",") if name.strip()}
target = Path.cwd() / PACKAGE_NAME / "recipes"
for name in sorted(chosen):
    shutil.copy2(source / f"{name}.py", target / f"{name}.py")
for recipe in source.glob("*.py"):
    if recipe.stem not in chosen:
        (Path.cwd() / "tests" / f"test_{recipe.stem}.py").unlink(missing_ok=True)
