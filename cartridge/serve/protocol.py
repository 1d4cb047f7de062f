"""The OpenAI request bodies the server accepts, checked before any work, and its error bodies.

Every field mlx_lm.server reads is honoured with its meaning there; a field this server cannot honour is
refused (400, naming it) when it asks for something, never silently ignored. Every refusal is an
`APIError`: an HTTP status and OpenAI's error object `{"error": {"message", "type", "param", "code"}}`,
so an OpenAI client raises its usual exception (`openai.BadRequestError`, ...) with the message.
"""

import json
from dataclasses import dataclass, field

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_TOP_LOGPROBS = 20  # OpenAI's limit (mlx_lm.server's is 10)
ROLES = ("system", "developer", "user", "assistant")
# Fields that ask for what this server does not do, each with the values that ask for nothing (sent by some
# clients as defaults): refused when set to anything else.
UNSUPPORTED = {
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none"), "echo": (None, False),
    "best_of": (None, 1), "suffix": (None, ""), "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "draft_model": (None,), "num_draft_tokens": (None,), "adapters": (None,), "role_mapping": (None,),
}
# Penalties as mlx_lm.server takes them: (key, its context-size key); 0 (the default) is off.
PENALTIES = (("repetition_penalty", "repetition_context_size"), ("presence_penalty", "presence_context_size"),
             ("frequency_penalty", "frequency_context_size"))
CONTEXT_SIZE = 20  # mlx_lm.server's default context of each penalty


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
    """How to generate: the sampling fields of a request, or the server's defaults (mlx_lm.server's names).

    Attributes:
        max_tokens (int | None): most tokens to generate; None fills up to the server's default.
        temperature (float): 0 is greedy (argmax), as mlx_lm.server's default.
        top_p (float): nucleus mass in (0, 1]; 1 keeps every token.
        top_k (int): sample among the k most likely tokens; 0 keeps every token.
        min_p (float): drop tokens less likely than min_p x the most likely one; 0 keeps every token.
        xtc_probability, xtc_threshold (float): XTC sampling (mlx-lm's `apply_xtc`); probability 0 is off.
        penalties (dict): {"repetition_penalty": (penalty, context tokens), "presence_penalty": ...,
            "frequency_penalty": ...} for the ones set (mlx-lm's `make_logits_processors`).
        logit_bias (dict[int, float] | None): added to the logits of those token ids.
        seed (int | None): seeds MLX's generator before this request's first token.
        stop (list[str]): text that ends the answer (not included in it).
        logprobs (bool): return each generated token's log-probability. top_logprobs (int): and the n most
            likely tokens at each step (0: none).
    """

    max_tokens: int = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    penalties: dict = field(default_factory=dict)
    logit_bias: dict = None
    seed: int = None
    stop: list = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass
class Request:
    """One checked request.

    Attributes:
        kind (str): "chat" or "completion". model (str | None): the model id (a cartridge or the base model);
            None when the body names none (the base model, as mlx_lm.server answers with its --model).
        messages (list[dict]): chat turns {"role", "content": str} (chat only).
        prompt (str): the text that continues the document (completion only).
        stream (bool), include_usage (bool): server-sent events; a last chunk with `usage`.
        sampling (Sampling). return_token_ids (bool): add the generated token ids to each choice (as vLLM).
        chat_template_kwargs (dict | None): more arguments of the chat template (mlx_lm.server's field).
    """

    kind: str
    model: str = None
    messages: list = None
    prompt: str = None
    stream: bool = False
    include_usage: bool = False
    sampling: Sampling = field(default_factory=Sampling)
    return_token_ids: bool = False
    chat_template_kwargs: dict = None


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


def _count(body, key, low, high, default):
    value = _typed(body, key, (int,), default)
    if not low <= value <= high:
        raise bad(f"'{key}' is {value}; it must be between {low:,} and {high:,}", key)
    return value


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


def _max_tokens(body):
    """max_completion_tokens, else max_tokens (mlx_lm.server's order); None if neither is set."""
    for key in ("max_completion_tokens", "max_tokens"):
        if body.get(key) is not None:
            return _count(body, key, 1, 2 ** 31 - 1, None)
    return None


def _penalties(body):
    out = {}
    for key, size_key in PENALTIES:
        # repetition: a multiplier, >= 0 as mlx_lm.server checks it; presence and frequency: OpenAI's -2 .. 2
        penalty = _number(body, key, *((0, 1e9) if key == "repetition_penalty" else (-2, 2)), 0.0)
        size = _count(body, size_key, 0, 2 ** 31 - 1, CONTEXT_SIZE)
        if penalty != 0:
            out[key] = (penalty, size)
    return out


