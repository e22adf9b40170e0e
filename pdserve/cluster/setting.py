"""One setting of ``pdserve serve`` or ``pdserve worker``: its declaration (``Setting``: name,
type, default, help, bounds), how a raw value (a flag's or variable's string, a YAML value) is
converted and checked against it (``convert``), and the error that names it (``SettingsError``).
A setting whose type is a dataclass takes a JSON object of that dataclass's fields
(``--speculative-config '{"method": "ngram"}'``, as vLLM's), or a mapping in the YAML file; one
of type ``ByteSize`` takes bytes, plain or with a unit (``8GiB``, ``512MiB``, ``2GB``).
The tables of settings, and how they are resolved, are ``pdserve.cluster.settings``'s.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "PDSERVE_"


@dataclass(frozen=True)
class Setting:
    name: str  # snake_case; the flag is --kebab-case, the variable PDSERVE_UPPER_CASE
    type: type  # int, float, str, bool (flag pair --x / --no-x), list (of str; one or more), or a
    # frozen dataclass (a JSON object of its fields; the dataclass checks their values)
    default: Any  # written in the table only when no config dataclass owns it; else read from that field
    help: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None  # the smallest value allowed (inclusive)
    above: float | None = None  # values must be greater than this
    maximum: float | None = None  # the largest value allowed (inclusive)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


# Units of a ByteSize, by lower-cased suffix: binary (KiB, MiB ...) and decimal (kB, MB ...),
# as Kubernetes quantities read them ("Gi" and "G" too); "b" is bytes.
_UNITS = {"": 1, "b": 1, **{f"{p}{s}": 1024 ** (i + 1) for i, p in enumerate("kmgt") for s in ("ib", "i")},
          **{f"{p}{s}": 1000 ** (i + 1) for i, p in enumerate("kmgt") for s in ("b", "")}}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")


class ByteSize(int):
    """A size in bytes, written as a whole number (``8589934592``) or a number and a unit
    (``8GiB``, ``1.5GiB``, ``512MiB``, ``2GB``, ``64Mi``). A setting of this type converts its
    raw value through it; the result is a plain count of bytes."""

    spelled = "size in bytes (a number, or with a unit: 8GiB, 512MiB, 2GB)"
    metavar = "BYTES"

    def __new__(cls, raw: Any) -> "ByteSize":
        if isinstance(raw, int) and not isinstance(raw, bool):
            return super().__new__(cls, raw)
        match = _SIZE.fullmatch(str(raw))
        unit = _UNITS.get(match.group(2).lower()) if match else None
        if unit is None:
            raise ValueError(f"{raw!r} is not a size in bytes")
        number = float(match.group(1)) if "." in match.group(1) else int(match.group(1))
        if number * unit != int(number * unit):
            raise ValueError(f"{raw!r} is not a whole number of bytes")
        return super().__new__(cls, int(number * unit))


class SettingsError(ValueError):
    """A setting could not be read; the message names where it came from."""


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def convert(s: Setting, raw: Any, where: str) -> Any:
    """``raw`` (a string from a flag or variable, or a YAML value) as ``s.type``, checked."""
    if dataclasses.is_dataclass(s.type):
        return _json_object(s, raw, where)
    if s.type is list:
        items = raw if isinstance(raw, (list, tuple)) else str(raw).split(",")
        # A mapping in a YAML list (``lora_modules``' {name, path} form) stays JSON, not a repr.
        items = [json.dumps(v) if isinstance(v, dict) else v for v in items]
        value = tuple(str(v).strip() for v in items if str(v).strip())
        if not value:
            raise SettingsError(f"{where}: {s.name} needs at least one name")
        return value
    if s.type is bool:
        if isinstance(raw, bool):
            return raw
        if str(raw).lower() in _TRUE + _FALSE:
            return str(raw).lower() in _TRUE
        raise SettingsError(f"{where}: {raw!r} is not a valid bool for {s.name} (true or false)")
    try:
        if s.type is not str and isinstance(raw, bool):
            raise ValueError("a bool is not a number")
        value = s.type(raw)
    except (TypeError, ValueError) as exc:
        kind = getattr(s.type, "spelled", s.type.__name__)
        raise SettingsError(f"{where}: {raw!r} is not a valid {kind} for {s.name}") from exc
    if s.choices and value not in s.choices:
        raise SettingsError(f"{where}: {value!r} is not one of {', '.join(s.choices)} for {s.name}")
    if s.minimum is not None and value < s.minimum:
        raise SettingsError(f"{where}: {s.name} must be at least {s.minimum:g}, got {value!r}")
    if s.above is not None and value <= s.above:
        raise SettingsError(f"{where}: {s.name} must be greater than {s.above:g}, got {value!r}")
    if s.maximum is not None and value > s.maximum:
        raise SettingsError(f"{where}: {s.name} must be at most {s.maximum:g}, got {value!r}")
    return value


def _json_object(s: Setting, raw: Any, where: str) -> Any:
    """``raw`` (a JSON object's text, or a YAML mapping) as an ``s.type`` dataclass: every key a
    field of it, every value of that field's type; the dataclass's own checks give the bounds."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise SettingsError(f"{where}: {s.name} is not valid JSON ({exc.msg} at character {exc.pos}): "
                                f"{raw!r}") from None
    fields = {f.name: f for f in dataclasses.fields(s.type) if f.init}
    if not isinstance(raw, Mapping):
        raise SettingsError(f"{where}: {s.name} must be a JSON object of {', '.join(fields)}, got {raw!r}")
    hints = typing.get_type_hints(s.type)
    for key, value in raw.items():
        if key not in fields:
            raise SettingsError(f"{where}: unknown key {key!r} in {s.name}; known: {', '.join(fields)}")
        if not _of_type(value, hints[key]):
            raise SettingsError(f"{where}: {s.name} key {key!r} must be {_spelled(hints[key])}, got {value!r}")
    try:
        return s.type(**raw)
    except ValueError as exc:
        raise SettingsError(f"{where}: {s.name}: {exc}") from None


def _of_type(value: Any, hint: Any) -> bool:
    """``value`` is one of the classes of annotation ``hint`` (a JSON ``true`` is no int)."""
    union = isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union
    classes = typing.get_args(hint) if union else (hint,)
    return any(isinstance(value, c) and not (isinstance(value, bool) and c is not bool) for c in classes)


def _spelled(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("NoneType", "null")
