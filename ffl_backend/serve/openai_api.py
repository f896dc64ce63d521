"""OpenAI request bodies in, fastflow generation requests out; and the reply objects.

Parsing follows vLLM's OpenAI server where OpenAI leaves room: an explicit `null` means the field's
default, unknown fields are ignored with a logged warning, fields OpenAI defines that fastflow does
not implement are refused only when set to something other than their no-op value (`echo: false`
and `logit_bias: {}` are fine). Extensions: `top_k`, `min_p`, `repetition_penalty`,
`stop_token_ids`, `ignore_eos`, `return_token_ids`. Everything here is pure data: no engine, no HTTP.
"""
from __future__ import annotations

import dataclasses
import logging
import math

from ..engine.sampling import MAX_LOGPROBS, RequestError, SamplingParams

logger = logging.getLogger("ffl_backend.serve")
MAX_CHOICES = 16  # n × prompts: each choice is one engine request
MAX_STOPS = 16
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
           "presence_penalty", "frequency_penalty", "logit_bias", "user", "top_k", "min_p",
           "repetition_penalty", "stop_token_ids", "ignore_eos", "return_token_ids"}
_COMPLETION = _COMMON | {"prompt", "logprobs", "echo", "suffix", "best_of"}
_CHAT = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools", "tool_choice",
                   "parallel_tool_calls", "response_format", "store", "metadata", "service_tier",
                   "reasoning_effort", "modalities", "prediction", "audio", "web_search_options"}
_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclasses.dataclass
class GenerationRequest:
    """One parsed request: `prompts` (completions: strings or token-id lists) or `messages` (chat),
    `n` choices per prompt; `max_tokens` None = up to the context length (chat's default)."""
    chat: bool
    params: SamplingParams
    max_tokens: int | None
    n: int = 1
    prompts: list = dataclasses.field(default_factory=list)
    messages: list | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False  # vLLM's extension: "token_ids" in each choice / chunk
    model: str | None = None


def _get(body: dict, name: str, kinds, default, check=None, what=None):
    """The field's value (its default when missing or null), type-checked; RequestError names it."""
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise RequestError(f"{name} must be {what or ' or '.join(k.__name__ for k in kinds)}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise RequestError(f"{name} must be finite, got {value!r}")
    if check is not None and not check(value):
        raise RequestError(f"{name}: {what}, got {value!r}")
    return value


def _number(body, name, default, lo=None, hi=None):
    what = f"a number in [{lo}, {hi}]" if lo is not None else "a number"
    ok = (lambda v: lo <= v <= hi) if lo is not None else None
    return _get(body, name, (int, float), default, ok, what)


def _integer(body, name, default, lo, hi, what=None):
    return _get(body, name, (int,), default, lambda v: lo <= v <= hi, what or f"an integer in [{lo}, {hi}]")


def _refuse_unsupported(body: dict, chat: bool) -> None:
    noop = {"echo": (False,), "suffix": ("",), "logit_bias": ({},), "tools": ([],),
            "tool_choice": ("none", "auto"), "response_format": ({"type": "text"},), "audio": (),
            "prediction": (), "web_search_options": (), "modalities": (["text"],)}
    for name, allowed in noop.items():
        value = body.get(name)
        if value is not None and value not in allowed:
            raise RequestError(f"{name}={value!r} is not supported by this server")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1) and best_of != 1:
        raise RequestError("best_of other than n is not supported")
    if chat and body.get("messages") is not None and not isinstance(body["messages"], list):
        raise RequestError("messages must be a list")


