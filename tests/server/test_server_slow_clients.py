"""Slow clients at the connection cap (issue 31, round three, finding 1): bodies trickled a byte at
a time end with 408 at server.body_deadline_s, and while they are open, a complete request and
/health are still served (the trickling connections give way); when every connection runs a
request, /health still answers through its reserve and anything else gets 503.
On the real app and the embedded engine, over real sockets."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from served_app import app_server, embedded_engine

TRICKLED_HEAD = (
    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n"
)
BODY_TIMEOUT_S, BODY_DEADLINE_S, TRICKLE_EVERY_S = 1.0, 2.5, 0.3


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return embedded_engine(tmp_path_factory, num_blocks=256, threads=2)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=15)


def _trickle(s: socket.socket, stop: threading.Event) -> None:
    """One byte every TRICKLE_EVERY_S (well inside body_timeout_s) until the server closes."""
    while not stop.wait(TRICKLE_EVERY_S):
        try:
            s.sendall(b" ")
        except OSError:  # closed by the server: evicted or answered
            return


def _read_until_closed(s: socket.socket) -> bytes:
    chunks = []
    try:
        while chunk := s.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def test_trickled_bodies_end_at_the_deadline_and_never_lock_out_complete_requests(engine):
    with app_server(
        lambda: engine, max_connections=4, body_timeout_s=BODY_TIMEOUT_S, body_deadline_s=BODY_DEADLINE_S
    ) as srv:
        srv.wait_ready()
        stop = threading.Event()
        tricklers = []
        for _ in range(6):  # two more than the cap
            s = _connect(srv.port)
            s.sendall(TRICKLED_HEAD)
            tricklers.append(s)
            threading.Thread(target=_trickle, args=(s, stop), daemon=True).start()
            time.sleep(0.05)  # accepted in order, so "oldest" is well defined
        started = time.monotonic()
        try:
            with httpx.Client(base_url=srv.url, timeout=30) as client:
                r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
                assert r.status_code == 200, r.text
                assert r.json()["usage"]["completion_tokens"] == 2
            health = httpx.get(srv.url + "/health", timeout=10)
            assert health.status_code == 200, health.text
            served_s = time.monotonic() - started
            replies = [_read_until_closed(s) for s in tricklers]
            closed_s = time.monotonic() - started
        finally:
            stop.set()
            for s in tricklers:
                s.close()
    assert served_s < BODY_DEADLINE_S, served_s  # served while the tricklers were still open
    deadline_408 = [r for r in replies if r.startswith(b"HTTP/1.1 408")]
    assert deadline_408, replies  # the ones not evicted ran into the whole-body deadline
    for reply in deadline_408:
        head, _, body = reply.partition(b"\r\n\r\n")
        assert b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == 408 and b"server.body_deadline_s" in body
    assert all(r == b"" or r.startswith(b"HTTP/1.1 408") for r in replies), replies
    # 2 tricklers past the cap and the completion each closed the oldest trickler (/health may
    # have found the completion's slot free); every close without an answer was such an eviction
    assert srv.connections.evicted == replies.count(b"") >= 3
    # every trickler ends within the deadline (plus slack for a loaded machine), never per part
    assert closed_s < BODY_DEADLINE_S + 5, closed_s


def _stream_without_reading(port: int) -> socket.socket:
    body = json.dumps(
        {"prompt": "Count slowly:", "max_tokens": 4000, "ignore_eos": True, "stream": True, "timeout": 30}
    ).encode()
    s = _connect(port)
    s.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    assert s.recv(12) == b"HTTP/1.1 200"  # the stream is running
    return s


def test_when_every_connection_runs_a_request_health_still_answers_and_others_get_503(engine):
    with app_server(lambda: engine, max_connections=2) as srv:
        srv.wait_ready()
        streams = [_stream_without_reading(srv.port) for _ in range(2)]
        try:
            health = httpx.get(srv.url + "/health", timeout=10)
            other = httpx.post(srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=10)
            tokenize = httpx.post(srv.url + "/tokenize", json={"prompt": "Hi"}, timeout=10)
            health_again = httpx.get(srv.url + "/health?verbose=1", timeout=10)
        finally:
            for s in streams:
                s.close()
    assert health.status_code == 200 and health_again.status_code == 200, (health.text, health_again.text)
    for refused in (other, tokenize):
        assert refused.status_code == 503 and "too many open connections" in refused.json()["error"]["message"]
    assert srv.connections.evicted == 0 and srv.connections.reserve_admitted >= 4
