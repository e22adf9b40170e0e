"""The typed settings (pdserve/cluster/typed_settings.py): one frozen dataclass per concern,
built once from the settings table and read by attribute. The table and the classes name the
same settings with the same types; a wrong type or an unknown name is refused naming it; and
``pdserve serve`` and ``pdserve worker`` build the same engine config for the same flags."""

import argparse
import dataclasses
import typing

import pytest

from pdserve.cluster import worker_cli
from pdserve.cluster.serve_config import build
from pdserve.cluster.settings import SettingsError, add_arguments, resolve, resolve_values, serve_settings
from pdserve.cluster.typed_settings import (EngineSettings, LayoutSettings, ServeSettings, WorkerSettings, _Typed,
                                            _classes)
from pdserve.cluster.worker_router import router_config

LIST_TYPE = tuple  # a list setting's value: a tuple of names


def leaves(cls: type) -> dict[str, typing.Any]:
    """Each setting field of ``cls`` and its nested settings classes: name -> annotation."""
    out = {}
    for f in dataclasses.fields(cls):
        if isinstance(f.type, type) and issubclass(f.type, _Typed):
            nested = leaves(f.type)
            assert not set(nested) & set(out), f"{cls.__name__}.{f.name} repeats a setting"
            out.update(nested)
        else:
            out[f.name] = f.type
    return out


def parse(argv, table=None):
    parser = argparse.ArgumentParser()
    add_arguments(parser, table)
    return parser.parse_args(argv)


def worker(role, argv):
    """``pdserve worker --role ROLE`` with ``argv``'s settings."""
    admin = ["--router-admin", "127.0.0.1:1"] if role != "router" else []
    return worker_cli.settings(parse(["--role", role, *admin, *argv], worker_cli.worker_settings()), environ={})


def test_the_classes_name_every_setting_of_each_table_once():
    assert set(leaves(ServeSettings)) == {s.name for s in serve_settings()} | {"autoscaling"}
    assert set(leaves(WorkerSettings)) >= {s.name for s in worker_cli.worker_settings()} | {"autoscaling"}


@pytest.mark.parametrize("table", [serve_settings, worker_cli.worker_settings])
def test_each_fields_type_is_its_settings_and_takes_its_default(table):
    hints = leaves(WorkerSettings if table is worker_cli.worker_settings else ServeSettings)
    for s in table():
        allowed = _classes(hints[s.name])
        assert (LIST_TYPE if s.type is list else s.type) in allowed, (s.name, hints[s.name])
        required = s.name == "role"  # no default, and refused before it is typed ("role: required")
        assert (type(None) in allowed) == (s.default is None and not required), f"{s.name}: None is its default"