def _stops(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise RequestError(f"stop must be a string or a list of at most {MAX_STOPS} strings")
    return tuple(s for s in stops if s)


def _prompts(body: dict) -> list:
    """A string, a token-id list, or a list of either (OpenAI's batch form)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if _is_ids(prompt) and prompt:
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or (_is_ids(p) and p) for p in prompt):
        return list(prompt)
    raise RequestError("prompt must be a string, a list of token ids, or a non-empty list of either")


def _is_ids(value) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _messages(body: dict) -> list[dict]:
    """Chat messages with string content (text parts joined); other part types are refused."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in _ROLES:
            raise RequestError(f"messages[{i}] must be an object with a role in {sorted(_ROLES)}")
        content = msg.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise RequestError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise RequestError(f"messages[{i}].content must be a string or a list of text parts")
        out.append({"role": msg["role"], "content": content})
    return out


def parse_request(body, chat: bool) -> GenerationRequest:
    """A completions (chat=False) or chat-completions body; RequestError when invalid."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - (_CHAT if chat else _COMPLETION))
    if unknown:
        logger.warning("ignoring unknown request field(s): %s", ", ".join(unknown)[:200])
    _refuse_unsupported(body, chat)
    max_tokens = _integer(body, "max_tokens", None, 1, 2**31, "an integer >= 1")
    if chat:
        max_tokens = _integer(body, "max_completion_tokens", max_tokens, 1, 2**31, "an integer >= 1")
        logprobs = _get(body, "logprobs", (bool,), False)
        top = _integer(body, "top_logprobs", 0, 0, MAX_LOGPROBS)
        if top and not logprobs:
            raise RequestError("top_logprobs needs logprobs: true")
        logprobs = top if logprobs else None
    else:
        max_tokens = 16 if max_tokens is None else max_tokens  # OpenAI's completions default
        logprobs = _integer(body, "logprobs", None, 0, MAX_LOGPROBS)
    temperature = _number(body, "temperature", 1.0, 0, 100)
    stream_options = _get(body, "stream_options", (dict,), {})
    stop_ids = _get(body, "stop_token_ids", (list,), [])
    params = SamplingParams(
        max_new_tokens=max_tokens or 1, temperature=temperature, do_sample=temperature > 0,
        top_p=_number(body, "top_p", 1.0), seed=_integer(body, "seed", None, 0, 2**64 - 1),
        ignore_eos=_get(body, "ignore_eos", (bool,), False), top_k=_integer(body, "top_k", 0, -1, 2**31),
        min_p=_number(body, "min_p", 0.0), presence_penalty=_number(body, "presence_penalty", 0.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0),
        repetition_penalty=_number(body, "repetition_penalty", 1.0), logprobs=logprobs,
        stop_token_ids=tuple(stop_ids))
    params.validate()
    req = GenerationRequest(
        chat=chat, params=params, max_tokens=max_tokens, n=_integer(body, "n", 1, 1, MAX_CHOICES),
        stop=_stops(body), stream=_get(body, "stream", (bool,), False),
        include_usage=_get(stream_options, "include_usage", (bool,), False),
        return_token_ids=_get(body, "return_token_ids", (bool,), False),
        model=_get(body, "model", (str,), None))
    if chat:
        req.messages = _messages(body)
    else:
        req.prompts = _prompts(body)
    if req.n * max(1, len(req.prompts)) > MAX_CHOICES:
        raise RequestError(f"at most {MAX_CHOICES} choices (n × prompts) per request")
    return req


# -- replies ------------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_logprobs(entries, token_text, offset: int) -> dict:
    """OpenAI completions' logprobs object from [(token_id, logprob, [(id, logprob)])]."""
    tokens, values, tops, offsets = [], [], [], []
    for token, value, top in entries:
        tokens.append(token_text(token))
        values.append(value)
        tops.append({token_text(t): v for t, v in top})
        offsets.append(offset)
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(entries, token_text) -> dict:
    """Chat's logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def item(token, value):
        text = token_text(token)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    return {"content": [{**item(token, value), "top_logprobs": [item(t, v) for t, v in top]}
                        for token, value, top in entries]}


def choice(chat: bool, index: int, text: str, finish: str | None, logprobs=None, delta: bool = False,
           first: bool = False) -> dict:
    """One choice of a reply (delta=True: of a streamed chunk)."""
    if not chat:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}
    if delta:
        content = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish}
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
            "finish_reason": finish}


def envelope(chat: bool, rid: str, created: int, model: str, choices: list, chunk: bool) -> dict:
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices}


def error_body(message: str, kind: str = "invalid_request_error", code=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}
