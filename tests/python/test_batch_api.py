"""The OpenAI Batch API of `sluicegate serve`, driven by the official
`openai` Python client. Run by tests/it/batch_api_python.rs, which starts the
servers (our simulator as the pool) and sets:

- SLUICEGATE_API_BASE: a server whose gate is open (alice and bob's keys);
- SLUICEGATE_API_BASE_CLOSED: a server whose gate stays closed, so its
  batches wait (for cancel);
- SLUICEGATE_API_BASE_SHORT: a server keeping files 2 s
  (`serve.file_retention`), for expiry;
- SLUICEGATE_API_BASE_LIMITED: a server whose gate stays closed and whose
  tenants may each have 3 requests enqueued (`serve.tenant_limits`);
- SLUICEGATE_KEY_A / SLUICEGATE_KEY_B: alice's and bob's API keys.
"""

import asyncio
import io
import json
import os
import time

import openai
import pytest

BASE = os.environ["SLUICEGATE_API_BASE"] + "/v1"
CLOSED = os.environ["SLUICEGATE_API_BASE_CLOSED"] + "/v1"
SHORT = os.environ["SLUICEGATE_API_BASE_SHORT"] + "/v1"
LIMITED = os.environ["SLUICEGATE_API_BASE_LIMITED"] + "/v1"
KEY_A = os.environ["SLUICEGATE_KEY_A"]
KEY_B = os.environ["SLUICEGATE_KEY_B"]
TERMINAL = {"completed", "failed", "expired", "cancelled"}


def client(base=BASE, key=KEY_A):
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=30)


def line(custom_id, model="sim-model", max_tokens=8):
    return json.dumps(
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": "hello", "max_tokens": max_tokens},
        }
    )


def upload(c, lines):
    data = ("\n".join(lines) + "\n").encode()
    return c.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")


def create(c, lines, **extra):
    f = upload(c, lines)
    assert f.object == "file" and f.purpose == "batch" and f.bytes > 0
    return c.batches.create(
        input_file_id=f.id,
        endpoint="/v1/completions",
        completion_window="24h",
        **extra,
    )


def poll(c, batch_id, until=TERMINAL, within=60.0):
    give_up = time.monotonic() + within
    seen = []
    while True:
        b = c.batches.retrieve(batch_id)
        seen.append((b.status, b.request_counts.completed if b.request_counts else 0))
        if b.status in until:
            return b, seen
        assert time.monotonic() < give_up, f"batch stuck: {b}"
        time.sleep(0.1)


def jsonl(c, file_id):
    return [json.loads(l) for l in c.files.content(file_id).text.splitlines() if l]


