"""The configuration key reference, generated from the config dataclasses.

Run: ``python -m slidedp.docs_config`` (rewrites ``docs/configuration.md``) or
``python -m slidedp.docs_config --check`` (exit 1 when the page is stale).

The tree is walked from ``TrainConfig`` generically: every dataclass field is a key, a field
whose type is a dataclass is a sub-section (its keys are ``section.sub.key``). Types, defaults and
allowed values (``Literal``) come from the annotations; each key's one-line description comes
from ``docs/config_keys.yaml`` (keyed by ``section.key``; a section may have an entry too).
Invariant: every key has a description and every description names a key (``problems``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from slidedp.config import TrainConfig, config_from_dict, config_to_dict

REPO = Path(__file__).resolve().parents[2]
DESCRIPTIONS = REPO / "docs" / "config_keys.yaml"
PAGE = REPO / "docs" / "configuration.md"
COMMAND = "python -m slidedp.docs_config"


@dataclass(frozen=True)
class Key:
    """One configuration key: its dotted path, type in words and default as YAML shows it."""

    path: str
    type_text: str
    default_text: str


def _is_dataclass_type(hint: Any) -> bool:
    return isinstance(hint, type) and dataclasses.is_dataclass(hint)


def type_text(hint: Any) -> str:
    """A short type for the table: ``int``, ```a` | `b```, ``bool | null``, ``list[str]``."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (Union, types.UnionType):
        return " \\| ".join(type_text(a) for a in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(type_text(a) for a in args)}]"
    if hint is type(None):
        return "null"
    if hint is Any:
        return "any"
    return str(getattr(hint, "__name__", hint))


def default_text(field: dataclasses.Field[Any]) -> str:
    """The default as YAML writes it; required keys and computed defaults say so."""
    if field.default == "":
        return '`""`'
    if field.default is not dataclasses.MISSING:
        dumped = yaml.safe_dump(field.default, default_flow_style=True).strip()
        dumped = dumped.removesuffix("\n...").removesuffix("...").strip()
        return f"`{dumped}`"
    if field.default_factory is not dataclasses.MISSING:
        return "computed"  # e.g. depends on an installed package: see the description
    return "**required**"


def _placeholder(hint: Any) -> Any:
    """A valid value of a required key's type (the resolved defaults need one)."""
    if get_origin(hint) is Literal:
        return get_args(hint)[0]
    return {str: "placeholder", int: 1, float: 1.0, bool: False}.get(hint)


def _required(cls: type[Any]) -> dict[str, Any]:
    """The required keys of ``cls`` (recursively) with placeholder values, as YAML nests them."""
    hints = typing.get_type_hints(cls)
    raw: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        required = field.default is dataclasses.MISSING
        if required and field.default_factory is dataclasses.MISSING:
            hint = hints[field.name]
            raw[field.name] = _required(hint) if _is_dataclass_type(hint) else _placeholder(hint)
    return raw


def resolved_defaults() -> dict[str, Any]:
    """The resolved config of the required keys alone: every key as YAML spells it."""
    raw = _required(TrainConfig)
    # the data needs one source, `path` or `sources`, though neither key alone is required
    raw.setdefault("data", {})["path"] = "placeholder"
    return config_to_dict(config_from_dict(raw))


def walk(
    cls: type[Any], prefix: str = "", tree: dict[str, Any] | None = None
) -> tuple[list[str], list[Key]]:
    """The sections and keys under ``cls`` in field order, with their dotted YAML paths.

    A dataclass field is a section where the resolved YAML (``tree``) nests it as a mapping, and
    its keys join the enclosing section where the YAML flattens it."""
    tree = resolved_defaults() if tree is None else tree
    hints = typing.get_type_hints(cls)
    sections: list[str] = []
    keys: list[Key] = []
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        if not _is_dataclass_type(hint):
            keys.append(Key(f"{prefix}{field.name}", type_text(hint), default_text(field)))
            continue
        sub_tree = tree.get(field.name)
        if isinstance(sub_tree, dict):
            path = f"{prefix}{field.name}"
            sub_sections, sub_keys = walk(hint, f"{path}.", sub_tree)
            sections += [path, *sub_sections]
        else:  # flattened into this section's keys
            sub_sections, sub_keys = walk(hint, prefix, tree)
            sections += sub_sections
        keys += sub_keys
    return sections, keys


def load_descriptions(path: Path = DESCRIPTIONS) -> dict[str, str]:
    """``docs/config_keys.yaml``: ``{"section.key": "one line"}``."""
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise ValueError(f"{path} must map 'section.key' to a one-line description")
    return {str(k): " ".join(v.split()) for k, v in raw.items()}


def problems(descriptions: dict[str, str]) -> list[str]:
    """Keys without a description and descriptions that name no key, one line each."""
    sections, keys = walk(TrainConfig)
    known = set(sections) | {k.path for k in keys}
    missing = [f"no description for key '{k.path}'" for k in keys if k.path not in descriptions]
    stray = [f"description of '{name}' names no key" for name in descriptions if name not in known]
    return missing + stray


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(descriptions: dict[str, str]) -> str:
    """The whole ``docs/configuration.md`` page."""
    sections, keys = walk(TrainConfig)
    head = (REPO / "docs" / "configuration.head.md").read_text()
    out = [head.rstrip() + "\n"]
    for section in sections:
        out.append(f"\n## `{section}`\n")
        if section in descriptions:
            out.append(f"\n{descriptions[section]}\n")
        out.append("\n| key | type | default | description |\n|---|---|---|---|\n")
        depth = section.count(".") + 1
        for key in keys:
            parent, _, name = key.path.rpartition(".")
            if parent == section and key.path.count(".") == depth:
                text = _cell(descriptions.get(key.path, ""))
                out.append(f"| `{name}` | {key.type_text} | {key.default_text} | {text} |\n")
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    descriptions = load_descriptions()
    found = problems(descriptions)
    if found:
        print("\n".join(f"{DESCRIPTIONS.name}: {p}" for p in found), file=sys.stderr)
        return 1
    page = render(descriptions)
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print(f"{PAGE} is stale: run `{COMMAND}`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
