"""The OpenAI surface evaluation tools need, on the real server (embedded SmolLM2), against
transformers on the same GGUF: logprobs / top_logprobs on completions and chat, echo with the
prompt's logprobs (max_tokens 0 too, the shape lm-eval's loglikelihood sends), n choices,
streamed equal to plain, /detokenize."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch

from ridgefill_runtime.loader.gguf import default_model_path
from served_app import serve_embedded

TOL = 1e-4
PROMPT = "The three most useful kitchen tools are"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    yield from serve_embedded(tmp_path_factory)


@pytest.fixture(scope="module")
def ref():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _post(served, path: str, body: dict) -> dict:
    r = httpx.post(served.url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _ids(served, **body) -> list[int]:
    return _post(served, "/tokenize", body)["tokens"]


def _ref_logp(ref, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def _ref_greedy(ref, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = ref.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def _text(served, token: int) -> str:
    return served.engine.tokenizer.decode([token])


def _check_top_dict(served, top: dict[str, float], row: torch.Tensor, k: int, chosen: int) -> None:
    """A completions top_logprobs entry: the reference's top k and the chosen token, by text."""
    best = row.topk(k)
    want = {_text(served, int(i)): float(v) for i, v in zip(best.indices, best.values)}
    want.setdefault(_text(served, chosen), float(row[chosen]))
    assert set(top) == set(want)
    assert max(abs(top[t] - want[t]) for t in want) < TOL


# -- completions ---------------------------------------------------------------------------------


def test_completion_logprobs_equal_transformers(served, ref):
    prompt_ids = _ids(served, prompt=PROMPT)
    want_ids = _ref_greedy(ref, prompt_ids, 8)
    out = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 3})
    lp = out["choices"][0]["logprobs"]
    logp = _ref_logp(ref, prompt_ids + want_ids)[len(prompt_ids) - 1 : -1]
    assert lp["tokens"] == [_text(served, t) for t in want_ids]
    got = torch.tensor(lp["token_logprobs"])
    assert (got - logp.gather(1, torch.tensor(want_ids)[:, None])[:, 0]).abs().max() < TOL
    for top, row, token in zip(lp["top_logprobs"], logp, want_ids):
        _check_top_dict(served, top, row, 3, token)
    text = out["choices"][0]["text"]
    assert "".join(lp["tokens"]) == text  # ASCII text: the tokens spell it, and the offsets place them
    assert all(text[o : o + len(t)] == t for o, t in zip(lp["text_offset"], lp["tokens"]))


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_gives_the_prompt_logprobs_of_transformers(served, ref, max_tokens):
    """What lm-eval's loglikelihood sends: token ids, echo, logprobs 1 (and max_tokens 1)."""
    text = PROMPT + " a knife, a pan and a spoon."
    ids = _ids(served, prompt=text)
    out = _post(
        served,
        "/v1/completions",
        {"prompt": [ids], "echo": True, "logprobs": 1, "max_tokens": max_tokens, "temperature": 0},
    )
    choice = out["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + max_tokens and out["usage"]["completion_tokens"] == max_tokens
    assert choice["text"].startswith(PROMPT) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    logp = _ref_logp(ref, ids)
    want = logp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor(lp["token_logprobs"][1 : len(ids)])
    assert (got - want).abs().max() < TOL
    for i in range(1, len(ids)):
        _check_top_dict(served, lp["top_logprobs"][i], logp[i - 1], 1, ids[i])
    # the echoed prompt's offsets run from 0; the generated token's starts where the prompt ends
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    if max_tokens:
        assert lp["text_offset"][-1] == len(text)
        assert abs(lp["token_logprobs"][-1] - float(logp[-1].max())) < TOL  # greedy: the argmax


def test_echo_without_logprobs_and_max_tokens_zero_returns_the_prompt(served):
    out = _post(served, "/v1/completions", {"prompt": PROMPT, "echo": True, "max_tokens": 0})
    assert out["choices"][0]["text"] == PROMPT and out["choices"][0]["logprobs"] is None
    assert out["usage"]["completion_tokens"] == 0


def test_openai_client_parses_completion_logprobs(served):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.completions.create(
        model="ridgefill", prompt=PROMPT, echo=True, logprobs=2, max_tokens=3, temperature=0
    )
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(len(top) in (2, 3) for top in lp.top_logprobs[1:])  # the top 2, and the token if not among them


# -- chat ------------------------------------------------------------------------------------------


def test_chat_logprobs_equal_transformers(served, ref):
    prompt_ids = _ids(served, messages=CHAT)
    want_ids = _ref_greedy(ref, prompt_ids, 6)
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = client.chat.completions.create(
        model="ridgefill", messages=CHAT, max_completion_tokens=6, temperature=0, logprobs=True, top_logprobs=4
    )
    content = out.choices[0].logprobs.content
    logp = _ref_logp(ref, prompt_ids + want_ids)[len(prompt_ids) - 1 : -1]
    assert [c.token for c in content] == [_text(served, t) for t in want_ids]
    assert b"".join(bytes(c.bytes) for c in content).decode() == out.choices[0].message.content
    for c, row, token in zip(content, logp, want_ids):
        assert abs(c.logprob - float(row[token])) < TOL
        best = row.topk(4)
        assert [t.token for t in c.top_logprobs] == [_text(served, int(i)) for i in best.indices]
        assert max(abs(t.logprob - float(v)) for t, v in zip(c.top_logprobs, best.values)) < TOL


def test_chat_without_logprobs_has_none(served):
    out = _post(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "temperature": 0})
    assert out["choices"][0]["logprobs"] is None


