"""The LoRA settings (pdserve/cluster/lora_settings.py): ``--enable-lora``, ``--lora-modules``
(name=path or vLLM's JSON form), ``--max-loras``, ``--max-lora-rank`` reach every worker of
both pools and the router, from ``pdserve serve`` and ``pdserve worker`` alike; bad input is
refused at start naming the flag."""

import json

import pytest

from pdserve.cluster import worker_cli
from pdserve.cluster.serve_config import build
from pdserve.cluster.settings import SettingsError, resolve
from pdserve.cluster.worker_router import router_config
from pdserve.engine.config import LoRAConfig
from tests.helpers.settings import parse, worker


@pytest.fixture
def adapters(tmp_path):
    for name in ("sql", "chat"):
        (tmp_path / name).mkdir()
    return tmp_path


def test_lora_off_by_default_everywhere():
    config = build(resolve(parse([]), environ={}))
    assert config.prefill_engine.lora is None and config.decode_engine.lora is None and config.engine.lora is None


def test_both_forms_of_lora_modules_reach_both_pools_the_router_and_plain_workers(adapters):
    argv = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--lora-modules",
            f"sql={adapters / 'sql'}", json.dumps({"name": "chat", "path": str(adapters / "chat")})]
    expected = LoRAConfig(max_loras=3, max_lora_rank=32,
                          modules=(("sql", str(adapters / "sql")), ("chat", str(adapters / "chat"))))
    config = build(resolve(parse(argv), environ={}))
    assert config.prefill_engine.lora == config.decode_engine.lora == config.engine.lora == expected
    for role in ("prefill", "decode"):
        assert worker_cli.worker_config(worker(role, argv)).engine.lora == expected
    assert router_config(worker("router", argv)).engine.lora == expected


def test_enable_lora_alone_loads_nothing_at_start_with_vllms_defaults():
    assert build(resolve(parse(["--enable-lora"]), environ={})).decode_engine.lora == LoRAConfig()


def test_a_yaml_file_may_give_modules_as_mappings(adapters, tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(f"enable_lora: true\nlora_modules:\n  - {{name: sql, path: {adapters / 'sql'}}}\n"
                    f"  - chat={adapters / 'chat'}\n")
    lora = build(resolve(parse(["--config", str(path)]), environ={})).prefill_engine.lora
    assert [name for name, _ in lora.modules] == ["sql", "chat"]


def test_a_relative_path_is_made_absolute_for_workers_that_start_elsewhere(adapters, monkeypatch):
    monkeypatch.chdir(adapters)
    lora = build(resolve(parse(["--enable-lora", "--lora-modules", "sql=sql"]), environ={})).decode_engine.lora
    assert lora.modules == (("sql", str(adapters / "sql")),)


@pytest.mark.parametrize("argv, message", [
    (["--lora-modules", "sql={sql}"], "--lora-modules needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "sql"], "'sql' is not name=path"),
    (["--enable-lora", "--lora-modules", "=/x"], "needs a name before '='"),
    (["--enable-lora", "--lora-modules", "{{\"name\": \"a\"}}"], "needs a non-empty \"name\" and \"path\""),
    (["--enable-lora", "--lora-modules", "{{oops"], "is not valid JSON"),
    (["--enable-lora", "--lora-modules", "a={missing}"], "is not a directory"),
    (["--enable-lora", "--lora-modules", "a={sql}", "a={chat}"], "'a' given more than once"),
])
def test_bad_lora_settings_are_refused_naming_the_flag(adapters, argv, message):
    argv = [a.format(sql=adapters / "sql", chat=adapters / "chat", missing=adapters / "nope") for a in argv]
    with pytest.raises(SettingsError, match="--lora-modules"):
        build(resolve(parse(argv), environ={}))
    with pytest.raises(SettingsError, match=message.replace("{", "\\{").replace("(", "\\(")):
        worker_cli.worker_config(worker("decode", argv))


@pytest.mark.parametrize("flag, value, bound", [("--max-loras", "0", "at least 1"),
                                                ("--max-lora-rank", "1024", "at most 512")])
def test_lora_bounds_are_the_settings(flag, value, bound):
    with pytest.raises(SettingsError, match=f"{flag[2:].replace('-', '_')} must be {bound}"):
        resolve(parse(["--enable-lora", flag, value]), environ={})


def test_the_variable_takes_name_path_pairs(adapters):
    env = {"PDSERVE_ENABLE_LORA": "1", "PDSERVE_LORA_MODULES": f"sql={adapters / 'sql'},chat={adapters / 'chat'}"}
    lora = build(resolve(parse([]), environ=env)).decode_engine.lora
    assert [name for name, _ in lora.modules] == ["sql", "chat"]
