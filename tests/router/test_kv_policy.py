"""KV-aware prefill routing (router.kv_policy): the pure cost function, its tie-breaks, the
temperature, SGLang's imbalance fallback, and what may never be chosen."""

import random
from collections import Counter

import pytest

from pdserve.router.kv_policy import (POLICIES, RoutingConfig, choose_prefill, pick_prefill_kv, pick_prefill_round_robin)
from pdserve.router.policy import WorkerSnapshot

KV = RoutingConfig()


def w(worker_id, queued=0, healthy=True, draining=False, inflight=0, last_placed=0, role="prefill"):
    return WorkerSnapshot(worker_id, role, healthy, draining=draining, queued_tokens=queued, inflight=inflight,
                          last_placed=last_placed)


def test_an_empty_index_is_least_queued_tokens():
    choice = pick_prefill_kv([w("a", 300), w("b", 100), w("c", 200)], {}, 1000, KV)
    assert (choice.worker_id, choice.rule, choice.cached_tokens) == ("b", "load", 0)


def test_the_worker_caching_the_prefix_wins_over_a_shorter_queue():
    # a: 100 to compute + 500 queued = 600; b: 1700 + 0.
    choice = pick_prefill_kv([w("a", 500), w("b", 0)], {"a": 1600}, 1700, KV)
    assert (choice.worker_id, choice.rule, choice.cached_tokens) == ("a", "cache", 1600)
    assert "1600 of 1700" in choice.reason


def test_a_queue_longer_than_the_cached_work_saved_sends_it_elsewhere():
    # a: 100 + 2000 = 2100; b: 1700 + 0 = 1700.
    choice = pick_prefill_kv([w("a", 2000), w("b", 0)], {"a": 1600}, 1700, KV)
    assert (choice.worker_id, choice.rule, choice.cached_tokens) == ("b", "load", 0)


def test_the_longest_overlap_wins_at_equal_load():
    choice = pick_prefill_kv([w("a"), w("b"), w("c")], {"a": 32, "b": 96, "c": 64}, 200, KV)
    assert (choice.worker_id, choice.cached_tokens) == ("b", 96)


def test_weights_scale_each_term():
    workers, overlaps = [w("a", 500), w("b", 0)], {"a": 1600}
    only_load = pick_prefill_kv(workers, overlaps, 1700, RoutingConfig(prefill_weight=0.0))
    only_cache = pick_prefill_kv([w("a", 100000), w("b", 0)], overlaps, 1700,
                                 RoutingConfig(load_weight=0.0, balance_abs_tokens=10**9))
    heavy_load = pick_prefill_kv(workers, overlaps, 1700, RoutingConfig(load_weight=4.0))  # a: 100 + 2000 > 1700
    assert (only_load.worker_id, only_cache.worker_id, heavy_load.worker_id) == ("b", "a", "b")


@pytest.mark.parametrize("workers, expected", [
    ([w("b"), w("a")], "a"),  # everything equal: the id
    ([w("a", inflight=2), w("b", inflight=1)], "b"),  # equal cost: fewest in flight
    ([w("a", last_placed=9), w("b", last_placed=3)], "b"),  # then the one given work least recently
])
def test_equal_costs_break_ties_deterministically(workers, expected):
    for _ in range(3):
        assert pick_prefill_kv(workers, {}, 100, KV).worker_id == expected


def test_equal_cost_from_different_mixes_goes_to_the_shorter_queue():
    # a: 50 uncached + 150 queued = 200; b: 200 uncached + 0 queued = 200. Tied cost: the
    # load keys decide (queued tokens first), so the idle worker takes it.
    for workers in ([w("a", 150), w("b", 0)], [w("a", 150, inflight=0), w("b", 0, inflight=3)]):
        assert pick_prefill_kv(workers, {"a": 150}, 200, KV).worker_id == "b"


def test_temperature_zero_is_argmin_whatever_the_rng():
    workers, overlaps = [w("a", 100), w("b", 0), w("c", 50)], {"a": 900, "c": 100}
    picks = {pick_prefill_kv(workers, overlaps, 1000, KV, rng=random.Random(s)).worker_id for s in range(20)}
    assert picks == {"a"}


def test_a_positive_temperature_samples_by_cost_and_is_reproducible_with_a_seed():
    workers, overlaps = [w("a"), w("b"), w("c")], {"a": 900, "b": 450}  # costs 100, 550, 1000
    cfg = RoutingConfig(temperature=0.5)

    def run(seed):
        rng = random.Random(seed)
        return [pick_prefill_kv(workers, overlaps, 1000, cfg, rng=rng).worker_id for _ in range(2000)]

    first = run(7)
    assert first == run(7)  # same seed, same picks
    counts = Counter(first)
    assert counts["a"] > counts["b"] > counts["c"] > 0  # every worker possible, the cheaper likelier
    # exp(0) : exp(-1) : exp(-2) over normalized costs 0, 0.5, 1 at temperature 0.5.
    assert abs(counts["a"] / 2000 - 1 / (1 + 0.3679 + 0.1353)) < 0.04


def test_a_high_temperature_is_near_uniform_and_a_tiny_one_near_argmin():
    workers, overlaps = [w("a"), w("b")], {"a": 900}
    rng = random.Random(1)
    hot = Counter(pick_prefill_kv(workers, overlaps, 1000, RoutingConfig(temperature=100.0), rng=rng).worker_id
                  for _ in range(2000))
    cold = Counter(pick_prefill_kv(workers, overlaps, 1000, RoutingConfig(temperature=0.01), rng=rng).worker_id
                   for _ in range(200))
    assert abs(hot["a"] - 1000) < 120 and cold == {"a": 200}