def test_upload_create_poll_and_download_output_and_errors():
    c = client()
    # r-bad is refused by the pool (model must be a string): the error file.
    lines = [line(f"r{i}") for i in range(6)] + [line("r-bad", model=5)]
    b = create(c, lines, metadata={"team": "search"})
    assert b.object == "batch" and b.status == "validating"
    assert b.metadata == {"team": "search"}
    done, _ = poll(c, b.id)
    assert done.status == "completed", done
    assert done.request_counts.total == 7
    assert done.request_counts.completed == 6
    assert done.request_counts.failed == 1
    assert done.completed_at and done.in_progress_at and done.finalizing_at
    out = jsonl(c, done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == [f"r{i}" for i in range(6)]
    for o in out:
        assert o["response"]["status_code"] == 200
        assert o["response"]["body"]["choices"][0]["text"]
        assert o["error"] is None
    errors = jsonl(c, done.error_file_id)
    assert [e["custom_id"] for e in errors] == ["r-bad"]
    assert errors[0]["response"]["status_code"] == 400
    meta = c.files.retrieve(done.output_file_id)
    assert meta.purpose == "batch_output"


def test_invalid_lines_fail_the_batch_with_line_numbers():
    c = client()
    b = create(c, [line("ok"), "{not json", line("ok")])
    done, _ = poll(c, b.id)
    assert done.status == "failed"
    assert [(e.line, e.code) for e in done.errors.data] == [
        (2, "invalid_json_line"),
        (3, "duplicate_custom_id"),
    ]


def test_cancel_keeps_the_batch_and_answers_waiting_requests():
    c = client(CLOSED)
    b = create(c, [line(f"c{i}") for i in range(3)])
    poll(c, b.id, until={"in_progress"})
    cancelling = c.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done, _ = poll(c, b.id)
    assert done.status == "cancelled"
    assert done.cancelled_at and done.cancelling_at
    assert done.request_counts.failed == 3
    errors = jsonl(c, done.error_file_id)
    assert {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(b.id)


def test_list_batches_with_after_and_limit():
    c = client(key=KEY_B)
    made = [create(c, [line("p")]).id for _ in range(3)]
    first = c.batches.list(limit=2)
    assert [b.id for b in first.data] == made[::-1][:2]
    assert first.has_more
    rest = c.batches.list(limit=2, after=first.data[-1].id)
    assert [b.id for b in rest.data] == made[::-1][2:]
    assert not rest.has_more
    # The client's auto-pagination follows `after` through every page.
    assert [b.id for b in c.batches.list(limit=1)] == made[::-1]
    files = c.files.list()
    assert {f.id for f in files.data} >= {c.batches.retrieve(i).input_file_id for i in made}


def test_another_tenant_gets_404():
    alice, bob = client(), client(key=KEY_B)
    b = create(alice, [line("mine")])
    with pytest.raises(openai.NotFoundError):
        bob.batches.retrieve(b.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(b.input_file_id)
    with pytest.raises(openai.NotFoundError):
        bob.files.content(b.input_file_id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.cancel(b.id)
    with pytest.raises(openai.NotFoundError):
        bob.batches.create(
            input_file_id=b.input_file_id,
            endpoint="/v1/completions",
            completion_window="24h",
        )
    assert b.id not in {x.id for x in bob.batches.list()}
    with pytest.raises(openai.AuthenticationError):
        client(key="wrong").batches.list()


def test_files_can_be_deleted():
    c = client()
    f = upload(c, [line("d")])
    deleted = c.files.delete(f.id)
    assert deleted.deleted and deleted.id == f.id
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(f.id)


def bad_request(call):
    with pytest.raises(openai.BadRequestError) as e:
        call()
    assert e.value.type == "invalid_request_error", e.value
    return e.value.param


def test_bad_list_parameters_are_json_errors_naming_them():
    c = client()
    assert bad_request(lambda: c.batches.list(limit=-1)) == "limit"
    assert bad_request(lambda: c.batches.list(extra_query={"limit": "abc"})) == "limit"
    assert bad_request(lambda: c.batches.list(limit=101)) == "limit"
    assert bad_request(lambda: c.batches.list(after="batch_unknown")) == "after"
    assert bad_request(lambda: c.files.list(order="sideways")) == "order"
    assert bad_request(lambda: c.files.list(limit=0)) == "limit"


def test_metadata_over_openai_limits_is_refused():
    c = client()
    f = upload(c, [line("m")])

    def make(metadata):
        return lambda: c.batches.create(
            input_file_id=f.id,
            endpoint="/v1/completions",
            completion_window="24h",
            metadata=metadata,
        )

    assert bad_request(make({f"k{i}": "v" for i in range(17)})) == "metadata"
    assert bad_request(make({"k" * 65: "v"})) == "metadata"
    assert bad_request(make({"k": "v" * 513})) == "metadata"
    ok = make({f"{i:0>64}": "v" * 512 for i in range(16)})()
    assert len(ok.metadata) == 16


def test_completion_window_outside_a_minute_to_a_week_is_refused():
    c = client()
    f = upload(c, [line("w")])
    for window in ["24", "100ms", "100000h"]:
        param = bad_request(
            lambda: c.batches.create(
                input_file_id=f.id,
                endpoint="/v1/completions",
                completion_window=window,
            )
        )
        assert param == "completion_window", window


def test_a_file_with_a_byte_order_mark_runs():
    c = client()
    data = ("\ufeff" + "\n".join(line(f"bom{i}") for i in range(2)) + "\n").encode()
    f = c.files.create(file=("bom.jsonl", io.BytesIO(data)), purpose="batch")
    b = c.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
    )
    done, _ = poll(c, b.id)
    assert done.status == "completed", done
    assert sorted(o["custom_id"] for o in jsonl(c, done.output_file_id)) == ["bom0", "bom1"]


def test_request_counts_never_contradict():
    c = client()
    n = 3000
    b = create(c, [line(f"n{i}", max_tokens=1) for i in range(n)])
    last = (0, 0, 0)
    give_up = time.monotonic() + 300
    while True:
        now = c.batches.retrieve(b.id)
        rc = now.request_counts
        counts = (rc.total, rc.completed, rc.failed)
        assert rc.completed + rc.failed <= rc.total, (now.status, counts)
        assert all(x >= y for x, y in zip(counts, last)), (now.status, last, counts)
        if now.status != "validating":
            assert rc.total == n, (now.status, counts)
        last = counts
        if now.status in TERMINAL:
            assert now.status == "completed" and counts == (n, n, 0), now
            return
        assert time.monotonic() < give_up, now
        time.sleep(0.02)


def test_embeddings_and_responses_batches():
    from openai.types import CreateEmbeddingResponse
    from openai.types.responses import Response

    c = client()
    # Bodies as client.embeddings.create and client.responses.create send them.
    emb = [
        {"custom_id": "e-text", "input": "the quick brown fox"},
        {"custom_id": "e-list", "input": ["the quick brown fox", "a lazy dog"]},
        {"custom_id": "e-tokens", "input": [[101, 2023], [7, 8, 9]]},
    ]
    lines = [
        json.dumps(
            {
                "custom_id": e["custom_id"],
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": "sim-model", "input": e["input"], "encoding_format": "float"},
            }
        )
        for e in emb
    ]
    f = upload(c, lines)
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    done, _ = poll(c, b.id)
    assert done.status == "completed", done
    out = {o["custom_id"]: o for o in jsonl(c, done.output_file_id)}
    vectors = {}
    for e in emb:
        o = out[e["custom_id"]]
        assert o["response"]["status_code"] == 200 and o["error"] is None
        parsed = CreateEmbeddingResponse.model_validate(o["response"]["body"])
        n = len(e["input"]) if isinstance(e["input"], list) else 1
        assert [d.index for d in parsed.data] == list(range(n))
        assert all(len(d.embedding) == 16 for d in parsed.data)
        assert parsed.usage.prompt_tokens > 0
        vectors[e["custom_id"]] = [d.embedding for d in parsed.data]
    # The same text, the same vector.
    assert vectors["e-text"][0] == vectors["e-list"][0]
    assert vectors["e-list"][0] != vectors["e-list"][1]

    lines = [
        json.dumps(
            {
                "custom_id": "r1",
                "method": "POST",
                "url": "/v1/responses",
                "body": {
                    "model": "sim-model",
                    "input": [{"role": "user", "content": "Say hello"}],
                    "max_output_tokens": 5,
                },
            }
        )
    ]
    f = upload(c, lines)
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/responses", completion_window="24h")
    done, _ = poll(c, b.id)
    assert done.status == "completed", done
    [o] = jsonl(c, done.output_file_id)
    r = Response.model_validate(o["response"]["body"])
    assert r.output_text
    assert r.usage.output_tokens == 5 and r.usage.input_tokens > 0

    # A line without its endpoint's required field fails the batch by line.
    bad = json.dumps(
        {"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {"model": "sim-model"}}
    )
    f = upload(c, [bad])
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    done, _ = poll(c, b.id)
    assert done.status == "failed"
    assert [(e.line, e.code, e.param) for e in done.errors.data] == [(1, "invalid_request", "body.input")]


def test_expires_after_on_uploads_and_batch_outputs():
    c = client()
    data = ("\n".join([line("x0"), line("x1")]) + "\n").encode()
    f = c.files.create(
        file=("in.jsonl", io.BytesIO(data)),
        purpose="batch",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert f.expires_at == f.created_at + 3600
    assert c.files.retrieve(f.id).expires_at == f.expires_at
    for seconds in (3599, 2592001):
        param = bad_request(
            lambda: c.files.create(
                file=("in.jsonl", io.BytesIO(data)),
                purpose="batch",
                expires_after={"anchor": "created_at", "seconds": seconds},
            )
        )
        assert param == "expires_after", seconds
    assert (
        bad_request(
            lambda: c.batches.create(
                input_file_id=f.id,
                endpoint="/v1/completions",
                completion_window="24h",
                output_expires_after={"anchor": "created_at", "seconds": 60},
            )
        )
        == "output_expires_after"
    )
    b = c.batches.create(
        input_file_id=f.id,
        endpoint="/v1/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    done, _ = poll(c, b.id)
    assert done.status == "completed", done
    out = c.files.retrieve(done.output_file_id)
    assert out.expires_at == out.created_at + 7200


def test_an_expired_file_answers_404_and_leaves_the_list():
    # SLUICEGATE_API_BASE_SHORT keeps files 2 s (serve.file_retention).
    c = client(SHORT)
    f = upload(c, [line("gone")])
    assert f.expires_at == f.created_at + 2
    assert f.id in {x.id for x in c.files.list()}
    give_up = time.monotonic() + 30
    while True:
        try:
            c.files.retrieve(f.id)
        except openai.NotFoundError:
            break
        assert time.monotonic() < give_up, "the file never expired"
        time.sleep(0.2)
    with pytest.raises(openai.NotFoundError):
        c.files.content(f.id)
    assert f.id not in {x.id for x in c.files.list()}


def test_a_batch_over_the_tenant_limit_raises_rate_limit_error():
    c = client(LIMITED)
    held = create(c, [line("r0"), line("r1"), line("r2")])
    assert held.status == "validating"
    with pytest.raises(openai.RateLimitError) as refused:
        create(c, [line("r3")])
    assert refused.value.status_code == 429
    assert refused.value.code == "request_limit_exceeded"
    assert "Enqueued request limit reached for tenant alice" in refused.value.message
    assert [b.id for b in c.batches.list()] == [held.id]

    async def refused_async():
        a = openai.AsyncOpenAI(base_url=LIMITED, api_key=KEY_A, max_retries=0, timeout=30)
        f = await a.files.create(file=("input.jsonl", io.BytesIO((line("r4") + "\n").encode())), purpose="batch")
        with pytest.raises(openai.RateLimitError):
            await a.batches.create(
                input_file_id=f.id, endpoint="/v1/completions", completion_window="24h"
            )
        await a.close()

    asyncio.run(refused_async())
    # Another tenant has its own room.
    assert create(client(LIMITED, KEY_B), [line("r0"), line("r1"), line("r2")]).id
    # Cancelling the held batch frees its requests.
    c.batches.cancel(held.id)
    poll(c, held.id)
    assert create(c, [line("r3")]).status == "validating"


def test_a_prefix_ordered_batch_answers_every_custom_id_once():
    # Issue 26 item 7: lines sharing three long system prompts, shuffled,
    # in a batch whose metadata asks for the model-prefix order (on the
    # sync and the async client): reordered before dispatch, every
    # custom_id still comes back exactly once, answered.
    systems = [f"You are assistant {k}. " + ("Follow the house style. " * 40) for k in range(3)]
    lines = []
    for i in range(60):
        body = {
            "model": "sim-model",
            "messages": [
                {"role": "system", "content": systems[(i * 7) % 3]},
                {"role": "user", "content": f"Question {i}: what changed?"},
            ],
            "max_tokens": 4,
        }
        lines.append(
            json.dumps(
                {"custom_id": f"p-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
            )
        )
    c = client()
    f = upload(c, lines)
    want = {f"p-{i}" for i in range(60)}

    def check(b):
        assert b.status == "completed", b
        assert b.metadata == {"sluicegate_order": "model-prefix"}
        assert b.request_counts.total == 60 and b.request_counts.completed == 60
        out = jsonl(c, b.output_file_id)
        ids = [o["custom_id"] for o in out]
        assert len(ids) == len(set(ids)) == 60 and set(ids) == want
        assert all(o["response"]["status_code"] == 200 for o in out)
        assert all(o["response"]["body"]["object"] == "chat.completion" for o in out)

    b = c.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"sluicegate_order": "model-prefix"},
    )
    check(poll(c, b.id)[0])

    async def run_async():
        ac = openai.AsyncOpenAI(base_url=BASE, api_key=KEY_A, max_retries=0, timeout=30)
        b = await ac.batches.create(
            input_file_id=f.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"sluicegate_order": "model-prefix"},
        )
        give_up = time.monotonic() + 60
        while b.status not in TERMINAL:
            assert time.monotonic() < give_up, f"batch stuck: {b}"
            await asyncio.sleep(0.1)
            b = await ac.batches.retrieve(b.id)
        await ac.close()
        return b

    check(asyncio.run(run_async()))

    shuffled = lambda: c.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"sluicegate_order": "shuffled"},
    )
    assert bad_request(shuffled) == "metadata"
