"""OpenAI body → InferenceRequest, and llmq replies → OpenAI objects and SSE chunks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas.base import MAX_PROMPT_CHARS
from schemas.replies import Done, Timings, Usage
from services.ingest.http.errors import ApiError
from services.ingest.http.openai import (
    SSE_DONE,
    ApiDefaults,
    Kind,
    Origin,
    ParsedCall,
    chunk_object,
    client_field,
    completion_object,
    parse_json,
    sse,
    to_inference_request,
    usage_chunk,
)

ORIGIN = Origin(request_id="cmpl-1", tenant="acme", reply_to="llmq.replies.ingest-a", now=100.0)


def _map(body: dict[str, Any], kind: Kind = "completion", **headers: str) -> ParsedCall:
    return to_inference_request(body, kind, ORIGIN, headers, ApiDefaults(16, 512))


def _refused(body: dict[str, Any], kind: Kind = "completion", **headers: str) -> ApiError:
    with pytest.raises(ApiError) as err:
        _map(body, kind, **headers)
    return err.value


def test_completion_body_maps_to_request() -> None:
    call = _map({
        "model": "m", "prompt": ["Say hi"], "max_tokens": 7, "temperature": 0.5, "top_p": 0.9,
        "stop": "\n", "seed": 3, "stream": True, "user": "ignored", "logit_bias": {},
    })
    req = call.request
    assert (req.request_id, req.tenant, req.model, req.prompt) == ("cmpl-1", "acme", "m", "Say hi")
    assert req.max_tokens == 7 and req.reply_to == "llmq.replies.ingest-a"
    assert req.created_at == 100.0
    assert req.sampling.temperature == 0.5 and req.sampling.stop == ("\n",)
    assert req.sampling.seed == 3
    assert call.stream and not call.include_usage and call.kind == "completion"


def test_chat_body_maps_messages_and_defaults() -> None:
    call = _map({
        "model": "m",
        "messages": [
            {"role": "developer", "content": "Be terse."},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}], "name": "bob"},
        ],
        "stream_options": {"include_usage": True},
        "max_tokens": None,  # null means "not given"
    }, "chat")
    messages = call.request.messages
    assert messages is not None
    assert [(m.role, m.content, m.name) for m in messages] == [
        ("system", "Be terse.", None), ("user", "a\nb", "bob"),  # joined as vLLM joins parts
    ]
    assert call.request.max_tokens == 512 and call.include_usage and not call.stream


def test_options_that_leave_the_answer_as_it_is_are_accepted() -> None:
    call = _map({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                 "response_format": {"type": "text"}, "modalities": ["text"], "store": False,
                 "metadata": {"k": "v"}, "logit_bias": {}, "n": None, "logprobs": False,
                 "tools": [], "tool_choice": "auto", "repetition_penalty": 1,
                 "skip_special_tokens": True, "min_tokens": 0}, "chat")
    assert call.request.model == "m"


def test_max_completion_tokens_wins_and_is_named_in_errors() -> None:
    assert _map({"model": "m", "prompt": "x", "max_completion_tokens": 9}).request.max_tokens == 9
    err = _refused({"model": "m", "prompt": "x", "max_completion_tokens": 0})
    assert (err.status, err.param) == (400, "max_completion_tokens")


def test_llmq_extras_from_body_or_headers() -> None:
    from_headers = _map({"model": "m", "prompt": "x"}, **{
        "x-llmq-priority": "low", "x-llmq-lane": "long", "x-llmq-timeout": "12.5",
    }).request
    assert (from_headers.priority, from_headers.lane, from_headers.timeout_s) == (
        "low", "long", 12.5,
    )
    body_wins = _map({"model": "m", "prompt": "x", "priority": "high", "timeout": 3},
                     **{"x-llmq-priority": "low"}).request
    assert (body_wins.priority, body_wins.timeout_s) == ("high", 3.0)


@pytest.mark.parametrize(
    ("body", "kind", "param"),
    [
        ({"prompt": "x"}, "completion", "model"),
        ({"model": "m"}, "completion", "prompt"),
        ({"model": "m"}, "chat", "messages"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, "completion", "temperature"),
        ({"model": "m", "prompt": "x", "temperature": 3}, "completion", "temperature"),
        ({"model": "m", "prompt": "x", "stop": [1]}, "completion", "stop"),
        ({"model": "m", "prompt": "x", "priority": "urgent"}, "completion", "priority"),
        ({"model": "m", "prompt": "x", "timeout": -1}, "completion", "timeout"),
        ({"model": "m", "prompt": ["a", "b"]}, "completion", "prompt"),
        ({"model": "m", "prompt": [1, 2]}, "completion", "prompt"),
        ({"model": "m", "prompt": "x", "n": 2}, "completion", "n"),
        ({"model": "m", "prompt": "x", "logprobs": 2}, "completion", "logprobs"),
        ({"model": "m", "prompt": "x", "echo": True}, "completion", "echo"),
        ({"model": "m", "prompt": "x", "stream": "yes"}, "completion", "stream"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "chat",
         "messages.0.role"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "chat", "messages.0.content"),
        ({"model": "m", "messages": [], "tools": [{"type": "function"}]}, "chat", "tools"),
        # Options that would change the answer: a 200 without them would look honoured.
        ({"model": "m", "messages": [], "response_format": {"type": "json_object"}}, "chat",
         "response_format"),
        ({"model": "m", "messages": [], "response_format": {"type": "json_schema",
                                                           "json_schema": {}}},
         "chat", "response_format"),
        ({"model": "m", "messages": [], "modalities": ["text", "audio"]}, "chat", "modalities"),
        ({"model": "m", "prompt": "x", "suffix": "}"}, "completion", "suffix"),
        ({"model": "m", "prompt": "x", "logit_bias": {"50256": -100}}, "completion",
         "logit_bias"),
        ({"model": "m", "prompt": "x", "guided_json": {"type": "object"}}, "completion",
         "guided_json"),
        # Falsy, and still not "nothing": the sampled token's logprob; two answers.
        ({"model": "m", "prompt": "x", "logprobs": 0}, "completion", "logprobs"),
        ({"model": "m", "prompt": "x", "n": True}, "completion", "n"),
        ({"model": "m", "messages": [], "tool_choice": "required"}, "chat", "tool_choice"),
        # vLLM's extras, which a vLLM server would honour.
        ({"model": "m", "prompt": "x", "min_tokens": 5}, "completion", "min_tokens"),
        ({"model": "m", "prompt": "x", "ignore_eos": True}, "completion", "ignore_eos"),
        ({"model": "m", "prompt": "x", "structured_outputs": {"choice": ["a"]}}, "completion",
         "structured_outputs"),
        ({"model": "m", "messages": [], "add_generation_prompt": False}, "chat",
         "add_generation_prompt"),
    ],
)
def test_invalid_bodies_name_the_field(body: dict[str, Any], kind: Kind, param: str) -> None:
    err = _refused(body, kind)
    assert err.status == 400 and err.param == param
    assert err.body()["error"]["param"] == param


def test_a_null_stream_option_means_not_given_as_at_the_top() -> None:
    call = _map({"model": "m", "prompt": "x", "stream": True,
                 "stream_options": {"include_usage": None}})
    assert call.stream and not call.include_usage
    assert _refused({"model": "m", "prompt": "x", "stream_options": {"include_usage": "yes"}}
                    ).param == "stream_options.include_usage"


def test_bad_header_values_are_named() -> None:
    assert _refused({"model": "m", "prompt": "x"}, **{"x-llmq-timeout": "soon"}).param == (
        "x-llmq-timeout"
    )
    # Values the schema refuses: named by the header they came from, not by a body field
    # the client never sent (found by an audit); the body's own still by its field.
    body = {"model": "m", "prompt": "x"}
    assert _refused(body, **{"x-llmq-timeout": "-5"}).param == "x-llmq-timeout"
    assert _refused(body, **{"x-llmq-priority": "urgent"}).param == "x-llmq-priority"
    assert _refused(body, **{"x-llmq-lane": "middle"}).param == "x-llmq-lane"
    assert _refused({**body, "priority": "urgent"}, **{"x-llmq-priority": "low"}).param == (
        "priority")
    assert _refused({**body, "timeout": -5}).param == "timeout"
    bad_id = Origin("not an id!", "acme", "llmq.replies.ingest-a", 1.0)
    with pytest.raises(ApiError) as err:
        to_inference_request({"model": "m", "prompt": "x"}, "completion", bad_id, {})
    assert err.value.param == "x-request-id"


def test_oversized_prompt_is_413() -> None:
    err = _refused({"model": "m", "prompt": "x" * (MAX_PROMPT_CHARS + 1)})
    assert (err.status, err.param, err.code) == (413, "prompt", "too_large")
    chat = _refused({"model": "m", "messages": [
        {"role": "user", "content": "x" * (MAX_PROMPT_CHARS + 1)}]}, "chat")
    assert (chat.status, chat.param) == (413, "messages.0.content")


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "m" * 300, "prompt": "x"}, "model"),
    ({"model": "m", "prompt": "x", "stop": "s" * 300}, "stop"),
    ({"model": "m", "prompt": "x", "stop": ["s"] * 9}, "stop"),
])
def test_an_over_long_short_field_is_a_bad_request_not_a_payload_too_large(
    body: dict[str, Any], param: str
) -> None:
    err = _refused(body)
    assert (err.status, err.param, err.code) == (400, param, "invalid")


def test_a_prompt_of_many_emoji_within_the_character_limit_is_accepted() -> None:
    # 4 bytes each in UTF-8 (3.2 MB), 12 bytes each ASCII-escaped: over the 8 MiB record limit.
    prompt = "\U0001F600" * 800_000
    assert _map({"model": "m", "prompt": prompt}).request.prompt == prompt


@pytest.mark.parametrize(
    ("raw", "kind", "param"),
    [
        (rb'{"model": "m", "prompt": "a\ud800b"}', "completion", "prompt"),
        (rb'{"model": "m", "prompt": "x", "stop": ["ok", "\ud83d"]}', "completion", "stop"),
        (rb'{"model": "m", "messages": [{"role": "user", "content": "\udfff"}]}', "chat",
         "messages.0.content"),
    ],
)
def test_a_lone_surrogate_is_refused_naming_the_field(raw: bytes, kind: Kind, param: str) -> None:
    err = _refused(dict(parse_json(raw)), kind)
    assert (err.status, err.param, err.code) == (400, param, "invalid")
    assert "surrogate" in err.message


def _nested(depth: int, inner: str) -> str:
    return "[" * depth + inner + "]" * depth


def _deepest(template: str, inner: str) -> dict[str, Any]:
    """The body of ``template`` with its value nested as deep as the JSON parser takes here
    (the stack left depends on the caller): where the record's encoding, a level deeper,
    used to overflow and answer 500."""
    for depth in range(1000, 0, -1):
        try:
            return dict(parse_json((template % _nested(depth, inner)).encode()))
        except ApiError:
            continue
    raise AssertionError("no depth parsed")


@pytest.mark.parametrize(
    ("body", "kind", "param"),
    [
        (_deepest('{"model": "m", "prompt": "x", "temperature": %s}', "1"), "completion",
         "temperature"),
        (_deepest('{"model": "m", "prompt": "x", "stop": %s}', '"\\ud800"'), "completion",
         "stop"),
        (dict(parse_json(b'{"model": "m", "prompt": "x", "stop": %s}'
                         % _nested(20, '"a"').encode())), "completion", "stop"),
        (dict(parse_json(b'{"model": "m", "messages": [{"role": "user", "content": "x", '
                         b'"name": %s}]}' % _nested(30, '"a"').encode())), "chat",
         "messages.0.name"),
    ],
)
def test_a_field_nested_too_deep_is_refused_naming_it(
    body: dict[str, Any], kind: Kind, param: str
) -> None:
    err = _refused(body, kind)
    assert (err.status, err.param, err.code) == (400, param, "invalid")
    assert "nested more than 16 levels deep" in err.message


@pytest.mark.parametrize("field", ["tool_calls", "function_call", "tool_call_id"])
def test_a_tool_call_in_the_history_is_refused_not_dropped(field: str) -> None:
    """The wire has no tool calls: dropped, the model would see another conversation."""
    value: Any = {"tool_calls": [{"id": "c1", "type": "function",
                                  "function": {"name": "f", "arguments": "{}"}}],
                  "function_call": {"name": "f", "arguments": "{}"},
                  "tool_call_id": "c1"}[field]
    messages = [{"role": "user", "content": "q"},
                {"role": "assistant" if field != "tool_call_id" else "tool", "content": "42",
                 field: value}]
    err = _refused({"model": "m", "messages": messages}, "chat")
    assert (err.status, err.param) == (400, f"messages.1.{field}")
    assert "tool calls are not supported" in err.message
    # Empty or null, as some SDKs send them, changes nothing.
    messages[1] = {"role": "assistant", "content": "42", "tool_calls": [],
                   "function_call": None}
    assert _map({"model": "m", "messages": messages}, "chat").request.messages[1].content == "42"


@pytest.mark.parametrize("raw", [b"{nope", b"[1, 2]", b"", b'"text"'])
def test_body_must_be_a_json_object(raw: bytes) -> None:
    with pytest.raises(ApiError) as err:
        parse_json(raw)
    assert err.value.status == 400 and err.value.param is None


@pytest.mark.parametrize(
    ("field", "param"),
    [("sampling.top_p", "top_p"), ("sampling.stop.0", "stop"), ("timeout_s", "timeout"),
     ("messages.2.content", "messages.2.content"), ("tenant", None), ("", None)],
)
def test_client_field_names(field: str, param: str | None) -> None:
    assert client_field(field) == param


# -- responses -----------------------------------------------------------------------------
DONE = Done(request_id="cmpl-1", attempt=1, model="m", finish_reason="length",
            usage=Usage(prompt_tokens=5, completion_tokens=2),
            timings=Timings(queued_s=0.0, e2e_s=0.1), ts=1.0)


def test_completion_objects() -> None:
    text = completion_object(_map({"model": "m", "prompt": "x"}), "Hi!", DONE, 7)
    assert text == {
        "id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
        "choices": [{"index": 0, "logprobs": None, "finish_reason": "length", "text": "Hi!"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
    }
    chat = completion_object(_map({"model": "m", "messages": [{"role": "user", "content": "x"}]},
                                  "chat"), "Hi!", DONE, 7)
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "Hi!"}


def test_chat_chunks_open_with_the_role_and_close_with_the_reason() -> None:
    call = _map({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "chat")
    first = chunk_object(call, 7, "He", first=True)
    assert first == {
        "id": "cmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
        "choices": [{"index": 0, "logprobs": None, "finish_reason": None,
                     "delta": {"role": "assistant", "content": "He"}}],
    }
    assert chunk_object(call, 7, "llo")["choices"][0]["delta"] == {"content": "llo"}
    closing = chunk_object(call, 7, None, finish_reason="stop")["choices"][0]
    assert closing["delta"] == {} and closing["finish_reason"] == "stop"
    usage = usage_chunk(call, 7, DONE)
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 7


def test_completion_chunks() -> None:
    call = _map({"model": "m", "prompt": "x"})
    chunk = chunk_object(call, 7, "He", first=True)
    assert chunk["object"] == "text_completion"
    assert chunk["choices"] == [{"index": 0, "logprobs": None, "finish_reason": None,
                                 "text": "He"}]
    assert chunk_object(call, 7, None, finish_reason="stop")["choices"][0]["text"] == ""


def test_sse_framing() -> None:
    event = sse({"a": "é", "b": [1]})
    assert event == b'data: {"a":"\\u00e9","b":[1]}\n\n'
    assert json.loads(event.removeprefix(b"data: ")) == {"a": "é", "b": [1]}
    assert SSE_DONE == b"data: [DONE]\n\n"