def test_equal_costs_sample_uniformly_at_any_temperature():
    rng = random.Random(3)
    counts = Counter(pick_prefill_kv([w("a"), w("b")], {}, 100, RoutingConfig(temperature=1.0), rng=rng).worker_id
                     for _ in range(2000))
    assert abs(counts["a"] - 1000) < 120


@pytest.mark.parametrize("loads, expect_fallback", [
    ((10000, 100), True),  # differ by 9900 > 8192 and 10000 > 2 * 100
    ((8292, 100), False),  # differ by exactly 8192: not more
    ((20000, 11000), False),  # differ by 9000 > 8192, but 20000 < 2 * 11000
    ((8000, 0), False),  # 8000 > 2 * 0, but differ by less than 8192
])
def test_imbalanced_queues_fall_back_to_the_shortest_queue(loads, expect_fallback):
    # a caches the whole prompt, so without the fallback it wins despite its queue.
    choice = pick_prefill_kv([w("a", loads[0]), w("b", loads[1])], {"a": 16000}, 16001,
                             RoutingConfig(load_weight=0.1))
    if expect_fallback:
        assert (choice.worker_id, choice.rule, choice.cached_tokens) == ("b", "balance", 0)
        assert "imbalanced" in choice.reason
    else:
        assert (choice.worker_id, choice.rule) == ("a", "cache")


def test_the_fallback_thresholds_are_settings():
    workers, overlaps = [w("a", 300), w("b", 100)], {"a": 900}
    strict = RoutingConfig(balance_abs_tokens=100, balance_rel=1.5)
    assert pick_prefill_kv(workers, overlaps, 1000, strict).rule == "balance"
    assert pick_prefill_kv(workers, overlaps, 1000, KV).rule == "cache"


@pytest.mark.parametrize("bad", [w("a", healthy=False), w("a", draining=True), w("a", role="decode")])
def test_unusable_workers_are_never_chosen_whatever_they_cache(bad):
    choice = pick_prefill_kv([bad, w("b", 5000)], {"a": 999}, 1000, KV)
    assert choice.worker_id == "b" and choice.cached_tokens == 0


def test_excluded_workers_are_never_chosen_and_none_left_says_so():
    workers = [w("a"), w("b")]
    assert pick_prefill_kv(workers, {"a": 999}, 1000, KV, exclude=frozenset({"a"})).worker_id == "b"
    tried = pick_prefill_kv(workers, {"a": 999}, 1000, KV, exclude=frozenset({"a", "b"}))
    assert tried.worker_id is None and "tried" in tried.reason and not tried.pool_empty
    gone = pick_prefill_kv([w("a", healthy=False)], {"a": 999}, 1000, KV)
    assert gone.worker_id is None and gone.pool_empty


def test_full_queues_are_saturated_and_a_full_worker_is_skipped():
    workers = [w("a", 900), w("b", 500)]
    full = pick_prefill_kv(workers, {"a": 999}, 200, KV, max_queued_tokens=600)
    assert full.worker_id is None and full.saturated
    assert pick_prefill_kv(workers, {"a": 999}, 200, KV, max_queued_tokens=1000).worker_id == "b"


def test_one_candidate_is_chosen_with_its_overlap():
    choice = pick_prefill_kv([w("a", 10**6), w("b", healthy=False)], {"a": 64}, 100, KV)
    assert (choice.worker_id, choice.rule, choice.cached_tokens) == ("a", "only", 64)


def test_a_stale_or_impossible_overlap_is_bounded():
    """The index may name workers that are gone, or claim more than the prompt: the last
    prompt token is always computed, so at most P - 1 tokens count as cached."""
    choice = pick_prefill_kv([w("a"), w("b")], {"a": 5000, "gone": 5000}, 100, KV)
    assert (choice.worker_id, choice.cached_tokens) == ("a", 99)


def test_round_robin_takes_turns_in_id_order_blind_to_cache_and_load():
    workers = [w("c", 10**6), w("a"), w("b")]
    assert [pick_prefill_round_robin(workers, t).worker_id for t in range(5)] == ["a", "b", "c", "a", "b"]
    skipped = pick_prefill_round_robin(workers, 1, exclude=frozenset({"b"}))
    assert (skipped.worker_id, skipped.rule) == ("c", "round_robin")
    assert pick_prefill_round_robin([w("a", healthy=False)], 0).pool_empty


@pytest.mark.parametrize("policy, expected, rule", [("kv", "a", "cache"), ("load", "b", "load"),
                                                    ("round_robin", "b", "round_robin")])
def test_choose_prefill_dispatches_on_the_policy_and_reports_the_overlap(policy, expected, rule):
    choice = choose_prefill([w("a", 200), w("b", 0)], {"a": 900, "b": 16}, 1000, RoutingConfig(policy=policy),
                            turn=1)
    assert (choice.worker_id, choice.rule) == (expected, rule)
    assert choice.cached_tokens == {"a": 900, "b": 16}[expected]


def test_choose_prefill_passes_refusals_through():
    choice = choose_prefill([w("a", healthy=False)], {}, 10, RoutingConfig(policy="load"), turn=0)
    assert choice.worker_id is None and choice.pool_empty


@pytest.mark.parametrize("field, value", [("policy", "fastest"), ("prefill_weight", -1.0), ("load_weight", -0.5),
                                          ("temperature", -1.0), ("balance_abs_tokens", -1), ("balance_rel", 0.5)])
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field if field != "policy" else "routing policy"):
        RoutingConfig(**{field: value})
    assert set(POLICIES) == {"kv", "load", "round_robin"}
