"""How long a stream's chunks are batched (workers.model_process.flush_interval): the more
streams a model process serves, the fuller its flushes, within a bound on how long text waits."""

from __future__ import annotations

import pytest

from workers import model_process as mp


@pytest.mark.parametrize(("streams", "interval"), [(0, 0.02), (1, 0.02), (2, 0.02), (4, 0.04)])
def test_few_streams_flush_every_20_ms_and_more_streams_less_often(
    streams: int, interval: float
) -> None:
    assert mp.flush_interval(streams) == pytest.approx(interval)


def test_no_stream_waits_longer_than_the_bound_however_many_share_the_process() -> None:
    assert mp.flush_interval(8) == mp.FLUSH_MAX_S
    assert mp.flush_interval(64) == mp.FLUSH_MAX_S
    # Growing with the streams: the process's flushes per second stay bounded until the cap.
    rates = [n / mp.flush_interval(n) for n in range(2, 6)]
    assert max(rates) == pytest.approx(min(rates))
