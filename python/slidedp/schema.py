"""Strict mapping → dataclass conversion, the engine under ``slidedp.config``.

A config section is a keyword-only dataclass whose annotations are the schema. ``build_section``
records every problem instead of stopping at the first: an unknown key (the closest valid name
suggested), a wrong type, a missing required key, every failed ``require`` of ``__post_init__``.
Invariant: nothing is coerced silently except int → float and an integral float → int.

Example::

    problems: list[str] = []  # Train: a kw_only dataclass with ``max_steps: int``
    train = build_section("train", Train, {"max_stpes": 5}, problems)
    # None; problems: "unknown key 'train.max_stpes' (did you mean 'train.max_steps'?)", ...
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml

from slidedp.errors import ConfigError, collect_problems

T = TypeVar("T")


class _StrictLoader(yaml.SafeLoader):  # type: ignore[misc]  # yaml is untyped
    """PyYAML's safe loader with two fixes: a key given twice in one mapping is an error (PyYAML
    keeps the last one silently), and ``1e-4`` is a float as in YAML 1.2 (PyYAML's YAML 1.1
    rules read it as a string because it has no dot)."""


def _construct_unique_mapping(loader: _StrictLoader, node: yaml.MappingNode) -> Any:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node)
        if not isinstance(key, typing.Hashable):
            continue  # construct_mapping below reports the unhashable key
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key '{key}'", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node)


_StrictLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)
_StrictLoader.add_implicit_resolver(  # tried after the YAML 1.1 float and int patterns
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def load_yaml(text: str) -> Any:
    """YAML text to Python values, strictly (see ``_StrictLoader``); raises ``yaml.YAMLError``."""
    return yaml.load(text, Loader=_StrictLoader)  # a SafeLoader subclass: no arbitrary objects


@dataclass(frozen=True)
class TextValue:
    """A value typed on the command line (``section.key=TEXT``): read as YAML when that gives the
    field's type (``5``, ``1e-4``, ``true``, ``[a, b]``), else kept as text where the field takes
    a string (``data.path=123``, ``train.resume=``)."""

    text: str


class _Mismatch(Exception):
    """A value that does not fit its annotation (internal: becomes one problem line)."""


def did_you_mean(name: str, valid: Iterable[str], prefix: str = "") -> str:
    """`` (did you mean 'PREFIXx'?)`` for the closest valid name, else `` (valid: a, b, c)``."""
    valid = sorted(valid)
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    if close:
        return f" (did you mean '{prefix}{close[0]}'?)"
    return f" (valid: {', '.join(valid)})"


def describe(hint: Any) -> str:
    """The expected type in words, for an error message."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in args)
    if origin in (list, tuple):
        return f"a list whose items are each {describe(args[0])}"
    if origin is dict:
        return f"a mapping from {describe(args[0])} to {describe(args[1])}"
    names = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}
    return names.get(hint, "null" if hint is type(None) else getattr(hint, "__name__", str(hint)))


def _accepts_text(hint: Any) -> bool:
    if get_origin(hint) in (Union, types.UnionType):
        return any(_accepts_text(a) for a in get_args(hint))
    return hint is str or hint is Any


def coerce(value: Any, hint: Any) -> Any:
    """``value`` checked against ``hint`` (ints widened to floats); raises ``_Mismatch``."""
    if isinstance(value, TextValue):
        try:
            return coerce(load_yaml(value.text), hint)
        except (_Mismatch, yaml.YAMLError):
            if _accepts_text(hint):
                return value.text
            raise _Mismatch from None
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return value
    if origin is Literal:
        # `True == 1`, so compare types too: `dtype: 1` is not `Literal[1, True]`'s True
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise _Mismatch
    if origin in (Union, types.UnionType):
        for arg in args:
            try:
                return coerce(value, arg)
            except _Mismatch:
                continue
        raise _Mismatch
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise _Mismatch
        items = [coerce(v, args[0]) for v in value]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise _Mismatch
        return {coerce(k, args[0]): coerce(v, args[1]) for k, v in value.items()}
    if hint not in (bool, int, float, str, type(None)):
        raise TypeError(f"config annotation {hint!r} is not supported by slidedp.schema")
    if hint is type(None):
        if value is None:
            return None
        raise _Mismatch
    if isinstance(value, bool) != (hint is bool):  # bool is an int subclass: never mix them
        raise _Mismatch
    if hint is float and isinstance(value, int | float):
        if not math.isfinite(value):  # .nan, .inf, 1e999: no config value means them
            raise _Mismatch
        return float(value)
    if hint is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, hint):
        return value
    raise _Mismatch


def _shown(value: Any) -> str:
    return repr(value.text) if isinstance(value, TextValue) else f"{value!r}"


def build_section(section: str, cls: type[T], raw: Any, problems: list[str]) -> T | None:
    """``cls(**raw)`` checked key by key; appends one line per problem to ``problems`` and
    returns None when the section cannot be built (then its value checks did not run)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problems.append(f"section '{section}' must be a mapping of keys, got {_shown(raw)}")
        return None
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    problems_before = len(problems)
    for key, value in raw.items():
        if key not in fields:
            problems.append(
                f"unknown key '{section}.{key}'{did_you_mean(str(key), fields, f'{section}.')}"
            )
            continue
        try:
            kwargs[key] = coerce(value, hints[key])
        except _Mismatch:
            text = value.text if isinstance(value, TextValue) else value
            choices = [c for c in get_args(hints[key]) if isinstance(c, str)]
            close = difflib.get_close_matches(text, choices, n=1) if isinstance(text, str) else []
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            if get_origin(hints[key]) is list and isinstance(value, TextValue):
                hint = f" (a list on the command line: {section}.{key}='[{value.text}]')"
            problems.append(
                f"{section}.{key} must be {describe(hints[key])}, got {_shown(value)}{hint}"
            )
    required = [
        name
        for name, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    problems += [
        f"missing key '{section}.{name}' (required: add it under {section}:)"
        for name in required
        if name not in raw
    ]
    if any(name not in kwargs for name in required):
        return None  # value checks need every required key; a bad optional one: its default
    with collect_problems() as found:
        try:
            built = cls(**kwargs)
        except ConfigError as e:  # a check that raises directly instead of calling require
            found.extend(e.problems)
            built = None
        except Exception:
            if not found:
                raise
            built = None  # a later check tripped over a value an earlier one already rejected
    problems.extend(found)
    return built if len(problems) == problems_before else None
