"""The Batch API's Idempotency-Key with the official openai client: a
retried create returns the first object, a different body under the same
key is a 409 ConflictError, and keys are scoped per tenant."""

import io
import os
import uuid

import openai
import pytest

BASE = os.environ["SLUICEGATE_API_BASE"] + "/v1"
KEY_A = os.environ["SLUICEGATE_KEY_A"]
KEY_B = os.environ["SLUICEGATE_KEY_B"]


def client(key=KEY_A):
    return openai.OpenAI(base_url=BASE, api_key=key, max_retries=0, timeout=30)


def data(prompt):
    line = (
        '{"custom_id": "i-1", "method": "POST", "url": "/v1/completions", '
        '"body": {"model": "sim-model", "prompt": "%s", "max_tokens": 4}}\n' % prompt
    )
    return ("input.jsonl", io.BytesIO(line.encode()))


def key(tag):
    return f"{tag}-{uuid.uuid4()}"


def test_a_retried_upload_returns_the_same_file_and_another_body_conflicts():
    c, k = client(), key("file")
    first = c.files.create(file=data("hi"), purpose="batch", extra_headers={"Idempotency-Key": k})
    again = c.files.create(file=data("hi"), purpose="batch", extra_headers={"Idempotency-Key": k})
    assert again.id == first.id and again.bytes == first.bytes
    with pytest.raises(openai.ConflictError) as err:
        c.files.create(file=data("bye"), purpose="batch", extra_headers={"Idempotency-Key": k})
    assert err.value.status_code == 409
    assert err.value.code == "idempotency_key_conflict"
    assert k in err.value.message
    other = c.files.create(file=data("hi"), purpose="batch")
    assert other.id != first.id


def test_a_retried_create_returns_the_same_batch_and_another_body_conflicts():
    c, k = client(), key("batch")
    f = c.files.create(file=data("hi"), purpose="batch")
    make = lambda **extra: c.batches.create(
        input_file_id=f.id,
        endpoint="/v1/completions",
        completion_window="24h",
        extra_headers={"Idempotency-Key": k},
        **extra,
    )
    first = make()
    again = make()
    assert again.id == first.id
    assert first.id in {b.id for b in c.batches.list(limit=100)}
    with pytest.raises(openai.ConflictError) as err:
        make(metadata={"run": "2"})
    assert err.value.code == "idempotency_key_conflict"
    assert err.value.body["type"] == "invalid_request_error"


def test_keys_are_scoped_per_tenant():
    alice, bob, k = client(), client(KEY_B), key("tenant")
    fa = alice.files.create(file=data("hi"), purpose="batch", extra_headers={"Idempotency-Key": k})
    fb = bob.files.create(file=data("hi"), purpose="batch", extra_headers={"Idempotency-Key": k})
    assert fa.id != fb.id
    # Bob's key names his own file; Alice's is untouched.
    fb2 = bob.files.create(file=data("hi"), purpose="batch", extra_headers={"Idempotency-Key": k})
    assert fb2.id == fb.id
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(fa.id)


def test_a_deleted_file_frees_its_key():
    c, k = client(), key("deleted")
    first = c.files.create(file=data("hi"), purpose="batch", extra_headers={"Idempotency-Key": k})
    c.files.delete(first.id)
    again = c.files.create(file=data("hi"), purpose="batch", extra_headers={"Idempotency-Key": k})
    assert again.id != first.id
    assert c.files.retrieve(again.id).id == again.id
