"""server.rate_limit_per_minute: a token bucket per client address on the generation routes."""

from __future__ import annotations

import httpx
import pytest

from served_app import app_server, embedded_engine
from ridgefill_server.limits import RateLimit


def test_bucket_allows_a_burst_then_one_per_interval():
    limit = RateLimit(app=None, per_minute=3)
    assert [limit._take("a", 0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limit._take("a", 0.0) == pytest.approx(20.0)  # one token every 60 / 3 s
    assert limit._take("b", 0.0) == 0.0  # another client has its own bucket
    assert limit._take("a", 10.0) == pytest.approx(10.0)  # half a token refilled
    assert limit._take("a", 20.5) == 0.0
    assert limit._take("a", 20.5) > 0


def test_full_buckets_are_forgotten_past_the_client_cap(monkeypatch):
    monkeypatch.setattr(RateLimit, "MAX_CLIENTS", 4)
    limit = RateLimit(app=None, per_minute=60)
    for i in range(6):
        limit._take(f"c{i}", 0.0)
    limit._take("late", 120.0)  # two minutes on, every earlier bucket is full again
    assert set(limit._buckets) == {"late"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine = embedded_engine(tmp_path_factory, num_blocks=64, threads=2)
    with app_server(lambda: engine, rate_limit_per_minute=2) as srv:
        srv.wait_ready()
        yield srv


def test_over_the_rate_is_429_with_retry_after_and_health_is_not_limited(served):
    body = {"prompt": "hi", "max_tokens": 1}
    with httpx.Client(base_url=served.url, timeout=60) as c:
        assert [c.post("/v1/completions", json=body).status_code for _ in range(2)] == [200, 200]
        refused = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert refused.status_code == 429
        assert int(refused.headers["retry-after"]) >= 1
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error" and "server.rate_limit_per_minute" in error["message"]
        assert [c.get("/health").status_code for _ in range(5)] == [200] * 5
