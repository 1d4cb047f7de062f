"""The OpenAI request bodies the server accepts, checked before any work, and its error bodies.

Every refusal is an `APIError`: an HTTP status and OpenAI's error object
`{"error": {"message", "type", "param", "code"}}`, so an OpenAI client raises its usual exception
(`openai.BadRequestError`, `openai.NotFoundError`, ...) with the message.
"""

import json
from dataclasses import dataclass, field

MAX_STOP = 4  # OpenAI's limit on stop sequences
ROLES = ("system", "developer", "user", "assistant")
UNSUPPORTED = ("tools", "functions", "logprobs", "top_logprobs", "echo")  # refused when set, never ignored


class APIError(Exception):
    """A request the server refuses, as an HTTP status and an OpenAI error object.

    Args:
        status (int): HTTP status (400 bad request, 404 unknown model, 413 body too large, ...).
        message (str): one line naming the field, the value found and the value allowed.
        param (str | None): the request field at fault. Default: None.
        code (str | None): a machine-readable code, e.g. "model_not_found". Default: None.
        type (str): OpenAI's error type. Default: "invalid_request_error".
    """

    def __init__(self, status, message, param=None, code=None, type="invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self):
        """The JSON-able error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Sampling:
    """How to generate: the OpenAI fields `max_tokens`, `temperature`, `top_p`, `seed`, `stop`.

    Attributes:
        max_tokens (int | None): most tokens to generate; None fills up to the server's default.
        temperature (float): 0 is greedy (argmax), as `cartridge ask` and mlx_lm.server's default.
        top_p (float): nucleus mass in (0, 1]; 1 keeps every token.
        seed (int | None): seeds MLX's generator before this request's first token.
        stop (list[str]): text that ends the answer (not included in it).
    """

    max_tokens: int = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = None
    stop: list = field(default_factory=list)


@dataclass
class Request:
    """One checked request.

    Attributes:
        kind (str): "chat" or "completion". model (str): the model id (a cartridge or the base model).
        messages (list[dict]): chat turns {"role", "content": str} (chat only).
        prompt (str): the text that continues the document (completion only).
        stream (bool), include_usage (bool): server-sent events; a last chunk with `usage`.
        sampling (Sampling). return_token_ids (bool): add the generated token ids to each choice (as vLLM).
    """

    kind: str
    model: str
    messages: list = None
    prompt: str = None
    stream: bool = False
    include_usage: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    return_token_ids: bool = False


def bad(message, param=None):
    """A 400 invalid_request_error."""
    return APIError(400, message, param)


def parse_body(raw):
    """The JSON object of a request body.

    Raises:
        APIError: 400 if the bytes are not UTF-8 JSON or not an object.
    """
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _typed(body, key, kinds, default=None):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join(k.__name__ for k in kinds)
        raise bad(f"'{key}' must be {names}, got {type(value).__name__}", key)
    return value


def _number(body, key, low, high, default):
    value = _typed(body, key, (int, float), default)
    if not low <= value <= high:
        raise bad(f"'{key}' is {value}; it must be between {low} and {high}", key)
    return float(value)


def _stop(body):
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("'stop' must be a non-empty string or a list of non-empty strings", "stop")
    if len(stop) > MAX_STOP:
        raise bad(f"'stop' has {len(stop)} sequences; at most {MAX_STOP} are allowed", "stop")
    return stop


def parse_sampling(body):
    """The sampling fields of a chat or completion body (`max_completion_tokens` is `max_tokens`' new name).

    Raises:
        APIError: 400 naming the field, for a wrong type or a value out of range (`seed` 0 .. 2^64 - 1); `n`
        other than 1; tools, logprobs or echo asked for (not supported).
    """
    max_tokens = _typed(body, "max_tokens", (int,)) or _typed(body, "max_completion_tokens", (int,))
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is not None and body[key] < 1:
            raise bad(f"'{key}' is {body[key]}; it must be at least 1", key)
    if _typed(body, "n", (int,), 1) != 1:
        raise bad(f"'n' is {body['n']}; this server returns one choice (n=1)", "n")
    top_p = _number(body, "top_p", 0, 1, 1.0)
    if top_p == 0:
        raise bad("'top_p' is 0; it must be above 0 (1 keeps every token)", "top_p")
    seed = _typed(body, "seed", (int,))
    if seed is not None and not 0 <= seed < 2 ** 64:  # MLX's generator takes an unsigned 64-bit seed
        raise bad(f"'seed' is {seed}; it must be between 0 and 2^64 - 1", "seed")
    for key in UNSUPPORTED:
        if body.get(key) not in (None, False, [], 0):
            raise bad(f"'{key}' is not supported by this server", key)
    return Sampling(max_tokens=max_tokens, temperature=_number(body, "temperature", 0, 2, 0.0), top_p=top_p,
                    seed=seed, stop=_stop(body))


def _content(message, i):
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text parts carry meaning here
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise bad(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                      f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad(f"messages[{i}].content must be a string, got {type(content).__name__}", f"messages[{i}].content")
    return content


def parse_messages(body):
    """The chat turns as [{"role", "content": str}], with "developer" read as "system".

    Raises:
        APIError: 400 for a missing or empty list, an unknown role (tools are not supported), or content
        that is not text.
    """
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    turns = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be a {{role, content}} object, got {type(m).__name__}", f"messages[{i}]")
        if m.get("role") not in ROLES:
            raise bad(f"messages[{i}].role is {m.get('role')!r}; it must be one of {', '.join(ROLES)}",
                      f"messages[{i}].role")
        role = "system" if m["role"] == "developer" else m["role"]
        turns.append({"role": role, "content": _content(m, i)})
    if turns[-1]["role"] == "assistant":
        raise bad("the last message is the assistant's; end with a user message", "messages")
    if not any(t["role"] == "user" for t in turns):
        raise bad("'messages' has no user message", "messages")
    return turns


def _common(body, kind):
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' must name a model (GET /v1/models lists them)", "model")
    options = _typed(body, "stream_options", (dict,), {})
    return dict(kind=kind, model=model, stream=_typed(body, "stream", (bool,), False),
                include_usage=bool(options.get("include_usage")), sampling=parse_sampling(body),
                return_token_ids=_typed(body, "return_token_ids", (bool,), False))


def parse_chat(body):
    """Check a /v1/chat/completions body.

    Returns:
        Request: kind "chat".

    Raises:
        APIError: 400 naming the field at fault.
    """
    return Request(messages=parse_messages(body), **_common(body, "chat"))


def parse_completion(body):
    """Check a /v1/completions body: `prompt` is one string (the text after the document; may be empty).

    Returns:
        Request: kind "completion".

    Raises:
        APIError: 400 naming the field at fault.
    """
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise bad("'prompt' must be one string (token-id and batch prompts are not supported)", "prompt")
    return Request(prompt=prompt, **_common(body, "completion"))
