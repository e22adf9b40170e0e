"""``--speculative-config`` (pdserve/cluster/setting.py, settings.py): vLLM's JSON object, read
once into a ``SpeculativeConfig`` from a flag, a variable or the YAML file; bad JSON, an unknown
key, a value of the wrong type or out of bounds refused naming the flag and the key; and the
config reaches the engines of the workers that decode (decode, colocated, elastic), never a
prefill worker's or the router's."""

import argparse

import pytest

from pdserve.cli import main
from pdserve.cluster import worker_cli, worker_process
from pdserve.cluster.serve_config import build
from pdserve.cluster.settings import SettingsError, add_arguments, resolve
from pdserve.engine.config import SpeculativeConfig

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'


def serve(argv, environ=None, table=None):
    parser = argparse.ArgumentParser()
    add_arguments(parser, table)
    return resolve(parser.parse_args(argv), environ=environ or {})


def plain(role, argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser, worker_cli.worker_settings())
    admin = ["--router-admin", "127.0.0.1:1"] if role != "router" else []
    return worker_cli.settings(parser.parse_args(["--role", role, *admin, *argv]), environ={})


def test_a_json_object_is_read_into_the_typed_settings_from_a_flag_a_variable_or_the_file(tmp_path):
    want = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=5)
    assert serve(["--speculative-config", NGRAM]).engine.speculative_config == want
    assert serve([], {"PDSERVE_SPECULATIVE_CONFIG": NGRAM}).engine.speculative_config == want
    path = tmp_path / "serve.yaml"
    path.write_text("speculative_config:\n  method: draft_model\n  model: /models/draft\n  num_speculative_tokens: 2\n")
    drafted = serve(["--config", str(path)]).engine.speculative_config
    assert drafted == SpeculativeConfig(method="draft_model", model="/models/draft", num_speculative_tokens=2)
    assert serve([]).engine.speculative_config is None  # off unless asked
    assert plain("decode", ["--speculative-config", NGRAM]).engine.speculative_config == want


@pytest.mark.parametrize("value, message", [
    ('{"method": "ngram",', "--speculative-config: speculative_config is not valid JSON (Expecting property name"),
    ('["ngram"]', "--speculative-config: speculative_config must be a JSON object of method, num_speculative_tokens"),
    ('{"method": "ngram", "speculative_model": "x"}',
     "--speculative-config: unknown key 'speculative_model' in speculative_config; known: method, "
     "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, model, disable_by_batch_size"),
    ('{"num_speculative_tokens": 20}',
     "--speculative-config: speculative_config: num_speculative_tokens must be in [1, 16], got 20"),
    ('{"num_speculative_tokens": "3"}',
     "--speculative-config: speculative_config key 'num_speculative_tokens' must be int, got '3'"),
    ('{"num_speculative_tokens": true}',
     "--speculative-config: speculative_config key 'num_speculative_tokens' must be int, got True"),
    ('{"method": "eagle"}', "speculative method must be one of ngram, draft_model, got 'eagle'"),
    ('{"prompt_lookup_min": 5, "prompt_lookup_max": 4}',
     "prompt_lookup_min (5) must be at least 1 and at most prompt_lookup_max (4)"),
    ('{"method": "draft_model"}',
     "--speculative-config: speculative_config: speculative model is needed by method draft_model"),
    ('{"method": "ngram", "model": "/models/draft"}', "speculative model is needed by method draft_model, and by no"),
    ('{"disable_by_batch_size": 0}', "disable_by_batch_size must be at least 1, got 0"),
])
def test_a_bad_value_is_refused_naming_the_flag_and_the_key(value, message, capsys):
    with pytest.raises(SettingsError) as exc:
        serve(["--speculative-config", value])
    assert message in str(exc.value)
    assert main(["serve", "--speculative-config", value]) == 2  # a line on stderr, no traceback
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_the_variable_and_the_file_are_named_where_they_are_wrong(tmp_path):
    with pytest.raises(SettingsError, match="PDSERVE_SPECULATIVE_CONFIG: unknown key 'k'"):
        serve([], {"PDSERVE_SPECULATIVE_CONFIG": '{"k": 3}'})
    path = tmp_path / "serve.yaml"
    path.write_text("speculative_config:\n  num_speculative_tokens: 0\n")
    with pytest.raises(SettingsError, match=r"serve.yaml:speculative_config: speculative_config: num_speculative_"
                                            r"tokens must be in \[1, 16\], got 0"):
        serve(["--config", str(path)])


@pytest.mark.parametrize("layout, speculates", [
    (["--mode", "disaggregated"], {"prefill": False, "decode": True}),
    (["--mode", "colocated"], {"decode": True}),
    (["--elastic-roles"], {"prefill": True, "decode": True}),  # either pool's worker may decode
])
def test_serve_gives_it_to_the_workers_that_decode_only(layout, speculates):
    config = build(serve(["--speculative-config", NGRAM, *layout]))
    spec = config.decode_engine.speculative
    assert spec is not None and spec.num_speculative_tokens == 4
    for role, on in speculates.items():
        engine = config.worker_config(role, 0)
        engine = getattr(engine, "decode", engine).engine  # an elastic worker: both roles' one engine
        assert (engine.speculative == spec) if on else engine.speculative is None, role
    assert config.router_config((), ()).engine.speculative is None


def test_a_plain_worker_speculates_where_it_decodes():
    assert worker_cli.worker_config(plain("decode", ["--speculative-config", NGRAM])).engine.speculative.prompt_lookup_max == 5
    assert worker_cli.worker_config(plain("prefill", ["--speculative-config", NGRAM])).engine.speculative is None


def test_the_bare_worker_process_takes_it_for_a_decode_worker_only(capsys):
    def engine(*argv):
        return worker_process._config(worker_process._parser().parse_args(list(argv))).engine

    assert engine("decode", "--speculative-config", NGRAM).speculative.num_speculative_tokens == 4
    assert engine("prefill", "--speculative-config", NGRAM).speculative is None
    with pytest.raises(SystemExit):
        engine("decode", "--speculative-config", '{"k": 1}')
    assert "--speculative-config: unknown key 'k' in speculative_config" in capsys.readouterr().err
