"""`serve --tensor-parallel-size 3` on SmolLM2-135M (9 heads, 3 K/V heads: one per rank) keeps the
server's contract: the same greedy text as one rank, streamed == non-streamed, the openai client,
a disconnect frees its blocks and the ranks stay in step, SIGTERM ends every rank with exit 0; a
rank killed mid-stream ends the server non-zero with one line, and its client gets an error event."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The three most useful kitchen tools are"
GREEDY = {"temperature": 0, "max_tokens": 12}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """A real `serve` process; `ranks` its tensor-parallel size."""

    def __init__(self, tmp_path_factory, ranks: int, *args: str):
        self.port = _free_port()
        env = {**os.environ, "RIDGEFILL_CACHE_DIR": str(tmp_path_factory.getbasetemp() / "rf-cache")}
        cmd = [sys.executable, "-m", "ridgefill_server", "serve", "--port", str(self.port), "--threads", "1"]
        cmd += ["--num-blocks", "96", "--max-num-seqs", "4", "--tensor-parallel-size", str(ranks), *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        self.log: list[str] = []
        for line in self.proc.stderr:
            self.log.append(line)
            if "model ready" in line:
                break
        else:
            raise AssertionError("".join(self.log))
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ranks = rank_processes(self.proc.pid)
        assert len(self.ranks) == ranks - 1, self.ranks

    def complete(self, prompt: str, **kw) -> dict:
        r = httpx.post(self.url + "/v1/completions", json={"prompt": prompt, **GREEDY, **kw}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def blocks_used(self) -> float:
        for line in httpx.get(self.url + "/metrics", timeout=30).text.splitlines():
            if line.startswith("ridgefill_kv_cache_blocks_used "):
                return float(line.split()[1])
        raise AssertionError("no ridgefill_kv_cache_blocks_used")

    def end(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def rank_processes(pid: int) -> set[int]:
    """The live ranks `pid` started (spawned children)."""
    found = set()
    for child in os.listdir("/proc"):
        if child.isdigit():
            try:
                stat = Path(f"/proc/{child}/stat").read_text()
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if fields[1] == str(pid) and fields[0] != "Z" and b"spawn_main" in cmdline:
                found.add(int(child))
    return found


PROMPTS = [PROMPT, "Write a haiku about the sea:", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def one_rank_texts(tmp_path_factory):
    srv = Served(tmp_path_factory, 1)
    try:
        return [srv.complete(p)["choices"][0]["text"] for p in PROMPTS]
    finally:
        assert srv.end() == 0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    srv = Served(tmp_path_factory, 3)
    yield srv
    ranks = srv.ranks
    assert srv.end() == 0, "".join(srv.log)
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{r}").exists() and "Z" not in _state(r) for r in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{r}").exists() and "Z" not in _state(r) for r in ranks)
    assert "Traceback" not in "".join(srv.log)


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_three_ranks_answer_as_one(served, one_rank_texts):
    assert [served.complete(p)["choices"][0]["text"] for p in PROMPTS] == one_rank_texts
    assert all(t.strip() for t in one_rank_texts)


def test_streamed_equals_whole_through_the_openai_client(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    whole = client.completions.create(model="ridgefill", prompt=PROMPT, **GREEDY)
    parts = [
        c.choices[0].text for c in client.completions.create(model="ridgefill", prompt=PROMPT, stream=True, **GREEDY)
    ]
    assert len(parts) > 3 and "".join(parts) == whole.choices[0].text


def test_a_disconnect_frees_its_blocks_and_the_ranks_stay_in_step(served, one_rank_texts):
    body = {"prompt": PROMPT * 10, "stream": True, "temperature": 0, "max_tokens": 1000, "ignore_eos": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert [next(lines) for _ in range(6)]
        assert served.blocks_used() > 0
    deadline = time.monotonic() + 20
    while served.blocks_used() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert served.blocks_used() == 0
    assert served.complete(PROMPTS[1])["choices"][0]["text"] == one_rank_texts[1]


def test_a_rank_killed_mid_stream_ends_the_server_with_one_line(tmp_path_factory):
    srv = Served(tmp_path_factory, 3, "--distributed-timeout", "20")
    events: list[dict] = []

    def stream() -> None:
        body = {"prompt": PROMPT, "stream": True, "temperature": 0, "max_tokens": 1200, "ignore_eos": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    deadline = time.monotonic() + 60
    while len(events) < 5 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(events) >= 5, "".join(srv.log)
    victim = min(srv.ranks)
    start = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    rc = srv.proc.wait(60)
    took = time.monotonic() - start
    reader.join(10)
    log = "".join(srv.log)
    assert rc not in (0, None) and took < 20, (rc, took, log)
    errors = [e for e in events if "error" in e]
    assert errors and "tensor-parallel group lost" in errors[-1]["error"]["message"], events[-3:]
    final = [line for line in log.splitlines() if line.startswith("ridgefill: ")]
    assert len(final) == 1 and "tensor-parallel group lost during a step (rank " in final[0], log
    assert "its process exited with status -9" in final[0]
    assert not rank_processes(srv.proc.pid)
