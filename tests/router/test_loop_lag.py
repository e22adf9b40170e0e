"""``pdserve:router_loop_lag_seconds`` (pdserve.router.loop_lag): the probe records a loop held
on purpose (a callback that blocks it) as at least that late, and a real router (the default
model's tokenizer, no workers) exports the family on its /metrics, fed as it runs."""

import asyncio
import time
import urllib.request

from pdserve.router import loop_lag, server
from pdserve.wire import metrics

BLOCK_S = 0.3


def lag_while_blocked(observe, interval_s: float = 0.01) -> None:
    """Run the probe, hold the loop for BLOCK_S once, let the probe see it, stop it."""
    async def main():
        task = asyncio.create_task(loop_lag.probe(interval_s, observe))
        await asyncio.sleep(5 * interval_s)
        asyncio.get_running_loop().call_soon(time.sleep, BLOCK_S)  # a callback that holds the loop
        await asyncio.sleep(5 * interval_s)
        task.cancel()

    asyncio.run(main())


def test_a_callback_that_holds_the_loop_shows_as_lag_at_least_that_long():
    observed: list[float] = []
    lag_while_blocked(observed.append)
    # the probe was due at most one interval after the block began, and woke after its end
    assert max(observed) >= BLOCK_S - 0.02, observed


def over(seconds: str) -> float:
    """Lags observed so far above ``seconds`` (a bucket bound)."""
    return (metrics.REGISTRY.get_sample_value("pdserve:router_loop_lag_seconds_count")
            - metrics.REGISTRY.get_sample_value("pdserve:router_loop_lag_seconds_bucket", {"le": seconds}))


def test_the_router_exports_the_loop_lag_on_its_metrics_and_feeds_it():
    async def main():
        running = await server.start(server.RouterConfig(grpc_port=0, http_port=0))
        try:
            await asyncio.sleep(3 * loop_lag.PROBE_INTERVAL_S)
            before = over("0.25")
            time.sleep(BLOCK_S)  # holds the router's loop, as slow work on it would
            await asyncio.sleep(3 * loop_lag.PROBE_INTERVAL_S)
            url = f"http://{running.http_address}/metrics"
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=30).read().decode())
            return over("0.25") - before, body
        finally:
            await running.stop()

    held, body = asyncio.run(main())
    assert "# TYPE pdserve:router_loop_lag_seconds histogram" in body
    assert held >= 1  # the router's own probe saw its loop held past 0.25 s
