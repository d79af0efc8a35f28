"""The sim-engine's reading of an OpenAI request body, as vLLM reads it: what it accepts, and the
400 or 404 (with the offending parameter) for what it does not."""

from __future__ import annotations

from typing import Any

import pytest

from kvplane.connector.simengine.engine import SimEngine
from kvplane.connector.simengine.openai_api import RequestError, parse_request
from kvplane.connector.simengine.settings import SimEngineSettings

MODEL = "kvplane-sim"


@pytest.fixture(scope="module")
def engine() -> SimEngine:
    """An engine never started: parsing reads only its settings."""
    return SimEngine(
        SimEngineSettings(
            num_blocks=16, vocab_size=1000, max_model_len=64, default_max_tokens=8, reasoning_tokens=3
        )
    )


def test_a_completion_of_token_ids_takes_its_defaults_from_the_engine(engine: SimEngine) -> None:
    p = parse_request(engine, {"model": MODEL, "prompt": [1, 2, 3]}, chat=False)
    assert not p.chat and not p.stream and not p.include_usage and not p.return_token_ids
    assert p.request.prompt_token_ids == (1, 2, 3) and p.request.max_tokens == 8
    assert p.request.request_id.startswith("cmpl-") and p.request.kv_transfer_params is None
    assert p.request.reasoning_tokens == 0 and p.request.cache_salt is None


def test_a_batch_of_one_prompt_is_that_prompt_and_text_is_tokenized(engine: SimEngine) -> None:
    assert parse_request(engine, {"prompt": [[5, 6]]}, chat=False).request.prompt_token_ids == (5, 6)
    assert len(parse_request(engine, {"prompt": ["hello"]}, chat=False).request.prompt_token_ids) > 0


def test_a_chat_is_rendered_and_thinks_unless_told_not_to(engine: SimEngine) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4}
    p = parse_request(engine, body, chat=True)
    assert p.chat and p.request.max_tokens == 4 and p.request.reasoning_tokens == 3
    assert p.request.request_id.startswith("chatcmpl-") and p.request.prompt_token_ids
    quiet = parse_request(engine, {**body, "chat_template_kwargs": {"enable_thinking": False}}, chat=True)
    assert quiet.request.reasoning_tokens == 0


def test_stream_options_count_only_when_streaming(engine: SimEngine) -> None:
    opts = {"prompt": [1], "stream_options": {"include_usage": True}}
    assert not parse_request(engine, opts, chat=False).include_usage
    streamed = parse_request(engine, {**opts, "stream": True, "return_token_ids": True}, chat=False)
    assert streamed.stream and streamed.include_usage and streamed.return_token_ids


def test_the_callers_request_id_is_kept_with_a_suffix_that_keeps_retries_apart(engine: SimEngine) -> None:
    a = parse_request(engine, {"prompt": [1]}, chat=False, request_id_header="turn-7")
    b = parse_request(engine, {"prompt": [1]}, chat=False, request_id_header="turn-7")
    assert a.request.request_id.startswith("cmpl-turn-7-") and a.request.request_id != b.request.request_id
    long = parse_request(engine, {"prompt": [1]}, chat=False, request_id_header="x" * 500)
    assert len(long.request.request_id) < 150


def test_kv_transfer_params_and_cache_salt_pass_through(engine: SimEngine) -> None:
    kvp = {"do_remote_decode": True}
    p = parse_request(engine, {"prompt": [1], "kv_transfer_params": kvp, "cache_salt": "s"}, chat=False)
    assert p.request.kv_transfer_params == kvp and p.request.cache_salt == "s"


@pytest.mark.parametrize(
    ("body", "chat", "status", "param", "says"),
    [
        ([1, 2], False, 400, None, "JSON object"),
        ({"model": "other", "prompt": [1]}, False, 404, "model", "does not exist"),
        ({"prompt": [1], "n": 2}, False, 400, "n", "n=1"),
        ({"prompt": []}, False, 400, "prompt", "non-empty list"),
        ({"prompt": [1, True]}, False, 400, "prompt", "non-empty list"),
        ({"prompt": [1000]}, False, 400, "prompt", "within [0, 1000)"),
        ({"prompt": ["a", "b"]}, False, 400, "prompt", "batches are not supported"),
        ({"messages": "hi"}, True, 400, "messages", "must be a list"),
        ({"prompt": [1], "max_tokens": 0}, False, 400, "max_tokens", "positive integer"),
        ({"prompt": [1], "max_tokens": True}, False, 400, "max_tokens", "positive integer"),
        ({"prompt": [1] * 60, "max_tokens": 5}, False, 400, "max_tokens", "maximum context length is 64"),
        ({"prompt": [1], "kv_transfer_params": []}, False, 400, "kv_transfer_params", "must be an object"),
        ({"prompt": [1], "stream": "yes"}, False, 400, "stream", "boolean"),
        ({"prompt": [1], "stream_options": 1}, False, 400, "stream_options", "must be an object"),
        ({"prompt": [1], "cache_salt": ""}, False, 400, "cache_salt", "non-empty string"),
    ],
)
def test_a_body_vllm_would_refuse_is_refused_naming_the_parameter(
    engine: SimEngine, body: Any, chat: bool, status: int, param: str | None, says: str
) -> None:
    with pytest.raises(RequestError, match=r".") as caught:
        parse_request(engine, body, chat=chat)
    assert caught.value.status == status and caught.value.param == param and says in str(caught.value)
