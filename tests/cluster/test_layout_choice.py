"""``pdserve serve --layout``: named layouts, ``auto`` asking its chooser, and every layout setting
given (flag, variable or file) winning over auto (pdserve/cluster/layout_choice.py). No cluster
starts; the chooser is a stand-in where the test is about who gets asked, and the planner's own
choice is tested in tests/planner/test_auto_layout.py."""

import pytest

from pdserve.cluster.layout_choice import apply_layout
from pdserve.cluster.serve_config import build
from pdserve.cluster.settings import SettingsError, given, resolve
from tests.helpers.settings import parse

COLOCATE_TWO = {"mode": "colocated", "decode": 2}


def chooser(calls):
    def choose(v):
        calls.append(v)
        return COLOCATE_TWO, ["2C wins"]
    return choose


def refuse(v):
    raise AssertionError("auto must not be asked")


def applied(argv, environ=None, choose=refuse, gpu=False):
    environ = {} if environ is None else environ
    args = parse(argv)
    return apply_layout(resolve(args, environ=environ), given(args, environ), choose, gpu=lambda: gpu)


def test_auto_is_the_default_and_asks_the_chooser():
    calls = []
    v, lines = applied([], choose=chooser(calls))
    assert len(calls) == 1 and calls[0].layout.layout == "auto"
    assert (v.layout.mode, v.layout.decode) == ("colocated", 2) and lines == ["layout auto: 2C wins"]
    config = build(v)
    assert (config.mode, config.num_prefill, config.num_decode) == ("colocated", 0, 2)


@pytest.mark.parametrize("argv, environ, named", [
    (["--mode", "disaggregated"], {}, "mode"),
    (["--decode", "1"], {}, "decode"),
    (["--prefill", "2"], {}, "prefill"),
    (["--elastic-roles"], {}, "elastic_roles"),
    ([], {"PDSERVE_ROLE_BUDGET": "false"}, "role_budget"),
])
def test_a_layout_setting_given_wins_over_auto(argv, environ, named):
    v, lines = applied(argv, environ)
    assert lines == [f"layout auto: {named} given, so they set the layout"]
    assert v == resolve(parse(argv), environ=environ)  # unchanged


def test_a_layout_setting_in_the_file_wins_over_auto(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("mode: colocated\n")
    v, lines = applied(["--config", str(path)])
    assert v.layout.mode == "colocated" and "mode given" in lines[0]


@pytest.mark.parametrize("argv, why", [
    (["--address", "10.0.0.1:6379"], "address set"),
    (["--tensor-parallel-size", "2"], "tensor_parallel_size set"),
    (["--threads-per-worker", "1"], "threads_per_worker set"),
])
def test_auto_steps_aside_where_its_candidates_are_not_what_starts(argv, why):
    v, lines = applied(argv)
    assert (v.layout.mode, v.layout.prefill, v.layout.decode) == ("disaggregated", 1, 1)
    assert why in lines[0] and lines[0].endswith("the default layout (1P:1D)")


def test_auto_steps_aside_on_a_gpu_and_without_a_chooser():
    assert "a GPU is present" in applied([], gpu=True)[1][0]
    assert "no planner" in applied([], choose=None)[1][0]


@pytest.mark.parametrize("layout, expect", [
    ("disaggregated", ("disaggregated", False, False)),
    ("colocated", ("colocated", False, False)),
    ("elastic", ("disaggregated", True, True)),
])
def test_a_named_layout_sets_its_mode_and_flags(layout, expect):
    v, lines = applied(["--layout", layout])
    assert (v.layout.mode, v.layout.elastic_roles, v.layout.role_budget) == expect
    assert lines == [f"layout {layout} (given)"]


def test_a_layout_setting_given_beats_a_named_layout_too():
    """The variable the tests set (PDSERVE_LAYOUT=disaggregated) and a test's own --mode colocated."""
    v, lines = applied(["--mode", "colocated", "--decode", "2"], {"PDSERVE_LAYOUT": "disaggregated"})
    assert v.layout.mode == "colocated" and "mode='colocated' given, and kept" in lines[1]


def test_given_names_what_came_from_a_flag_a_variable_or_the_file(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("decode: 3\n")
    args = parse(["--config", str(path), "--mode", "colocated"])
    assert given(args, {"PDSERVE_PREFILL": "2"}) == {"decode", "mode", "prefill"}
    assert given(parse([]), {}) == frozenset()


def test_a_bad_layout_names_the_setting():
    with pytest.raises(SettingsError, match="PDSERVE_LAYOUT: 'best' is not one of auto, disaggregated"):
        resolve(parse([]), environ={"PDSERVE_LAYOUT": "best"})


def test_pdserve_serve_hands_the_planners_chooser_to_the_cluster(monkeypatch):
    from pdserve import cli
    from pdserve.cluster import cli as cluster_cli

    seen = {}
    monkeypatch.setattr(cluster_cli, "serve", lambda args, choose_layout=None: seen.setdefault("c", choose_layout) and 0)
    cli.main(["serve"])
    assert seen["c"] is cli._choose_layout
