"""Fake workers beyond tests/metrics/metrics_helpers.py's: a prefill worker that holds every
prefill until released (tests/router)."""

import asyncio

from tests.metrics.metrics_helpers import FakePrefill


class SlowPrefill(FakePrefill):
    """Holds every prefill until ``release`` is set; records the timeout it was given."""

    def __init__(self):
        super().__init__()
        self.release = asyncio.Event()
        self.timeouts: list[float] = []

    async def Prefill(self, request, timeout=None):
        self.timeouts.append(timeout)
        await self.release.wait()
        return await super().Prefill(request, timeout)