def _logit_bias(body):
    """{token id: bias} from OpenAI's {"id": bias} (ids as strings in JSON), each bias -100 .. 100."""
    raw = _typed(body, "logit_bias", (dict,))
    if not raw:
        return None
    out = {}
    for key, value in raw.items():
        try:
            token = int(key)
        except ValueError:
            raise bad(f"'logit_bias' key {key!r} is not a token id", "logit_bias") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100 or token < 0:
            raise bad(f"'logit_bias' {key}: {value!r}; give a token id >= 0 and a bias between -100 and 100",
                      "logit_bias")
        out[token] = float(value)
    return out


def _logprobs(body, kind):
    """(logprobs, top_logprobs): chat's boolean `logprobs` (+ `top_logprobs`), or the completions API's
    integer `logprobs` (the number of most likely tokens, 0-5, as OpenAI's legacy API); `top_logprobs`
    alone asks for them too (as mlx_lm.server)."""
    value = body.get("logprobs")
    if kind == "completion" and isinstance(value, int) and not isinstance(value, bool):
        if not 0 <= value <= 5:
            raise bad(f"'logprobs' is {value}; it must be between 0 and 5", "logprobs")
        return True, value
    wanted = _typed(body, "logprobs", (bool,), False)
    top = body.get("top_logprobs")
    top = 0 if top in (None, -1) else _count(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)  # -1: mlx's "none"
    return wanted or top > 0, top


def _refuse_unsupported(body):
    for key, nothing in UNSUPPORTED.items():
        if key in body and body[key] not in nothing:
            raise bad(f"'{key}' is not supported by this server", key)


def parse_sampling(body, defaults, kind="chat"):
    """The sampling fields of a chat or completion body over the server's `defaults`.

    Raises:
        APIError: 400 naming the field, for a wrong type or a value out of range (`seed` 0 .. 2^64 - 1); `n`
        other than 1; a field this server does not support that asks for something (`UNSUPPORTED`).
    """
    _refuse_unsupported(body)
    if _typed(body, "n", (int,), 1) != 1:
        raise bad(f"'n' is {body['n']}; this server returns one choice (n=1)", "n")
    top_p = _number(body, "top_p", 0, 1, defaults.top_p)
    if top_p == 0:
        raise bad("'top_p' is 0; it must be above 0 (1 keeps every token)", "top_p")
    seed = _typed(body, "seed", (int,))
    if seed is not None and not 0 <= seed < 2 ** 64:  # MLX's generator takes an unsigned 64-bit seed
        raise bad(f"'seed' is {seed}; it must be between 0 and 2^64 - 1", "seed")
    logprobs, top_logprobs = _logprobs(body, kind)
    return Sampling(
        max_tokens=_max_tokens(body), temperature=_number(body, "temperature", 0, 2, defaults.temperature),
        top_p=top_p, top_k=_count(body, "top_k", 0, 2 ** 31 - 1, defaults.top_k),
        min_p=_number(body, "min_p", 0, 1, defaults.min_p),
        xtc_probability=_number(body, "xtc_probability", 0, 1, defaults.xtc_probability),
        xtc_threshold=_number(body, "xtc_threshold", 0, 0.5, defaults.xtc_threshold),
        penalties=_penalties(body), logit_bias=_logit_bias(body), seed=seed, stop=_stop(body), logprobs=logprobs, top_logprobs=top_logprobs)


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


def _common(body, kind, defaults):
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise bad("'model' must name a model (GET /v1/models lists them)", "model")
    options = _typed(body, "stream_options", (dict,), {})
    unknown = sorted(set(options) - {"include_usage"})
    if unknown:
        raise bad(f"'stream_options.{unknown[0]}' is not supported by this server", "stream_options")
    return dict(kind=kind, model=model, stream=_typed(body, "stream", (bool,), False),
                include_usage=bool(options.get("include_usage")), sampling=parse_sampling(body, defaults, kind),
                return_token_ids=_typed(body, "return_token_ids", (bool,), False))


def parse_chat(body, defaults=None):
    """Check a /v1/chat/completions body.

    Args:
        body (dict): the request's JSON. defaults (Sampling | None): the server's sampling defaults.

    Returns:
        Request: kind "chat".

    Raises:
        APIError: 400 naming the field at fault.
    """
    kwargs = _typed(body, "chat_template_kwargs", (dict,))
    return Request(messages=parse_messages(body), chat_template_kwargs=kwargs,
                   **_common(body, "chat", defaults or Sampling()))


def parse_completion(body, defaults=None):
    """Check a /v1/completions body: `prompt` is one string (the text after the document; may be empty).

    Args:
        body (dict): the request's JSON. defaults (Sampling | None): the server's sampling defaults.

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
    if body.get("chat_template_kwargs") is not None:
        raise bad("'chat_template_kwargs' is for chat requests; a completion's prompt is not templated",
                  "chat_template_kwargs")
    return Request(prompt=prompt, **_common(body, "completion", defaults or Sampling()))
