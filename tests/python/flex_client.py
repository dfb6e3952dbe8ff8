"""Flex requests and background responses of `sluicegate serve`, driven by
the official `openai` Python client, unchanged (issue 37). Run by
tests/it/flex_python.rs (pytest is given this file by name, so the Batch
API suite's `pytest tests/python` does not collect it), which starts the
servers (our simulator as the pool) and sets:

- SLUICEGATE_FLEX_BASE: a server whose gate is open (alice's and bob's keys);
- SLUICEGATE_FLEX_CLOSED: a server whose gate stays closed, with
  `serve.flex_max_wait = 1s`;
- SLUICEGATE_FLEX_CLOSED_METRICS: that server's `/metrics` URL;
- SLUICEGATE_FLEX_SLOW: a server (open gate) in front of a simulator whose
  decode is slow (25 ms a token), SLUICEGATE_FLEX_SLOW_SIM that simulator;
- SLUICEGATE_KEY_A / SLUICEGATE_KEY_B: alice's and bob's API keys.
"""

import asyncio
import os
import time
import urllib.request

import openai
import pytest

BASE = os.environ["SLUICEGATE_FLEX_BASE"] + "/v1"
CLOSED = os.environ["SLUICEGATE_FLEX_CLOSED"] + "/v1"
CLOSED_METRICS = os.environ["SLUICEGATE_FLEX_CLOSED_METRICS"]
SLOW = os.environ["SLUICEGATE_FLEX_SLOW"] + "/v1"
SLOW_SIM = os.environ["SLUICEGATE_FLEX_SLOW_SIM"]
KEY_A = os.environ["SLUICEGATE_KEY_A"]
KEY_B = os.environ["SLUICEGATE_KEY_B"]
ENDED = {"completed", "incomplete", "failed", "cancelled"}
MESSAGES = [{"role": "user", "content": "hello"}]


def client(base=BASE, key=KEY_A, retries=0):
    # Flex answers may be slow: OpenAI's guidance is a timeout of ~15 min.
    return openai.OpenAI(base_url=base, api_key=key, max_retries=retries, timeout=900)


def wait_until_ended(c, response_id):
    give_up = time.monotonic() + 60
    while True:
        r = c.responses.retrieve(response_id)
        if r.status in ENDED:
            return r
        assert time.monotonic() < give_up, f"{response_id} stayed {r.status}"
        time.sleep(0.2)


def refusals(cause):
    text = urllib.request.urlopen(CLOSED_METRICS, timeout=30).read().decode()
    for line in text.splitlines():
        if line.startswith("sluicegate_flex_refusals_total{") and f'reason="{cause}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_chat_completions_with_the_flex_tier():
    r = client().chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=8, service_tier="flex"
    )
    assert r.service_tier == "flex"
    assert r.choices[0].message.content


def test_responses_with_the_flex_tier():
    r = client().responses.create(
        model="sim-model", input="hello", max_output_tokens=8, service_tier="flex"
    )
    assert r.service_tier == "flex"
    assert r.output_text


def test_a_streamed_flex_chat_completion_arrives_in_order_and_completes():
    stream = client().chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=8, service_tier="flex", stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)


def running_at_the_engine():
    text = urllib.request.urlopen(SLOW_SIM + "/metrics", timeout=30).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:num_requests_running")
    )


def test_a_streamed_flex_chat_completion_streams_while_the_engine_runs():
    words = [" The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", "."]
    stream = client(base=SLOW).chat.completions.create(
        model="sim-model", messages=MESSAGES, max_tokens=200, service_tier="flex", stream=True
    )
    text, running_at_first, finished = "", None, False
    for chunk in stream:
        if not chunk.choices:
            continue
        piece = chunk.choices[0].delta.content or ""
        if piece and running_at_first is None:
            # The first piece of content: the engine still runs the request.
            running_at_first = running_at_the_engine()
        text += piece
        finished = finished or bool(chunk.choices[0].finish_reason)
    assert running_at_first == 1.0
    assert text == "".join(words[i % len(words)] for i in range(200))
    assert finished


def test_background_responses_are_polled_until_they_end():
    c = client()
    r = c.responses.create(
        model="sim-model", input="hello", max_output_tokens=8, background=True
    )
    assert r.status == "queued"
    assert r.background is True
    done = wait_until_ended(c, r.id)
    # The simulator writes up to max_output_tokens: OpenAI calls that
    # `incomplete`, with the text written so far.
    assert done.status == "incomplete"
    assert done.incomplete_details.reason == "max_output_tokens"
    assert done.output_text
    assert done.id == r.id
    # Another tenant cannot see it.
    with pytest.raises(openai.NotFoundError):
        client(key=KEY_B).responses.retrieve(r.id)
    # Cancelling an ended response changes nothing.
    assert c.responses.cancel(r.id).status == "incomplete"
    c.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)


def test_a_waiting_background_response_is_cancelled():
    c = client(base=CLOSED)
    r = c.responses.create(
        model="sim-model", input="hello", max_output_tokens=8, background=True
    )
    assert r.status == "queued"
    cancelled = c.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    assert c.responses.retrieve(r.id).status == "cancelled"


def test_the_async_client_with_the_flex_tier():
    async def run():
        c = openai.AsyncOpenAI(base_url=BASE, api_key=KEY_A, max_retries=0, timeout=900)
        chats = [
            c.chat.completions.create(
                model="sim-model", messages=MESSAGES, max_tokens=8, service_tier="flex"
            )
            for _ in range(3)
        ]
        answers = await asyncio.gather(*chats)
        r = await c.responses.create(
            model="sim-model", input="hi", max_output_tokens=8, background=True
        )
        polled = await c.responses.retrieve(r.id)
        await c.close()
        return answers, r, polled

    answers, r, polled = asyncio.run(run())
    assert [a.service_tier for a in answers] == ["flex"] * 3
    assert polled.id == r.id


def test_the_client_retries_on_our_429_and_then_raises_it():
    before = refusals("max_wait")
    c = client(base=CLOSED, retries=2)
    with pytest.raises(openai.RateLimitError) as raised:
        c.chat.completions.create(
            model="sim-model", messages=MESSAGES, max_tokens=8, service_tier="flex"
        )
    assert raised.value.status_code == 429
    assert raised.value.code == "resource_unavailable"
    assert raised.value.response.headers.get("retry-after") == "1"
    # The first attempt and the client's two retries, each refused after
    # serve.flex_max_wait.
    assert refusals("max_wait") - before == 3


def test_bad_input_is_refused_with_a_typed_error():
    with pytest.raises(openai.BadRequestError) as raised:
        client().chat.completions.create(
            model="sim-model", messages=MESSAGES, service_tier="cheap"
        )
    assert raised.value.param == "service_tier"
    with pytest.raises(openai.BadRequestError) as raised:
        client().chat.completions.create(model="sim-model", messages=MESSAGES)
    assert raised.value.code == "flex_required"
