"""Validate the answers before cookiecutter writes anything.

Cookiecutter renders this file with the answers, runs it before generation, and removes
the half-written project when it exits non-zero, so one clear line and exit 1 is enough.
Whether the chosen recipes exist is checked after generation (post_gen_project.py), where
the recipe files are at hand.
"""

import keyword
import re
import sys

PROJECT_SLUG = "{{ cookiecutter.project_slug }}"
PACKAGE_NAME = "{{ cookiecutter.package_name }}"
RECIPES = "{{ cookiecutter.recipes }}"
DEFAULT_RECIPE = "{{ cookiecutter.default_recipe }}"


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


if not re.fullmatch(r"[a-z][a-z0-9_]*", PACKAGE_NAME) or keyword.iskeyword(PACKAGE_NAME):
    fail(
        f"package_name {PACKAGE_NAME!r} is not a valid Python package name "
        "(lowercase letters, digits and underscores, starting with a letter)"
    )
if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", PROJECT_SLUG):
    fail(f"project_slug {PROJECT_SLUG!r} is not a valid folder name (letters, digits, '.', '_', '-')")

chosen = [name.strip() for name in RECIPES.split(",") if name.strip()]
if not chosen:
    fail(f"recipes {RECIPES!r} names no recipe")
if DEFAULT_RECIPE not in chosen:
    fail(f"default_recipe {DEFAULT_RECIPE!r} is not among the chosen recipes ({', '.join(chosen)})")
