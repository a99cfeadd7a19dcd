"""OpenAI request checking (bad input -> an OpenAI-shaped error) and the JSON of responses and stream chunks."""
from __future__ import annotations

import math
from dataclasses import dataclass

from specter.errors import SpecterError, first_line
from specter.text import encode_prompt

DEFAULT_MAX_TOKENS = 128  # as `python -m specter generate --max-new-tokens`
MAX_STOPS = 4  # OpenAI's limit on `stop` strings
UNSUPPORTED = {"n": (1,), "best_of": (1,), "echo": (False,), "logprobs": (False,), "suffix": ("",)}  # values served


class ApiError(Exception):
    """A request that fails: an HTTP status and OpenAI's error JSON."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def loading_error() -> ApiError:
    return ApiError(503, "the model is still loading; try again shortly", code="model_loading", kind="server_error")


@dataclass(frozen=True)
class Request:
    """One checked completion or chat request, its prompt already tokenized."""

    chat: bool
    model: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def parse_request(body, served, chat: bool) -> Request:
    """The request `body` (parsed JSON) for `served` (its names, tokenizer and context), or an ApiError: 404 for a
    model it does not serve, 400 for a bad parameter or a prompt that does not fit the context."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model is required: the name /v1/models lists", param="model")
    if not served.knows(model):
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {served.name!r}",
                       param="model", code="model_not_found")
    for field, allowed in UNSUPPORTED.items():
        if body.get(field) is not None and body[field] not in allowed:
            raise ApiError(400, f"{field} is not supported (only {field}={allowed[0]!r})", param=field)
    max_key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, max_key, DEFAULT_MAX_TOKENS, least=1)
    temperature = _number(body, "temperature", 0.0, "a number >= 0", lambda x: x >= 0)
    top_p = _number(body, "top_p", 1.0, "a number in (0, 1]", lambda x: 0 < x <= 1)
    seed = _integer(body, "seed", None, least=None)
    if seed is not None and not -2**63 <= seed < 2**64:
        raise ApiError(400, f"seed must be a 64-bit integer, got {seed}", param="seed")
    stream = _boolean(body, "stream")
    include_usage = stream and _boolean(body.get("stream_options") or {}, "include_usage", "stream_options.")
    stop = _stops(body.get("stop"))
    ids, param = (_chat_ids(body, served.tokenizer), "messages") if chat else (_prompt_ids(body, served.tokenizer),
                                                                               "prompt")
    context = served.max_positions
    if context is not None and len(ids) + max_tokens > context:
        raise ApiError(400, f"the prompt is {len(ids)} tokens and {max_key} {max_tokens}; this model's context holds "
                            f"{context} tokens: shorten the prompt or lower {max_key}", param=param,
                       code="context_length_exceeded")
    return Request(chat, model, ids, max_tokens, temperature, top_p, seed, stop, stream, include_usage)


def _integer(body: dict, key: str, default, least: int | None):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or (least is not None and value < least):
        bound = "" if least is None else f" >= {least}"
        raise ApiError(400, f"{key} must be an integer{bound}, got {value!r}", param=key)
    return value


def _number(body: dict, key: str, default: float, what: str, ok) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or not ok(value):
        raise ApiError(400, f"{key} must be {what}, got {value!r}", param=key)
    return float(value)


def _boolean(body, key: str, prefix: str = "") -> bool:
    if not isinstance(body, dict):
        raise ApiError(400, f"{prefix.rstrip('.')} must be an object, got {body!r}", param=prefix.rstrip("."))
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{prefix}{key} must be true or false, got {value!r}", param=prefix + key)
    return value


def _stops(value) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop must be a non-empty string or a list of at most {MAX_STOPS}, got {value!r}",
                       param="stop")
    return tuple(stops)


def _prompt_ids(body: dict, tokenizer) -> list[int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError(400, f"prompt must be a string, got {_shown(prompt)}", param="prompt")
    if not prompt:
        raise ApiError(400, "prompt is empty: give some text to continue", param="prompt")
    return _encoded(lambda: encode_prompt(tokenizer, prompt), "prompt")


def _chat_ids(body: dict, tokenizer) -> list[int]:
    """The messages through the tokenizer's chat template, with the assistant's generation prompt after them (as
    `python -m specter generate --chat` does for one user turn)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages is required: a non-empty list of {role, content}", param="messages")
    turns = [{"role": _role(m, i), "content": _content(m, i)} for i, m in enumerate(messages)]
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model's tokenizer has no chat template, so it cannot answer chat requests; "
                            "send the text to /v1/completions instead", param="messages", code="no_chat_template")

    def encode() -> list[int]:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        ids = list(tokenizer.encode(text, add_special_tokens=False))  # the template writes its own BOS
        if not ids:
            raise SpecterError("the messages encode to no tokens with this model's tokenizer")
        return ids

    return _encoded(encode, "messages")


def _role(message, i: int) -> str:
    role = message.get("role") if isinstance(message, dict) else None
    if not isinstance(role, str) or not role:
        raise ApiError(400, f"messages[{i}] must be an object with a string role, got {_shown(message)}",
                       param=f"messages[{i}].role")
    return role


def _content(message: dict, i: int) -> str:
    """A message's text: a string, or the text of its content parts."""
    content = message.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string or text parts, got {_shown(content)}",
                       param=f"messages[{i}].content")
    return content


def _encoded(encode, param: str) -> list[int]:
    try:
        return encode()
    except SpecterError as err:
        raise ApiError(400, first_line(err), param=param) from None


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_body(request: Request, rid: str, created: int, text: str, finish_reason: str,
                  completion_tokens: int) -> dict:
    """The whole answer of a non-streaming request."""
    if request.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion" if request.chat else "text_completion", "created": created,
            "model": request.model, "choices": [choice],
            "usage": usage(len(request.prompt_ids), completion_tokens)}


def chunk_body(request: Request, rid: str, created: int, text: str | None = None, finish_reason: str | None = None,
               role: bool = False) -> dict:
    """One stream event: a piece of text, the opening role (chat), or the last chunk with its finish reason."""
    if request.chat:
        delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion.chunk" if request.chat else "text_completion", "created": created,
            "model": request.model, "choices": [choice]}


def usage_chunk(request: Request, rid: str, created: int, completion_tokens: int) -> dict:
    """The stream's last event with `stream_options.include_usage`: no choices, the usage counts."""
    return {"id": rid, "object": "chat.completion.chunk" if request.chat else "text_completion", "created": created,
            "model": request.model, "choices": [], "usage": usage(len(request.prompt_ids), completion_tokens)}
