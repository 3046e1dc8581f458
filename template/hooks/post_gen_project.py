"""Check the chosen recipes exist, then remove the others and their tests from the project.

The recipes on offer are the files in the template's own ``recipes/`` package, which
cookiecutter has just written into the project: checking here, rather than before
generation, needs no list of names to keep in step with the files, and no path to the
template repository (cookiecutter gives one to hooks, cruft does not). Cookiecutter (and
cruft, through it) removes the project when this hook exits non-zero, so an unknown recipe
still leaves nothing behind.
"""

import sys
from pathlib import Path

PACKAGE_NAME = "{{ cookiecutter.package_name }}"
RECIPES = "{{ cookiecutter.recipes }}"

project = Path.cwd()
recipes = project / PACKAGE_NAME / "recipes"
available = sorted(path.stem for path in recipes.glob("*.py") if not path.stem.startswith("_"))
chosen = {name.strip() for name in RECIPES.split(",") if name.strip()}
if chosen - set(available):
    print(f"error: recipes {RECIPES!r} must name some of: {', '.join(available)}", file=sys.stderr)
    sys.exit(1)
for name in available:
    if name not in chosen:
        (recipes / f"{name}.py").unlink()
        (project / "tests" / f"test_{name}.py").unlink(missing_ok=True)
