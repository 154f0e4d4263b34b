"""Fuzz the server's request bodies with schemathesis: no generated request may get a 5xx, and
every error must have the OpenAI-style body.

    .venv/bin/python scripts/reliability/fuzz_server.py [--cases 1200] [--budget-s 540] [--seed 1]

Serves the embedded model in this process (torch threads 1) on a free loopback port, with a
64-token context so every generation is short, loads the schema from its /openapi.json, and
runs schemathesis's positive (schema-valid) and negative (schema-violating) bodies against
/v1/completions, /v1/chat/completions and /tokenize, split evenly; positive bodies lose the
fields that are refused first (REFUSED_EARLY), so more of them reach the engine. Bounded in cases and time:
past --budget-s the remaining cases are skipped. Prints one summary line; exits 1 on any 5xx
or malformed error body, naming each with a curl command to reproduce it.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

OPERATIONS = (("/v1/completions", "POST"), ("/v1/chat/completions", "POST"), ("/tokenize", "POST"))
ERROR_FIELDS = {"message", "type", "param", "code"}
# Fields refused before the prompt is even looked at (a random model name is a 404, n != 1 a
# 400): positive cases drop them, so that more of them reach the tokenizer and the engine.
REFUSED_EARLY = ("model", "n", "logprobs", "echo")


def serve_embedded_model():
    """A BackgroundServer over the embedded model with a 64-token context (4 blocks of 16)."""
    from ridgefill_runtime.config import CacheConfig, EngineConfig
    from ridgefill_runtime.llm import build_engine
    from ridgefill_server.app import create_app
    from ridgefill_server.background import BackgroundServer
    from ridgefill_server.config import load_config

    engine = build_engine(EngineConfig(cache=CacheConfig(num_blocks=4)))
    engine_cfg, server_cfg, fill = load_config(None, {"server.log_level": "error"})
    return BackgroundServer(create_app(engine_cfg, server_cfg, fill, build=lambda: engine))


class Tally:
    def __init__(self, deadline: float):
        self.deadline = deadline
        self.statuses: collections.Counter[int] = collections.Counter()
        self.failures: list[str] = []
        self.skipped = 0

    @property
    def cases(self) -> int:
        return sum(self.statuses.values())

    def record(self, case, response) -> None:
        self.statuses[response.status_code] += 1
        problem = _problem(response)
        if problem:
            self.failures.append(f"{problem}: {response.text[:300]}\n    {case.as_curl_command()}")


def _problem(response) -> str | None:
    if response.status_code >= 500:
        return f"{response.status_code} from {response.request.method} {response.request.url}"
    if response.status_code >= 400:
        try:
            err = response.json()["error"]
            if not ERROR_FIELDS <= set(err):
                raise KeyError
        except (ValueError, KeyError, TypeError):
            return f"{response.status_code} without an OpenAI-style error body"
    return None


def fuzz(schema, base_url: str, tally: Tally, per_run: int, seed: int) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hypothesis_seed
    from schemathesis import GenerationMode

    for path, method in OPERATIONS:
        operation = schema[path][method]
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @hypothesis_seed(seed)
            @settings(max_examples=per_run, deadline=None, database=None, suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                if time.monotonic() > tally.deadline:  # out of time: let hypothesis finish quickly
                    tally.skipped += 1
                    return
                if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
                    for name in REFUSED_EARLY:
                        case.body.pop(name, None)
                try:
                    response = case.call(base_url=base_url, timeout=60)
                except Exception as e:  # noqa: BLE001 - a dropped connection is a finding, not a crash
                    tally.failures.append(f"no response ({type(e).__name__}: {e})\n    {case.as_curl_command()}")
                    return
                tally.record(case, response)

            run()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=1200, help="generated requests in all (default 1200)")
    p.add_argument("--budget-s", type=float, default=540.0, help="stop sending after this long (default 540)")
    p.add_argument("--seed", type=int, default=1, help="hypothesis seed, for a repeatable run")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    scratch = Path(tempfile.gettempdir())
    os.environ.setdefault("RIDGEFILL_CACHE_DIR", str(scratch / "ridgefill-fuzz-cache"))
    # NOTE: hypothesis keeps a cache of constants even without a database; not in the repository.
    os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", str(scratch / "ridgefill-fuzz-hypothesis"))
    import schemathesis

    start = time.monotonic()
    with serve_embedded_model() as srv:
        srv.wait_ready(300)
        schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
        tally = Tally(deadline=start + args.budget_s)
        per_run = -(-args.cases // (2 * len(OPERATIONS)))
        fuzz(schema, srv.url, tally, per_run, args.seed)
    seconds = time.monotonic() - start
    for failure in tally.failures:
        print(failure, file=sys.stderr)
    fivexx = sum(n for status, n in tally.statuses.items() if status >= 500)
    histogram = " ".join(f"{status}:{n}" for status, n in sorted(tally.statuses.items()))
    print(
        f"fuzz_server: {tally.cases} cases ({tally.skipped} skipped past the budget), statuses {histogram}, "
        f"5xx {fivexx}, bad error bodies {len(tally.failures) - fivexx}, {seconds:.0f} s"
    )
    return 1 if tally.failures else 0


if __name__ == "__main__":
    sys.exit(main())
