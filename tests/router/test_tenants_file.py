"""``--api-keys-file``: many keys, each naming its tenant, with optional per-tenant limits
(``pdserve.router.tenants``, ``pdserve.router.auth``). A bad file is refused naming the entry
and the field, and no error carries a key."""

import json

import pytest

from pdserve.cluster.settings import SettingsError
from pdserve.router.auth import ApiKeyError, ApiKeys, read_keys
from pdserve.router.tenants import DEFAULT_TENANT, TenantLimits

KEY_A1, KEY_A2, KEY_B = "sk-team-a-0123456789", "sk-team-a-rotated-987", "sk-team-b-abcdefghij"
FILE = f"""
keys:
  - {{key: {KEY_A1}, tenant: team-a}}
  - {{key: {KEY_A2}, tenant: team-a}}
  - {{key: {KEY_B}, tenant: team-b}}
tenants:
  team-a: {{max_concurrent_requests: 4, max_waiting_requests: 2, tokens_per_minute: 1000}}
"""


def keys_from(tmp_path, text: str) -> ApiKeys:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    return read_keys(None, None, str(path))[1]


def refusal(tmp_path, text: str) -> str:
    with pytest.raises(ApiKeyError) as err:
        keys_from(tmp_path, text)
    return str(err.value)


def test_each_key_names_its_tenant_with_its_limits(tmp_path):
    keys = keys_from(tmp_path, FILE)
    a1, a2, b = (keys.tenant_of(f"Bearer {k}") for k in (KEY_A1, KEY_A2, KEY_B))
    assert a1 == a2 and a1.name == "team-a" and b.name == "team-b"
    assert a1.limits == TenantLimits(4, 2, 1000) and b.limits == TenantLimits()
    assert a1.salt != b.salt and a1.owner != b.owner
    assert keys.tenant_of(f"Basic {KEY_A1}") is None and keys.tenant_of("Bearer sk-nobody-0000000000") is None
    assert keys.tenant_of(None) is None and keys.tenant_of(f"Bearer {KEY_A1}x") is None


def test_json_reads_the_same(tmp_path):
    text = json.dumps({"keys": [{"key": KEY_B, "tenant": "team-b"}],
                       "tenants": {"team-b": {"max_waiting_requests": 3}}})
    assert keys_from(tmp_path, text).tenant_of(f"Bearer {KEY_B}").limits == TenantLimits(max_waiting_requests=3)


def test_no_key_is_printed_or_kept(tmp_path):
    keys = keys_from(tmp_path, FILE)
    assert all(k not in repr(keys) and k.encode() not in repr(keys.entries).encode() for k in (KEY_A1, KEY_B))
    assert all(KEY_A1.encode() not in digest for digest, _ in keys.entries)


@pytest.mark.parametrize("text,named", [
    (f"keys:\n  - {{key: {KEY_A1}, tenant: a}}\n  - {{key: {KEY_A1}, tenant: b}}\n", "keys[1] repeats"),
    ("keys:\n  - {key: sk-short, tenant: a}\n", "keys[0].key: must be a string of at least 16"),
    (f"keys:\n  - {{key: {KEY_A1}}}\n", "keys[0].tenant"),
    (f"keys:\n  - {{key: {KEY_A1}, tenant: a, role: admin}}\n", "keys[0]: unknown field 'role'"),
    (f"keys:\n  - {{key: {KEY_A1}, tenant: a}}\ntenants:\n  a: {{max_waiting_requests: 0}}\n",
     "tenants.a.max_waiting_requests: must be a whole number of at least 1"),
    (f"keys:\n  - {{key: {KEY_A1}, tenant: a}}\ntenants:\n  a: {{rpm: 5}}\n", "tenants.a: unknown field 'rpm'"),
    (f"keys:\n  - {{key: {KEY_A1}, tenant: a}}\ntenants:\n  b: {{tokens_per_minute: 5}}\n",
     "tenants 'b' have limits but no key"),
    ("keys: []\n", "'keys' must be a list of at least one"),
    (f"keys:\n  - {{key: {KEY_A1}, tenant: a\n", "not valid YAML or JSON at line"),
])
def test_a_bad_file_is_refused_naming_the_entry_never_the_key(tmp_path, text, named):
    message = refusal(tmp_path, text)
    assert named in message and "api_keys_file" in message
    assert KEY_A1 not in message


def test_an_unreadable_file_and_both_kinds_of_key_are_refused(tmp_path):
    with pytest.raises(ApiKeyError, match="api_keys_file .*cannot read"):
        read_keys(None, None, str(tmp_path / "missing.yaml"))
    (tmp_path / "keys.yaml").write_text(FILE)
    with pytest.raises(ApiKeyError, match="api_keys_file and api_key"):
        read_keys("sk-one", None, str(tmp_path / "keys.yaml"))


def test_the_single_key_is_one_tenant():
    assert read_keys("sk-one", None, None) == ("sk-one", None)
    tenant = ApiKeys.single("sk-one").tenant_of("Bearer sk-one")
    # No limits; the right to load LoRA adapters (the one key's holder runs the cluster).
    assert tenant.name == DEFAULT_TENANT and tenant.limits == TenantLimits(admin=True)


def test_serve_takes_the_file_through_the_settings(tmp_path):
    import dataclasses

    from pdserve.cluster.serve_config import build
    from pdserve.cluster.settings import resolve

    (tmp_path / "keys.yaml").write_text(FILE)
    values = resolve(_args(), {"PDSERVE_API_KEYS_FILE": str(tmp_path / "keys.yaml")})
    config = build(values)
    assert config.api_key is None and len(config.api_keys.tenants()) == 2
    assert config.without_secrets().api_keys is None and config.without_secrets().api_key == "<set>"
    assert KEY_A1 not in repr(config)
    with pytest.raises((ApiKeyError, SettingsError)):
        build(dataclasses.replace(values, api=dataclasses.replace(values.api, api_key="sk-also")))


def _args():
    import argparse

    return argparse.Namespace()
