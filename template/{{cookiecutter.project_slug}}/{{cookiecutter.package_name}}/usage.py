"""``python train.py --help``: every config key with its value and a one-line description;
``--print-config``: the resolved config, each value with where it came from.

Each description is written once, next to its value:

- run keys: the comment after the key in ``config.yaml`` (the file users read and edit,
  as in lightning-hydra-template); keys a recipe sets (``total_frames``, ``env.*``,
  ``collector.frames_per_batch``) stand there as ``???`` with their comment;
- recipe hyperparameters (``algo.*``): the docstring under each field of the recipe's
  ``Config`` dataclass, as in CleanRL's ``Args``.

The values shown are the resolved ones: ``recipe=<name> --help`` shows that recipe's.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import shutil
import textwrap
from pathlib import Path
from types import ModuleType

from omegaconf import DictConfig, OmegaConf

from .config import CONFIG_YAML

USAGE = "usage: python train.py [--help] [--print-config] [key=value ...]"
# `key: value  # comment`, `key:  # comment` (a section) or `key: value`.
_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_]\w*):(?P<value>[^#]*)(?:#\s?(?P<comment>.*))?$")


# An indented line holding only a comment: it goes on with the comment of the key above.
_MORE = re.compile(r"^ +#\s?(?P<comment>.*)$")


def yaml_comments(path: Path) -> dict[str, str]:
    """Dotted key -> the comment on its line in a YAML file laid out one key per line, with
    the indented comment-only lines right below it that go on with it."""
    text = path.read_text()
    comments, last = {}, None
    for line, (dotted, match) in zip(text.splitlines(), keyed_lines(text), strict=True):
        if dotted and match["comment"]:
            comments[dotted], last = match["comment"].strip(), dotted
        elif last and (more := _MORE.match(line)):
            comments[last] += " " + more["comment"].strip()
        else:
            last = None
    return comments


def keyed_lines(text: str) -> list[tuple[str | None, re.Match | None]]:
    """Each line of YAML ``text`` laid out one key per line: its dotted key and match, or
    ``(None, None)`` for a line that holds no key (a list item, a blank)."""
    lines, parents = [], []  # parents: (indent, key) of the enclosing sections
    for line in text.splitlines():
        match = _LINE.match(line)
        if not match:
            lines.append((None, None))
            continue
        indent = len(match["indent"])
        parents = [(depth, key) for depth, key in parents if depth < indent]
        lines.append((".".join([key for _, key in parents] + [match["key"]]), match))
        parents.append((indent, match["key"]))
    return lines


def annotated_config(cfg: DictConfig, sources: dict[str, str]) -> str:
    """``--print-config``: the resolved config as YAML, each value that did not come from
    config.yaml followed by where it came from, e.g. ``lr: 0.001  # command line``."""
    text = OmegaConf.to_yaml(cfg)
    out = []
    for line, (dotted, _) in zip(text.splitlines(), keyed_lines(text), strict=True):
        source = sources.get(dotted) if dotted else None
        out.append(f"{line}  # {source}" if source and source != CONFIG_YAML else line)
    return "\n".join(out) + "\n"


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring under it in the dataclass ``cls``, on one line."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


# Where descriptions start; a longer key=value puts its description on the next line.
DESCRIPTION_COLUMN = 36


def render(cfg: DictConfig, recipe: ModuleType, defaults: Path) -> str:
    """The help text for the resolved ``cfg``, wrapped to the terminal's width (100 columns
    when the output is not a terminal)."""
    columns = shutil.get_terminal_size((100, 24)).columns
    comments = yaml_comments(defaults)
    values = flatten(OmegaConf.to_container(cfg))
    run = [
        (key, value, comments.get(key, "")) for key, value in values.items() if key.split(".")[0] != "algo"
    ]
    docs = field_docs(recipe.Config)
    algo = [
        (f"algo.{field.name}", values[f"algo.{field.name}"], docs.get(field.name, ""))
        for field in dataclasses.fields(recipe.Config)
    ]
    source = recipe.__name__.replace(".", "/")
    lines = [
        USAGE,
        "",
        *textwrap.wrap(
            f"Override any key as key=value. Run settings ({defaults.name} in {defaults.parent.name}/; "
            "??? there: the recipe's value for the env):",
            columns,
        ),
    ]
    for key, value, text in run:
        lines += entry(f"{key}={value}", text, columns)
    lines += ["", *textwrap.wrap(f"Hyperparameters of recipe '{cfg.recipe}' ({source}.py):", columns)]
    for key, value, text in algo:
        lines += entry(f"{key}={value}", text, columns)
    return "\n".join(lines)


def entry(key_value: str, text: str, columns: int) -> list[str]:
    """``key=value`` and its description wrapped beside it, in ``columns`` columns."""
    head = f"  {key_value}"
    body = textwrap.wrap(text, max(columns - DESCRIPTION_COLUMN, 20))
    if not body:
        return [head]
    indent = " " * DESCRIPTION_COLUMN
    if len(head) >= DESCRIPTION_COLUMN - 1:
        return [head, *(indent + line for line in body)]
    return [head.ljust(DESCRIPTION_COLUMN) + body[0], *(indent + line for line in body[1:])]


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:  # an empty dict (env.kwargs) is a key of its own
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = format_value(value)
    return flat


def format_value(value: object) -> str:
    """As it would be typed on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(format_value(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{}"
    return str(value)
