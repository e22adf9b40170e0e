"""Tenants: who a client is, once its API key is checked, and what it may use.

A tenant is the unit of isolation on the public plane. Its name salts its prefix cache (so its
hits, and the ``cached_tokens`` that report them, are its own: ``pdserve.router.cache_salt``),
its requests are its own (only it can abort them: ``pdserve.router.service``), and its limits
refuse its own excess only (``pdserve.router.tenant_admission``).

Tenants come from ``--api-keys-file``, a YAML (or JSON, which YAML reads) file::

    keys:                       # every key a client may send, each naming its tenant
      - {key: sk-team-a-1, tenant: team-a}
      - {key: sk-team-a-2, tenant: team-a}    # a second key (rotation): the same tenant
      - {key: sk-team-b, tenant: team-b}
    tenants:                    # optional: limits per tenant; a tenant not listed has none
      team-a:
        max_concurrent_requests: 16   # admitted and not finished
        max_waiting_requests: 4       # admitted, no first token yet
        tokens_per_minute: 200000     # prompt + output tokens over the last 60 s
        admin: true                   # may load and unload LoRA adapters (docs/lora.md#serving)

The single ``--api-key`` is one tenant, ``default``, without limits. The file's keys are
hashed as it is read and the text is dropped: no error message, log line or config repr
carries a key (errors name the entry's position instead).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

DEFAULT_TENANT = "default"  # the tenant of the single --api-key
MIN_KEY_CHARS = 16  # a shorter key is guessable; every generator's (openssl rand, uuid4) is longer
_SALT_DOMAIN = b"pdserve tenant cache salt\0"


class ApiKeysFileError(ValueError):
    """The keys file cannot be used; the message names the file and the entry, never a key."""


@dataclass(frozen=True)
class TenantLimits:
    """One tenant's limits; None: no limit of that kind (the router's own limits still hold)."""

    max_concurrent_requests: int | None = None
    max_waiting_requests: int | None = None
    tokens_per_minute: int | None = None
    # Not a limit but a right: the tenant may load and unload LoRA adapters for the whole
    # cluster (POST /v1/load_lora_adapter, /v1/unload_lora_adapter; pdserve.router.lora_admin).
    admin: bool = False


@dataclass(frozen=True)
class Tenant:
    name: str
    limits: TenantLimits = field(default_factory=TenantLimits)

    @property
    def salt(self) -> str:
        """The tenant's prefix-cache salt: a hash of its name, so that its keys (all of them,
        through a rotation) share one cache and no other tenant's requests reach it."""
        return hashlib.sha256(_SALT_DOMAIN + self.name.encode()).hexdigest()[:32]

    @property
    def owner(self) -> str:
        """Who owns the tenant's requests (``GenerationService.running``'s keys)."""
        return f"tenant:{self.name}"


def key_digest(key: str) -> bytes:
    """What the router keeps of a key: its SHA-256, compared in constant time
    (``pdserve.router.auth.ApiKeys``)."""
    return hashlib.sha256(key.encode()).digest()


def read_api_keys_file(path: str) -> tuple[tuple[bytes, Tenant], ...]:
    """(key digest, tenant) for every key of the file at ``path``; raises ``ApiKeysFileError``."""
    import yaml

    where = f"api_keys_file {path}"
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise ApiKeysFileError(f"{where}: cannot read it: {exc.strerror}") from None
    except yaml.YAMLError as exc:  # its message quotes the line, which may hold a key: only the position
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ApiKeysFileError(f"{where}: not valid YAML or JSON{at}") from None
    if not isinstance(data, dict):
        raise ApiKeysFileError(f"{where}: expected a mapping with 'keys' (and optionally 'tenants')")
    _known(data, ("keys", "tenants"), where)
    limits = _tenant_limits(data.get("tenants") or {}, where)
    entries = data.get("keys")
    if not isinstance(entries, list) or not entries:
        raise ApiKeysFileError(f"{where}: 'keys' must be a list of at least one {{key, tenant}} entry")
    out, seen = [], set()
    for i, entry in enumerate(entries):
        digest, name = _key_entry(entry, f"{where}: keys[{i}]")
        if digest in seen:
            raise ApiKeysFileError(f"{where}: keys[{i}] repeats an earlier key")
        seen.add(digest)
        out.append((digest, Tenant(name, limits.get(name, TenantLimits()))))
    unused = sorted(set(limits) - {t.name for _, t in out})
    if unused:
        raise ApiKeysFileError(f"{where}: tenants {', '.join(map(repr, unused))} have limits but no key")
    return tuple(out)


def _known(mapping: dict, names: tuple[str, ...], where: str) -> None:
    unknown = sorted(str(k) for k in mapping if k not in names)
    if unknown:
        raise ApiKeysFileError(f"{where}: unknown field {unknown[0]!r}; known: {', '.join(names)}")


def _key_entry(entry: Any, where: str) -> tuple[bytes, str]:
    if not isinstance(entry, dict):
        raise ApiKeysFileError(f"{where}: expected a mapping {{key, tenant}}")
    _known(entry, ("key", "tenant"), where)
    key, name = entry.get("key"), entry.get("tenant")
    if not isinstance(key, str) or len(key.strip()) < MIN_KEY_CHARS or key != key.strip():
        raise ApiKeysFileError(f"{where}.key: must be a string of at least {MIN_KEY_CHARS} characters, "
                               f"without surrounding spaces")
    return key_digest(key), _tenant_name(name, f"{where}.tenant")


def _tenant_name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name or not name.isprintable() or len(name) > 128:
        raise ApiKeysFileError(f"{where}: must be a printable name of 1 to 128 characters")
    return name


def _tenant_limits(section: Any, where: str) -> dict[str, TenantLimits]:
    if not isinstance(section, dict):
        raise ApiKeysFileError(f"{where}: 'tenants' must map tenant names to their limits")
    names = tuple(f.name for f in fields(TenantLimits))
    out = {}
    for name, values in section.items():
        at = f"{where}: tenants.{name}"
        _tenant_name(name, at)
        values = values or {}
        if not isinstance(values, dict):
            raise ApiKeysFileError(f"{at}: expected a mapping of limits ({', '.join(names)})")
        _known(values, names, at)
        for limit, value in values.items():
            if limit == "admin":
                if not isinstance(value, bool):
                    raise ApiKeysFileError(f"{at}.admin: must be true or false, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ApiKeysFileError(f"{at}.{limit}: must be a whole number of at least 1, got {value!r}")
        out[name] = TenantLimits(**values)
    return out
