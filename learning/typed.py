"""Config groups read into frozen dataclasses: every key required, none unknown, each typed.

The defaults live in ``conf/`` and nowhere else: :func:`read_typed` requires every field of
the class in the YAML group it reads (a missing key names the file to fix), rejects keys the
class does not have (a typo such as ``train.lrr`` fails before anything starts, not
silently) and converts each value to the field's type. A class checks its own ranges in
``__post_init__`` with :func:`check`. The method options (``common/options.py``), the run
keys, ``train``, ``dataset`` and ``model`` are all read this way.

This module deliberately has no ``from __future__ import annotations``: the field types are
read at run time to convert YAML values.
"""

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigKeyError(ValueError):
    """A config key is missing, unknown, of the wrong type or out of range; the message names
    the key (``group.key``) and the fix."""


def did_you_mean(key: str, valid: Iterable[str], group: str = "", elsewhere: Iterable[str] = ()) -> str:
    """`` (did you mean train.lr?)`` for a mistyped ``key``: the nearest valid key of its group
    (``difflib``), else a key of the same name in another group (``lr`` -> ``train.lr``, from
    ``elsewhere``, every dotted key of the config); empty when nothing is near."""
    leaf = key.rpartition(".")[2]
    near = difflib.get_close_matches(leaf, list(valid), n=1, cutoff=0.6)
    prefix = f"{group}." if group else ""
    guesses = [prefix + near[0]] if near else [k for k in elsewhere if k.rpartition(".")[2] == leaf]
    return f" (did you mean {' or '.join(guesses)}?)" if guesses else ""


def unknown_key_message(keys: list[str], valid: Iterable[str], group: str = "",
                        elsewhere: Iterable[str] = ()) -> str:
    """``unknown key train.lrr (did you mean train.lr?); valid train keys: ...``"""
    valid = sorted(valid)
    named = ", ".join(k + did_you_mean(k, valid, group, elsewhere) for k in keys)
    return f"unknown key{'s' if len(keys) > 1 else ''} {named}; valid {group or 'top-level'} keys: {', '.join(valid)}"


# While read_typed builds a class, failed checks are collected here, so that one message
# names every problem of a group (not only the first).
_collecting: list[list[str]] = []


def check(ok: bool, message: str, error: type[Exception] = ConfigKeyError) -> None:
    """Fail with ``message`` unless ``ok`` (inside :func:`read_typed`: note it and go on)."""
    if ok:
        return
    if _collecting:
        _collecting[-1].append(message)
        return
    raise error(message)


def one_of(key: str, value: str, valid: tuple[str, ...], error: type[Exception] = ConfigKeyError) -> None:
    check(value in valid, f"{key} must be one of {', '.join(valid)}, got {value!r}", error)


def finite(key: str, value: float, low: float = -math.inf, strict: bool = False,
           error: type[Exception] = ConfigKeyError) -> None:
    ok = math.isfinite(value) and (value > low if strict else value >= low)
    check(ok, f"{key} must be {'>' if strict else '>='} {low:g} (and finite), got {value}", error)


def coerce(key: str, value: Any, typ: Any, error: type[Exception] = ConfigKeyError) -> Any:
    """Convert a YAML value to the field's type (``int | None`` accepts null, ``list[float]``
    converts each item, ``dict[str, float]`` each value)."""
    if typ is Any:
        return value
    if isinstance(typ, types.UnionType) or typing.get_origin(typ) is typing.Union:
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if value is None:
            return None
        for arg in args[:-1]:   # the first member that takes the value (float | str: 2.5, auto)
            try:
                return coerce(key, value, arg, error)
            except error:
                continue
        return coerce(key, value, args[-1], error)
    origin = typing.get_origin(typ)
    if origin in (list, tuple):
        if isinstance(value, str | bytes) or not hasattr(value, "__iter__") or isinstance(value, Mapping):
            raise error(f"{key} must be a list, got {value!r}")
        (item,) = typing.get_args(typ)[:1] or (Any,)
        return tuple(coerce(f"{key}[{i}]", v, item, error) for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise error(f"{key} must be a mapping, got {value!r}")
        _, item = typing.get_args(typ)
        return {str(k): coerce(f"{key}.{k}", v, item, error) for k, v in value.items()}
    try:
        if typ is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false"):
                    raise ValueError(value)
                return value.lower() == "true"
            if not isinstance(value, bool):
                raise ValueError(value)
            return value
        if typ is int and (isinstance(value, bool) or (isinstance(value, float) and not value.is_integer())):
            raise ValueError(value)
        if typ in (int, float) and isinstance(value, str):
            value = float(value) if typ is float else int(value)
        return typ(value)
    except (TypeError, ValueError) as err:
        kind = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
            typ, f"a {getattr(typ, '__name__', typ)}")
        raise error(f"{key} must be {kind}, got {value!r}") from err


def read_typed(cls: type[T], values: Mapping[str, Any], group: str, where: str,
               error: type[Exception] = ConfigKeyError) -> T:
    """``cls`` from the config group ``values`` (named ``group`` in messages, its defaults in
    the file ``where``, in which ``{name}`` stands for the group's ``name``): every field
    required, no unknown keys, each converted to its type."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    label = (lambda k: f"{group}.{k}") if group else str
    missing = [k for k in fields if k not in values]
    if "{name}" in where:
        where = where.format(name=values["name"]) if "name" in values else where.replace("{name}", "<name>")
    if missing:
        raise error(f"{group or 'the config'} is missing {', '.join(map(label, missing))}; the defaults "
                    f"are in {where} (override with {label('<key>')}=...)")
    unknown = sorted(str(k) for k in values if k not in fields)
    if unknown:
        raise error(unknown_key_message([label(k) for k in unknown], fields, group))
    hints = typing.get_type_hints(cls)
    problems: list[str] = []
    kwargs: dict[str, Any] = {}
    for k in fields:
        try:
            kwargs[k] = coerce(label(k), values[k], hints[k], error)
        except error as err:
            problems.append(str(err))
    if not problems:
        _collecting.append(problems)
        try:
            built = cls(**kwargs)
        finally:
            _collecting.pop()
    if problems:
        raise error("\n  - ".join(problems))
    return built
