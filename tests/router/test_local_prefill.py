"""The local-prefill rule (pdserve/router/local_prefill.py): pure, checked over a grid of inputs."""

import itertools

import pytest

from pdserve.router.local_prefill import Decision, LocalPrefillConfig, Reason, decide

PROMPTS = (1, 2, 63, 64, 65, 255, 256, 257, 4096)
LOADS = (0.0, 0.1, 0.49, 0.5, 0.51, 0.99, 1.0)
CACHED = (None, 0, 1, 64, 200, 256)


def expected(cfg: LocalPrefillConfig, prompt: int, load: float, cached: int | None) -> Decision:
    """The rule written out once more, as a table a reader can check against the docstring."""
    uncached = prompt - (cached or 0)
    if cfg.colocated:
        return Decision(True, Reason.COLOCATED, uncached, load)
    if not cfg.max_tokens:
        return Decision(False, Reason.OFF, uncached, load)
    if uncached >= cfg.max_tokens:
        return Decision(False, Reason.LONG_PROMPT, uncached, load)
    if load >= cfg.max_load:
        return Decision(False, Reason.BUSY_WORKER, uncached, load)
    return Decision(True, Reason.SHORT_PROMPT, uncached, load)


CONFIGS = [LocalPrefillConfig(), LocalPrefillConfig(colocated=True), LocalPrefillConfig(max_tokens=64),
           LocalPrefillConfig(max_tokens=256, max_load=0.5), LocalPrefillConfig(max_tokens=1, max_load=1.0),
           LocalPrefillConfig(colocated=True, max_tokens=64, max_load=0.1)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=repr)
def test_every_combination_of_inputs_decides_as_the_table_says(cfg):
    seen = set()
    for prompt, load, cached in itertools.product(PROMPTS, LOADS, CACHED):
        if cached is not None and cached > prompt:
            continue
        got = decide(cfg, prompt, load, cached)
        assert got == expected(cfg, prompt, load, cached), (prompt, load, cached)
        assert got.label == ("local" if got.local else "remote")
        seen.add(got.reason)
    # the grid reaches every outcome the config allows
    if cfg.colocated:
        assert seen == {Reason.COLOCATED}
    elif cfg.max_tokens == 0:
        assert seen == {Reason.OFF}
    elif cfg.max_tokens == 1:  # only a fully cached prompt (0 uncached tokens) is short
        assert Reason.LONG_PROMPT in seen and Reason.SHORT_PROMPT in seen
    else:
        assert seen == {Reason.SHORT_PROMPT, Reason.LONG_PROMPT, Reason.BUSY_WORKER}


def test_the_thresholds_are_strict_upper_bounds():
    cfg = LocalPrefillConfig(max_tokens=256, max_load=0.5)
    assert decide(cfg, 255, 0.49).local
    assert decide(cfg, 256, 0.0).reason is Reason.LONG_PROMPT
    assert decide(cfg, 10, 0.5).reason is Reason.BUSY_WORKER


def test_a_cached_prefix_counts_only_the_rest_of_the_prompt():
    cfg = LocalPrefillConfig(max_tokens=256)
    assert decide(cfg, 1000, 0.0).reason is Reason.LONG_PROMPT
    hit = decide(cfg, 1000, 0.0, cached_tokens=800)
    assert hit.local and hit.uncached_tokens == 200


def test_a_long_prompt_goes_remote_even_on_an_idle_worker_and_a_busy_one_never_takes_a_short_one():
    cfg = LocalPrefillConfig(max_tokens=128, max_load=0.25)
    assert not decide(cfg, 2000, 0.0).local
    assert not decide(cfg, 8, 0.9).local


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_tokens=0, load=0.0), "prompt_tokens must be at least 1, got 0"),
    (dict(prompt_tokens=10, load=1.5), r"load must be in \[0, 1\], got 1.5"),
    (dict(prompt_tokens=10, load=-0.1), r"load must be in \[0, 1\]"),
    (dict(prompt_tokens=10, load=0.0, cached_tokens=11), r"cached_tokens must be in \[0, prompt_tokens=10\], got 11"),
    (dict(prompt_tokens=10, load=0.0, cached_tokens=-1), r"cached_tokens must be in"),
])
def test_impossible_inputs_are_refused_naming_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        decide(LocalPrefillConfig(max_tokens=64), **kwargs)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=-1), "local_prefill_max_tokens must be at least 0, got -1"),
    (dict(max_load=0.0), r"local_prefill_max_load must be in \(0, 1\], got 0.0"),
    (dict(max_load=1.01), r"local_prefill_max_load must be in \(0, 1\], got 1.01"),
])
def test_bad_settings_are_refused_naming_the_setting(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LocalPrefillConfig(**kwargs)