def test_split_character_tokens_carry_their_bytes(served):
    """Byte-level tokens holding part of a UTF-8 character: their text is U+FFFD, their bytes
    add up to the character."""
    ids = _ids(served, prompt="日本", add_special_tokens=False)
    strings = [_text(served, t) for t in ids]
    assert "\ufffd" in "".join(strings), "the test needs a character split over tokens"
    out = _post(served, "/v1/completions", {"prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0})
    assert out["choices"][0]["text"] == "日本" and out["choices"][0]["logprobs"]["tokens"] == strings
    from ridgefill_server.logprobs import TokenStrings

    tokens = TokenStrings(served.engine.tokenizer)
    assert b"".join(tokens.bytes(t) for t in ids).decode() == "日本"


# -- streamed == plain -----------------------------------------------------------------------------


def _events(served, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", served.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    return [json.loads(e[len("data: ") :]) for e in raw.split("\n\n") if e.startswith("data: {")]


def _joined_completion(events: list[dict]) -> dict[int, dict]:
    """Per choice index, the chunks' text, logprobs and finish reason joined."""
    out: dict[int, dict] = {}
    for event in events:
        for c in event["choices"]:
            acc = out.setdefault(
                c["index"],
                {
                    "text": "",
                    "finish_reason": None,
                    "logprobs": {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []},
                },
            )
            acc["text"] += c["text"]
            acc["finish_reason"] = c["finish_reason"] or acc["finish_reason"]
            for key in acc["logprobs"]:
                acc["logprobs"][key] += c["logprobs"][key]
    return out


def _close(a, b) -> None:
    """Equal, with floats to 1e-5 (two runs of one request)."""
    if isinstance(a, float) or isinstance(b, float):
        assert abs(a - b) < 1e-5
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            _close(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _close(x, y)
    else:
        assert a == b


def test_streamed_completion_equals_plain_with_echo_logprobs_and_two_choices(served):
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0.9, "seed": 5, "n": 2, "echo": True, "logprobs": 2}
    plain = _post(served, "/v1/completions", body)["choices"]
    events = _events(served, "/v1/completions", body)
    assert all(len(e["choices"]) == 1 for e in events)  # one choice per chunk, named by its index
    joined = _joined_completion(events)
    assert sorted(joined) == [0, 1]
    for choice in plain:
        got = joined[choice["index"]]
        assert got["text"] == choice["text"] and got["finish_reason"] == choice["finish_reason"]
        _close(got["logprobs"], choice["logprobs"])


def test_streamed_chat_equals_plain_with_logprobs_and_two_choices(served):
    body = {
        "messages": CHAT,
        "max_tokens": 8,
        "temperature": 0.9,
        "seed": 3,
        "n": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "stream_options": {"include_usage": True},
    }
    plain = _post(served, "/v1/chat/completions", body)
    events = _events(served, "/v1/chat/completions", body)
    assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]
    joined: dict[int, dict] = {}
    for event in events[:-1]:
        (c,) = event["choices"]
        acc = joined.setdefault(c["index"], {"content": "", "logprobs": [], "finish_reason": None})
        acc["content"] += c["delta"].get("content") or ""
        acc["logprobs"] += (c["logprobs"] or {"content": []})["content"]
        acc["finish_reason"] = c["finish_reason"] or acc["finish_reason"]
    for choice in plain["choices"]:
        got = joined[choice["index"]]
        assert got["content"] == choice["message"]["content"] and got["finish_reason"] == choice["finish_reason"]
        _close(got["logprobs"], choice["logprobs"]["content"])


# -- n choices ---------------------------------------------------------------------------------------


def test_greedy_n_gives_identical_choices_and_usage_counts_the_prompt_once(served):
    one = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    three = _post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "n": 3})
    assert [c["index"] for c in three["choices"]] == [0, 1, 2]
    assert {c["text"] for c in three["choices"]} == {one["choices"][0]["text"]}
    u1, u3 = one["usage"], three["usage"]
    assert u3["prompt_tokens"] == u1["prompt_tokens"] and u3["completion_tokens"] == 3 * u1["completion_tokens"]
    assert u3["total_tokens"] == u3["prompt_tokens"] + u3["completion_tokens"]


def test_seeded_n_choice_i_is_the_single_request_with_seed_plus_i(served):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": 11}
    many = _post(served, "/v1/completions", {**body, "n": 3})["choices"]
    alone = [_post(served, "/v1/completions", {**body, "seed": 11 + i})["choices"][0]["text"] for i in range(3)]
    assert [c["text"] for c in many] == alone
    assert len(set(alone)) > 1, "sampled choices should differ, or the seeds prove nothing"
    chat = _post(
        served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "temperature": 1.0, "seed": 4, "n": 2}
    )["choices"]
    chat_alone = [
        _post(served, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "temperature": 1.0, "seed": 4 + i})[
            "choices"
        ][0]["message"]["content"]
        for i in range(2)
    ]
    assert [c["message"]["content"] for c in chat] == chat_alone


