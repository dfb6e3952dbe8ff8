"""Batches through `sluicegate serve` into a real vLLM, driven by the
official `openai` Python client. Run by tests/it/real_engine.rs (not a
pytest module: the simulator suite collects tests/python/test_*.py), which
starts the engine and the server and sets:

- SLUICEGATE_API_BASE: the server (its gateway is the engine);
- SLUICEGATE_KEY: an API key of the server;
- SLUICEGATE_MODEL: the model the engine serves;
- SLUICEGATE_LONG_PROMPT_WORDS: words in a prompt longer than the
  engine's context (its 400).

One batch on /v1/completions (three lines and one prompt over the context
length) and one on /v1/chat/completions (three lines). Exits 0 when every
check holds and prints one JSON line: the batch ids and counts.
"""

import io
import json
import os
import sys
import time

import openai

BASE = os.environ["SLUICEGATE_API_BASE"] + "/v1"
KEY = os.environ["SLUICEGATE_KEY"]
MODEL = os.environ["SLUICEGATE_MODEL"]
LONG_WORDS = int(os.environ["SLUICEGATE_LONG_PROMPT_WORDS"])
TERMINAL = {"completed", "failed", "expired", "cancelled"}
MAX_TOKENS = 6


def line(custom_id, url, body):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def run_batch(c, endpoint, lines):
    data = ("\n".join(lines) + "\n").encode()
    f = c.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")
    give_up = time.monotonic() + 180
    while b.status not in TERMINAL:
        assert time.monotonic() < give_up, f"batch stuck: {b}"
        time.sleep(0.2)
        b = c.batches.retrieve(b.id)
    return b


def jsonl(c, file_id):
    if not file_id:
        return []
    return [json.loads(l) for l in c.files.content(file_id).text.splitlines() if l]


def main():
    c = openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=60)

    # Completions, and one prompt longer than the engine's context.
    lines = [
        line(
            f"cmpl-{i}",
            "/v1/completions",
            {"model": MODEL, "prompt": f"Story {i}:", "max_tokens": MAX_TOKENS, "ignore_eos": True},
        )
        for i in range(3)
    ]
    lines.append(
        line(
            "cmpl-too-long",
            "/v1/completions",
            {"model": MODEL, "prompt": "hello " * LONG_WORDS, "max_tokens": MAX_TOKENS},
        )
    )
    b = run_batch(c, "/v1/completions", lines)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (4, 3, 1), b
    out = jsonl(c, b.output_file_id)
    assert sorted(o["custom_id"] for o in out) == ["cmpl-0", "cmpl-1", "cmpl-2"], out
    for o in out:
        assert o["error"] is None, o
        assert o["response"]["status_code"] == 200, o
        body = o["response"]["body"]
        assert body["object"] == "text_completion" and body["model"] == MODEL, body
        assert isinstance(body["choices"][0]["text"], str), body
        assert body["usage"]["completion_tokens"] == MAX_TOKENS, body
    [err] = jsonl(c, b.error_file_id)
    assert err["custom_id"] == "cmpl-too-long", err
    assert err["response"]["status_code"] == 400, err
    assert "maximum context length" in err["response"]["body"]["error"]["message"], err
    completions = b.id

    # Chat: the model's chat template renders the messages.
    lines = [
        line(
            f"chat-{i}",
            "/v1/chat/completions",
            {
                "model": MODEL,
                "messages": [
                    {"role": "system", "content": "You are terse."},
                    {"role": "user", "content": f"Question {i}?"},
                ],
                "max_tokens": MAX_TOKENS,
                "ignore_eos": True,
            },
        )
        for i in range(3)
    ]
    b = run_batch(c, "/v1/chat/completions", lines)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (3, 3, 0), b
    out = jsonl(c, b.output_file_id)
    assert sorted(o["custom_id"] for o in out) == ["chat-0", "chat-1", "chat-2"], out
    for o in out:
        assert o["response"]["status_code"] == 200, o
        body = o["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL, body
        message = body["choices"][0]["message"]
        assert message["role"] == "assistant" and isinstance(message["content"], str), body
        assert body["usage"]["completion_tokens"] == MAX_TOKENS, body
    assert jsonl(c, b.error_file_id) == []

    print(json.dumps({"completions": completions, "chat": b.id, "ok": True}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
