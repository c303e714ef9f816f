"""OpenAI wire format ↔ llmq messages: request bodies in, completion objects and SSE out.

Request mapping (``to_inference_request``): the body of ``/v1/completions`` or
``/v1/chat/completions`` becomes an ``InferenceRequest``; validation is the schema's own
(``schemas.codec.decode``), and a ``SchemaError`` comes back as 400/413 naming the field as
the client spelled it (``sampling.temperature`` → ``temperature``, ``timeout_s`` →
``timeout``); so does a string UTF-8 cannot carry (a lone surrogate, ``"\\ud800"``).
Fields llmq cannot honour are refused by name unless set to a value that changes nothing
(``_REFUSED``: ``n`` or ``best_of`` other than 1, ``logprobs`` (``0`` too, on
/v1/completions), ``echo``, ``tools``, ``tool_choice`` "required", ``logit_bias``,
``suffix``, ``response_format`` other than text, ``modalities`` other than text,
``audio``, and vLLM's extras — ``guided_*``, ``structured_outputs``, ``min_tokens``,
``ignore_eos``, ``repetition_penalty``, chat-template options, ...): each would change
the answer, and a 200 without it would look honoured; so is a message's ``tool_calls``,
``function_call`` or ``tool_call_id`` (the wire carries none, and dropped they would
change the prompt), and a field nested more than 16 arrays or objects deep. Fields that
do not change the
result (``user``, ``store``, ``metadata``, ``parallel_tool_calls``, ...) are ignored, as
a vLLM server ignores fields it does not know, so any OpenAI SDK works.
llmq extras: ``priority``, ``lane``, ``timeout`` (seconds) in the body or as headers
``x-llmq-priority``, ``x-llmq-lane``, ``x-llmq-timeout`` (the body wins).

Response shapes follow OpenAI's: ``text_completion`` / ``chat.completion`` objects with
``usage``; streams are ``data: {chunk}\\n\\n`` events ending with ``data: [DONE]\\n\\n``,
chat streams open with the assistant role, and a final usage-only chunk is sent when the
client asked for ``stream_options.include_usage``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from schemas.codec import SchemaError, decode
from schemas.replies import Done
from schemas.requests import InferenceRequest
from services.ingest.http.errors import from_schema_error, invalid

Kind = Literal["completion", "chat"]

SSE_DONE: Final = b"data: [DONE]\n\n"
_ROLES: Final = {"developer": "system"}  # OpenAI's newer name for the system role
#: A message's tool-call fields: the wire has none, and ``tools`` are refused.
_TOOL_FIELDS: Final = ("tool_calls", "function_call", "tool_call_id")
_SAMPLING: Final = (
    "temperature", "top_p", "top_k", "presence_penalty", "frequency_penalty", "seed",
)
_HEADER_EXTRAS: Final = {"priority": "x-llmq-priority", "lane": "x-llmq-lane"}
#: Each llmq extra's header, which the request's value came from when the body has none.
_FROM_HEADER: Final = {**_HEADER_EXTRAS, "timeout": "x-llmq-timeout"}
_SAMPLING_FIELD: Final = re.compile(r"^sampling\.([a-z_]+)(\..*)?$")


@dataclass(frozen=True, slots=True)
class ApiDefaults:
    """``max_tokens`` when the body has none (per endpoint); routes lower it to the rest of
    the model's context when the prompt leaves less (``fitted_max_tokens``)."""

    completion_max_tokens: int = 16
    chat_max_tokens: int = 512


@dataclass(frozen=True, slots=True)
class ParsedCall:
    """A validated API call: the request to queue and how to answer."""

    request: InferenceRequest
    kind: Kind
    stream: bool
    include_usage: bool
    #: The id the caller knows the request by (its ``x-request-id``, else the generated
    #: one): what responses show. ``request.request_id`` may be scoped to the tenant.
    client_id: str = ""
    #: False when the body set no ``max_tokens`` (nor ``max_completion_tokens``): the
    #: request carries the endpoint's default, which may be fitted to the context.
    max_tokens_given: bool = True

    @property
    def id(self) -> str:
        return self.client_id or self.request.request_id


@dataclass(frozen=True, slots=True)
class Origin:
    """What the caller's identity and the service add to the body."""

    request_id: str
    tenant: str
    reply_to: str
    now: float
    client_id: str | None = None  # the caller's x-request-id, when it chose one