def test_disconnect_mid_stream_ends_every_choice(served):
    blocks = served.engine.blocks
    free_before = blocks.num_free
    body = {"prompt": PROMPT * 10, "stream": True, "temperature": 0.8, "max_tokens": 2000, "ignore_eos": True, "n": 3}
    seen = set()
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            if len(seen) == 3:
                break
        assert len(served.engine.scheduler.running) == 3  # all three decode while it streams
    deadline = time.monotonic() + 10
    while blocks.num_free != free_before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert blocks.num_free == free_before and not served.engine.has_unfinished()


# -- /detokenize --------------------------------------------------------------------------------------


def test_detokenize_inverts_tokenize(served):
    text = "<|im_start|>user\nZürich, 日本 and tabs\there<|im_end|>"
    ids = _ids(served, prompt=text, add_special_tokens=False)
    assert _post(served, "/detokenize", {"tokens": ids}) == {"prompt": text}
    assert _post(served, "/detokenize", {"tokens": []}) == {"prompt": ""}


def test_n_choices_with_echo_logprobs_score_the_prompt_once(served):
    """n = 4, echo, logprobs: choice 0 scores the prompt; the others echo its scores (equal to
    the n = 1 answer's) and start from its published blocks instead of computing the prompt."""
    prompt = "The river mill ground wheat for the whole valley. " * 12  # ~150 tokens, several blocks
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0.9, "seed": 1, "echo": True, "logprobs": 2}
    alone = _post(served, "/v1/completions", body)["choices"][0]["logprobs"]
    before = served.engine.stats().prefix_hit_tokens_total
    choices = _post(served, "/v1/completions", {**body, "n": 4})["choices"]
    hit = served.engine.stats().prefix_hit_tokens_total - before
    n_prompt = len(served.engine.tokenizer.encode(prompt))
    bs = served.engine.blocks.block_size
    assert hit >= 3 * ((n_prompt - 1) // bs) * bs  # every other choice took every full block
    first = choices[0]["logprobs"]
    for c in choices:  # one scoring, echoed by all: the same numbers
        lp = c["logprobs"]
        assert lp["token_logprobs"][:n_prompt] == first["token_logprobs"][:n_prompt]
        assert lp["top_logprobs"][:n_prompt] == first["top_logprobs"][:n_prompt]
    # and the n = 1 answer's, to the batching bound (the steps around the prefill differ)
    assert first["tokens"][:n_prompt] == alone["tokens"][:n_prompt]
    got, want = first["token_logprobs"][1:n_prompt], alone["token_logprobs"][1:n_prompt]
    assert max(abs(a - b) for a, b in zip(got, want)) < TOL
