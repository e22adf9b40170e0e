"""Each pool scales on its own signal with its own config: one workload, two pools."""

from pdserve.cluster.autoscaling import pool_config
from tests.autoscale.helpers import decode_load, prefill_load, simulate

# A toy workload: requests/s, prompt tokens, output tokens. The prefill backlog is about a
# second of arrivals' prompts; decode streams hold KV for their whole output, each token a
# 1/40000 share of one worker's cache (a 135M-model worker holds ~40k tokens in 1 GiB).
KV_TOKENS_PER_WORKER = 40_000
DECODE_TOKENS_PER_S = 20


def workload(rate, prompt, output, stop_at):
    """Pool loads for the workload, which stops at ``stop_at`` seconds."""
    def on(t):
        return t < stop_at
    queued = lambda t: rate * prompt if on(t) else 0  # noqa: E731
    streams = lambda t: rate * output / DECODE_TOKENS_PER_S if on(t) else 0  # noqa: E731  (Little's law)
    kv = lambda t: streams(t) * (prompt + output / 2) / KV_TOKENS_PER_WORKER  # noqa: E731
    return prefill_load(queued), decode_load(kv)


def run_both(rate, prompt, output, stop_at=600, duration=1200, prefill=None, decode=None):
    p_load, d_load = workload(rate, prompt, output, stop_at)
    p = simulate("prefill", prefill or pool_config("prefill"), p_load, duration)
    d = simulate("decode", decode or pool_config("decode"), d_load, duration)
    return p, d


def test_long_prompts_short_outputs_grow_prefill_only_then_both_return_to_min():
    prefill, decode = run_both(rate=2.0, prompt=6000, output=16)
    assert prefill.replicas_at(599) >= 3 and decode.replicas_at(599) == 1
    assert decode.changes == []
    assert prefill.final_replicas == 1


def test_short_prompts_long_outputs_grow_decode_only_then_both_return_to_min():
    prefill, decode = run_both(rate=2.0, prompt=100, output=1000)
    assert decode.replicas_at(599) >= 2 and prefill.replicas_at(599) == 1
    assert prefill.changes == []
    assert decode.final_replicas == 1


def test_each_pool_keeps_its_own_bounds_and_cooldowns():
    # Both pools overloaded; decode capped at 3 and slow to step up, prefill free to 4.
    slow_decode = pool_config("decode", max_replicas=3, scale_up_cooldown_s=300, scale_down_cooldown_s=300)
    prefill, decode = run_both(rate=2.0, prompt=12000, output=2000, stop_at=1200, decode=slow_decode)
    assert prefill.final_replicas == 4 and decode.final_replicas == 3
    p_ups = [t for t, d in prefill.changes]
    d_ups = [t for t, d in decode.changes]
    assert len(p_ups) == 3 and len(d_ups) == 2
    assert d_ups[1] - d_ups[0] >= 300
    assert max(p_ups) < d_ups[1]  # prefill's 10 s cooldown is not slowed by decode's 300 s
