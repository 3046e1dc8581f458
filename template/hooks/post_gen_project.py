"""Copy the chosen recipes from the template repository's ``recipes/`` into the project.

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
target = Path.cwd() / PACKAGE_NAME / "recipes"
for name in (n.strip() for n in RECIPES.split(",") if n.strip()):
    shutil.copy2(source / f"{name}.py", target / f"{name}.py")
