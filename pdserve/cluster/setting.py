"""One setting of ``pdserve serve`` or ``pdserve worker``: its declaration (``Setting``: name,
type, default, help, bounds), how a raw value (a flag's or variable's string, a YAML value) is
converted and checked against it (``convert``), and the error that names it (``SettingsError``).
The tables of settings, and how they are resolved, are ``pdserve.cluster.settings``'s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ENV_PREFIX = "PDSERVE_"


@dataclass(frozen=True)
class Setting:
    name: str  # snake_case; the flag is --kebab-case, the variable PDSERVE_UPPER_CASE
    type: type  # int, float, str, bool (flag pair --x / --no-x) or list (of str; one or more)
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


class SettingsError(ValueError):
    """A setting could not be read; the message names where it came from."""


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def convert(s: Setting, raw: Any, where: str) -> Any:
    """``raw`` (a string from a flag or variable, or a YAML value) as ``s.type``, checked."""
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
        raise SettingsError(f"{where}: {raw!r} is not a valid {s.type.__name__} for {s.name}") from exc
    if s.choices and value not in s.choices:
        raise SettingsError(f"{where}: {value!r} is not one of {', '.join(s.choices)} for {s.name}")
    if s.minimum is not None and value < s.minimum:
        raise SettingsError(f"{where}: {s.name} must be at least {s.minimum:g}, got {value!r}")
    if s.above is not None and value <= s.above:
        raise SettingsError(f"{where}: {s.name} must be greater than {s.above:g}, got {value!r}")
    if s.maximum is not None and value > s.maximum:
        raise SettingsError(f"{where}: {s.name} must be at most {s.maximum:g}, got {value!r}")
    return value