def parse_json(raw: bytes) -> Mapping[str, Any]:
    """The body as a JSON object, or 400."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise invalid(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object")
    return body


def to_inference_request(
    body: Mapping[str, Any],
    kind: Kind,
    origin: Origin,
    headers: Mapping[str, str],
    defaults: ApiDefaults = ApiDefaults(),
) -> ParsedCall:
    """Map and validate an OpenAI body (module docstring); raises :class:`ApiError`."""
    body = {k: v for k, v in body.items() if v is not None}  # null means "not given"
    _refuse_unsupported(body)
    stream = _flag(body, "stream")
    options = body.get("stream_options", {})
    if not isinstance(options, Mapping):
        raise invalid("must be an object", "stream_options")
    max_field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    wire: dict[str, Any] = {
        "request_id": origin.request_id,
        "tenant": origin.tenant,
        "model": body.get("model"),
        "max_tokens": body.get(max_field, _default_max(kind, defaults)),
        "sampling": _sampling(body),
        "reply_to": origin.reply_to,
        "created_at": origin.now,
        **_extras(body, headers),
    }
    text_field = "messages" if kind == "chat" else "prompt"
    if text_field not in body:
        raise invalid(f"{text_field} is required", text_field)
    if kind == "chat":
        wire["messages"] = _messages(body["messages"])
    else:
        wire["prompt"] = _prompt(body["prompt"])
    wire = {k: v for k, v in wire.items() if v is not None}  # absent: the schema says so
    deep = _too_deep(wire)
    if deep is not None:
        # Every field the wire takes is a few levels deep at most; past this, encoding the
        # record (one level deeper than the body: sampling) would overflow the stack.
        raise invalid(f"is nested more than {_MAX_DEPTH} levels deep",
                      client_field(deep, max_field) or deep)
    try:
        # Not ASCII-escaped: the record limit is on bytes, and an escaped emoji takes 12
        # (\ud83d\ude00) where its UTF-8 takes 4.
        raw = json.dumps(wire, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        field = _unencodable_field(wire)
        raise invalid("must be valid Unicode text (a lone surrogate is not)",
                      client_field(field, max_field) if field else None) from None
    try:
        request = decode(raw, InferenceRequest)
    except SchemaError as exc:
        param = client_field(exc.field, max_field)
        if param in _FROM_HEADER and param not in body:  # the value came from its header
            param = _FROM_HEADER[param]
        raise from_schema_error(exc, param) from None
    include_usage = _flag(options, "include_usage", "stream_options.include_usage")
    return ParsedCall(request, kind, stream, include_usage, origin.client_id or "",
                      max_tokens_given=max_field in body)


def client_field(field: str, max_field: str = "max_tokens") -> str | None:
    """The body field (or header) a schema field path came from; None for our own."""
    match = _SAMPLING_FIELD.match(field)
    if match:
        return match.group(1)
    head = field.split(".", 1)[0]
    return {
        "max_tokens": max_field,
        "timeout_s": "timeout",
        "request_id": "x-request-id",
        "model": "model",
        "prompt": field or None,
        "messages": field,
        "priority": "priority",
        "lane": "lane",
        "model_version": "model_version",
        "prefix_hash": "prefix_hash",
    }.get(head)


#: Deepest nesting of arrays and objects a wire field may have (a chat message's text part
#: is 4 levels down: messages, message, content, part).
_MAX_DEPTH: Final = 16


def _too_deep(value: Any) -> str | None:
    """The dotted path, down to the first level past :data:`_MAX_DEPTH`, of a value nested
    deeper than that (None: none is). Iterative: it must not overflow the stack itself."""
    stack: list[tuple[Any, list[str]]] = [(value, [])]
    while stack:
        item, path = stack.pop()
        if isinstance(item, Mapping):
            children: Iterable[tuple[Any, Any]] = item.items()
        elif isinstance(item, list):
            children = enumerate(item)
        else:
            continue
        if len(path) > _MAX_DEPTH:
            return ".".join(path[:3])
        stack.extend((child, [*path, str(key)]) for key, child in children)
    return None


def _unencodable_field(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string in ``value`` that UTF-8 cannot encode (a lone
    surrogate, which JSON's ``\\ud800`` escapes let a client send)."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, Mapping):
        items: Iterable[tuple[Any, Any]] = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _unencodable_field(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


#: Fields that change the answer and that llmq cannot honour, each with the values that
#: leave the answer as it is (null always does): any other value is refused by name. Ours
#: are OpenAI's, then vLLM's extras (its sampling parameters and chat-template options),
#: which a vLLM server honours: a 200 without them would look honoured.
_REFUSED: Final[Mapping[str, tuple[Any, ...]]] = {
    "n": (1,), "best_of": (1,), "logprobs": (False,), "top_logprobs": (0,),
    "echo": (False,), "tools": ([],), "functions": ([],), "tool_choice": ("none", "auto"),
    "function_call": ("none", "auto"), "logit_bias": ({},), "suffix": ("",), "audio": (),
    "prediction": (), "reasoning_effort": (),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "structured_outputs": (), "min_tokens": (0,), "ignore_eos": (False,),
    "stop_token_ids": ([],), "repetition_penalty": (1.0,), "min_p": (0.0,),
    "length_penalty": (1.0,), "use_beam_search": (False,), "allowed_token_ids": (),
    "bad_words": ([],), "prompt_logprobs": (), "truncate_prompt_tokens": (),
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "add_generation_prompt": (True,),
    "continue_final_message": (False,), "chat_template": (), "chat_template_kwargs": ({},),
    "documents": (), "logits_processors": (), "return_tokens_as_token_ids": (False,),
}


def _refuse_unsupported(body: Mapping[str, Any]) -> None:
    for name, as_is in _REFUSED.items():
        value = body.get(name)
        if value is not None and not any(_same(value, v) for v in as_is):
            shown = " or ".join(json.dumps(v) for v in as_is)
            raise invalid(f"{name} is not supported" + (f" (only {shown})" if shown else ""),
                          name)
    fmt = body.get("response_format")
    if fmt is not None and not (isinstance(fmt, Mapping) and fmt.get("type", "text") == "text"):
        raise invalid('only {"type": "text"} is supported', "response_format")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise invalid('only ["text"] is supported', "modalities")


def _same(value: Any, as_is: Any) -> bool:
    """Equal, a bool only to a bool (``n: true`` is not ``n: 1``, ``logprobs: 0`` — the
    sampled token's logprob on /v1/completions — is not ``false``)."""
    if isinstance(value, bool) or isinstance(as_is, bool):
        return value is as_is
    return bool(value == as_is)


def _flag(body: Mapping[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:  # null means "not given", nested as at the top
        return False
    if not isinstance(value, bool):
        raise invalid("must be true or false", param or name)
    return value


def _default_max(kind: Kind, defaults: ApiDefaults) -> int:
    return defaults.chat_max_tokens if kind == "chat" else defaults.completion_max_tokens


def _sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    sampling = {name: body[name] for name in _SAMPLING if name in body}
    stop = body.get("stop")
    if stop is not None:
        sampling["stop"] = [stop] if isinstance(stop, str) else stop
    return sampling


def _extras(body: Mapping[str, Any], headers: Mapping[str, str]) -> dict[str, Any]:
    extras: dict[str, Any] = {}
    for name, header in _HEADER_EXTRAS.items():
        value = body.get(name, headers.get(header))
        if value is not None:
            extras[name] = value
    if "timeout" in body:
        extras["timeout_s"] = body["timeout"]
    elif headers.get("x-llmq-timeout") is not None:
        try:
            extras["timeout_s"] = float(headers["x-llmq-timeout"])
        except ValueError:
            raise invalid("must be a number of seconds", "x-llmq-timeout") from None
    for name in ("model_version", "prefix_hash"):
        if name in body:
            extras[name] = body[name]
    return extras


def _prompt(prompt: Any) -> Any:
    """A string; a list of exactly one string is accepted too (the SDK's shape)."""
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise invalid("exactly one text prompt per request is supported", "prompt")
        return prompt[0]
    return prompt


def _messages(messages: Any) -> Any:
    """Chat messages with multi-part text contents flattened; other shapes pass through to
    validation, which names the failing field."""
    if not isinstance(messages, list):
        return messages
    return [_message(m, i) if isinstance(m, Mapping) else m for i, m in enumerate(messages)]


def _message(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    for name in _TOOL_FIELDS:  # dropped, they would change the prompt the model sees
        if message.get(name) not in (None, [], ""):
            raise invalid("tool calls are not supported", f"messages.{index}.{name}")
    role = message.get("role")
    out: dict[str, Any] = {"role": _ROLES.get(role, role) if isinstance(role, str) else role}
    content = message.get("content")
    if isinstance(content, list):
        content = _text_parts(content, f"messages.{index}.content")
    out["content"] = content
    if message.get("name") is not None:
        out["name"] = message["name"]
    return out


def _text_parts(parts: list[Any], param: str) -> str:
    texts = []
    for part in parts:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            raise invalid("only text content parts are supported", param)
        text = part.get("text")
        if not isinstance(text, str):
            raise invalid("a text part needs a string 'text'", param)
        texts.append(text)
    # As vLLM's chat parser joins them: the model sees the same prompt either way.
    return "\n".join(texts)


# -- responses ------------------------------------------------------------------------------
def usage_object(done: Done) -> dict[str, int]:
    usage = done.usage
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }


def completion_object(
    call: ParsedCall, text: str, done: Done, created: int
) -> dict[str, Any]:
    """The non-streaming answer: ``text_completion`` or ``chat.completion``."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": done.finish_reason}
    if call.kind == "chat":
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": call.id,
        "object": "chat.completion" if call.kind == "chat" else "text_completion",
        "created": created,
        "model": call.request.model,
        "choices": [choice],
        "usage": usage_object(done),
    }


def chunk_object(
    call: ParsedCall,
    created: int,
    text: str | None,
    *,
    first: bool = False,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """One streamed chunk; ``text`` None with a ``finish_reason`` is the closing chunk."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
    if call.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return _chunk_envelope(call, created, [choice])


def usage_chunk(call: ParsedCall, created: int, done: Done) -> dict[str, Any]:
    """The last chunk when ``stream_options.include_usage``: no choices, only usage."""
    return {**_chunk_envelope(call, created, []), "usage": usage_object(done)}


def _chunk_envelope(call: ParsedCall, created: int, choices: list[Any]) -> dict[str, Any]:
    return {
        "id": call.id,
        "object": "chat.completion.chunk" if call.kind == "chat" else "text_completion",
        "created": created,
        "model": call.request.model,
        "choices": choices,
    }


def sse(data: Mapping[str, Any]) -> bytes:
    """One server-sent event: ``data: <compact JSON>`` and a blank line."""
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