def test_the_settings_are_frozen_and_read_by_attribute():
    s = resolve(parse([]), environ={})
    assert (s.engine.model, s.layout.decode, s.kv.lease_seconds) == ("default", 1, 30.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.layout.decode = 2  # derived values are returned, never written back
    assert "api_key=" not in repr(resolve(parse(["--api-key", "sk-secret"]), environ={}))


@pytest.mark.parametrize("build_bad, message", [
    (lambda s: dataclasses.replace(s.engine, block_size="16"), r"EngineSettings.block_size: expected int, got '16'"),
    (lambda s: dataclasses.replace(s.engine, seed=True), r"EngineSettings.seed: expected int, got True"),
    (lambda s: dataclasses.replace(s.layout, decode=None), r"LayoutSettings.decode: expected int, got None"),
    (lambda s: dataclasses.replace(s.engine, dtype=16), r"EngineSettings.dtype: expected str \| None, got 16"),
    (lambda s: dataclasses.replace(s, layout=s.engine), r"ServeSettings.layout: expected LayoutSettings"),
])
def test_a_value_of_another_type_names_the_class_and_field(build_bad, message):
    with pytest.raises(TypeError, match=message):
        build_bad(resolve(parse([]), environ={}))


def test_a_float_field_takes_an_int():
    assert dataclasses.replace(resolve(parse([]), environ={}).engine, kv_cache_gib=2).kv_cache_gib == 2


def test_an_unknown_name_is_refused_naming_it():
    values = resolve_values(parse([]), environ={})
    with pytest.raises(TypeError, match="ServeSettings has no field for setting.s. prefil"):
        ServeSettings.from_values({**values, "prefil": 2})
    with pytest.raises(TypeError, match="unexpected keyword argument 'modes'"):
        dataclasses.replace(resolve(parse([]), environ={}).layout, modes="colocated")
    missing = {k: v for k, v in values.items() if k != "decode"}
    with pytest.raises(TypeError, match="LayoutSettings.decode: no value and no default for setting 'decode'"):
        ServeSettings.from_values(missing)


@pytest.mark.parametrize("text, message", [
    ("decode: two\n", "serve.yaml:decode: 'two' is not a valid int for decode"),
    ("decode: null\n", "serve.yaml:decode: null is not a valid int for decode"),
    ("cuda_graphs: sometimes\n", "serve.yaml:cuda_graphs: 'sometimes' is not a valid bool for cuda_graphs"),
    ("modes: colocated\n", "unknown setting 'modes'"),
])
def test_the_file_refuses_a_wrong_type_or_name_naming_the_key(tmp_path, text, message):
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    with pytest.raises(SettingsError) as exc:
        resolve(parse(["--config", str(path)]), environ={})
    assert message in str(exc.value)


def test_a_null_in_the_file_is_the_default_where_the_default_is_none(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("max_model_len: null\nprefill_tp: null\n")
    s = resolve(parse(["--config", str(path)]), environ={})
    assert (s.engine.max_model_len, s.layout.prefill_tp) == (None, None)


def test_a_worker_keeps_serves_default_for_a_setting_its_table_leaves_out():
    s, serve = worker("decode", []), resolve(parse([]), environ={})
    assert {"seed", "enable_prefix_caching", "tokenizer"} <= (
        {x.name for x in serve_settings()} - {x.name for x in worker_cli.worker_settings()})
    assert (s.engine.seed, s.engine.enable_prefix_caching, s.api.tokenizer) == (
        serve.engine.seed, serve.engine.enable_prefix_caching, serve.api.tokenizer)


ENGINE_FLAGS = [
    [],
    ["--kv-cache-gib", "0.5", "--block-size", "32", "--dtype", "float32", "--max-model-len", "512",
     "--no-cuda-graphs"],
    ["--mixed-prefill-tokens", "8", "--mixed-step-target-s", "0.02"],
    ["--mixed-prefill-tokens", "0"],
    ["--load-format", "dummy"],
    ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'],
    ["--gpu-memory-utilization", "0.45"],
    ["--kv-cache-memory", "100000000", "--gpu-memory-utilization", "0.9"],
]


@pytest.mark.parametrize("argv", ENGINE_FLAGS)
def test_serve_and_worker_build_the_same_engine_config_for_the_same_flags(argv):
    """One builder (``EngineSettings.engine_config``): a plain worker's engine is a disaggregated
    cluster's, as ``pdserve serve``'s default layout runs it, for each role and the router."""
    config = build(resolve(parse(argv), environ={}))
    assert config.worker_config("decode", 0).engine.load_format == ("dummy" if "dummy" in argv else "auto")
    for role in ("prefill", "decode"):
        assert worker_cli.worker_config(worker(role, argv)).engine == config.worker_config(role, 0).engine
    assert router_config(worker("router", argv)).engine == config.router_config((), ()).engine


def test_serve_and_worker_build_the_same_engine_at_a_tensor_parallel_size(tool_llama):
    argv = [str(tool_llama[0]), "--tensor-parallel-size", "2"]
    config = build(resolve(parse(argv), environ={}))
    for role in ("prefill", "decode"):
        engine = worker_cli.worker_config(worker(role, argv)).engine
        assert engine == config.worker_config(role, 0).engine and engine.tensor_parallel_size == 2


def test_the_engine_config_is_built_at_its_size_and_by_the_layout_it_runs_in():
    engine = resolve(parse([]), environ={}).engine
    assert isinstance(engine, EngineSettings)

    def built(**layout):
        return engine.engine_config(**{"tensor_parallel_size": 1, "mode": "disaggregated", "elastic_roles": False,
                                       "tpot_objective_s": 0.1, "decodes": True, **layout})

    assert built(tensor_parallel_size=4).tensor_parallel_size == 4
    assert (built().scheduler.mixed_prefill_tokens, built().scheduler.mixed_step_target_s) == (32, 0.05)
    assert built(elastic_roles=True).scheduler.mixed_prefill_tokens == 0
    assert (built(mode="colocated").scheduler.mixed_prefill_tokens,
            built(mode="colocated").scheduler.mixed_step_target_s) == (0, 0.0)
    assert built(tpot_objective_s=0.2).scheduler.mixed_step_target_s == 0.1


def test_a_layout_applied_is_new_settings_and_the_resolved_ones_stay():
    from pdserve.cluster.layout_choice import apply_layout

    s = resolve(parse(["--layout", "elastic"]), environ={})
    applied, _ = apply_layout(s, frozenset(), None)
    assert (applied.layout.elastic_roles, s.layout.elastic_roles) == (True, False)
    assert isinstance(applied.layout, LayoutSettings) and applied.engine is s.engine
