"""One queue for the model: every request is prepared and generated, in arrival order, on one thread.

Exactness over batching: a request's tokens are those it would get alone (the same prompt, cache and
sampler, and `seed` applied just before its first token), whatever else is queued. All MLX work
(loading the model and the cartridges too) runs on that thread. A request whose client has gone is
skipped, or stopped at its next token, so it frees the queue.
"""

import asyncio
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_sampler

from ..write.build import context_length
from ..errors import CartridgeError
from .pool import Refused
from .protocol import APIError, bad


class Job:
    """One request on its way through the queue; the worker reports to it as events.

    Events, in order: ("start", {"prompt_tokens", "cached_tokens"}) or ("error", {"error": APIError});
    then ("delta", {"text", "token"}) per token; then ("done", {"finish_reason", "completion_tokens"})
    or ("error", ...).

    Args:
        request (protocol.Request). loop (asyncio.AbstractEventLoop): where `events` is read.
    """

    def __init__(self, request, loop):
        self.request, self._loop = request, loop
        self.events = asyncio.Queue()
        self.cancelled = threading.Event()

    def emit(self, kind, **data):
        """Report an event (from the worker thread)."""
        self._loop.call_soon_threadsafe(self.events.put_nowait, (kind, data))

    def cancel(self):
        """The client has gone: skip this job, or stop it at its next token."""
        self.cancelled.set()


@dataclass
class Plan:
    """What to generate: a model, the prompt tokens after the cache, the cache and its cached tokens."""

    model: object
    tokenizer: object
    prompt: list
    cache: list
    cached: int
    max_tokens: int


class StopText:
    """Cut the answer at the first stop sequence, holding back text that may be the start of one.

    Args:
        stops (list[str]): the stop sequences (may be empty).
    """

    def __init__(self, stops):
        self.stops, self.held = stops, ""

    def feed(self, text):
        """Returns (text safe to send, True if a stop sequence was reached)."""
        buf = self.held + text
        hits = [buf.find(s) for s in self.stops if s in buf]
        if hits:
            self.held = ""
            return buf[: min(hits)], True
        keep = max((k for s in self.stops for k in range(1, len(s)) if buf.endswith(s[:k])), default=0)
        self.held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], False

    def flush(self):
        """The text held back, once the answer ended without a stop sequence."""
        out, self.held = self.held, ""
        return out


def encode(tokenizer, text, first):
    """Token ids of `text`: special tokens added only at the start of a prompt, unless it starts with BOS
    (mlx-lm's rule in `stream_generate`)."""
    bos = getattr(tokenizer, "bos_token", None)
    return list(tokenizer.encode(text, add_special_tokens=first and (bos is None or not text.startswith(bos))))


def base_prompt(tokenizer, request):
    """Prompt tokens for the base model without a cartridge: the chat template over all messages (plain
    text joined by blank lines when the tokenizer has none), or the completion prompt."""
    if request.kind == "completion":
        prompt = encode(tokenizer, request.prompt, True)
        if not prompt:
            raise bad("'prompt' is empty; the base model needs at least one prompt token", "prompt")
        return prompt
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(request.messages, add_generation_prompt=True, tokenize=False)
    else:
        text = "\n\n".join(m["content"] for m in request.messages) + "\n\n"
    return encode(tokenizer, text, True)


def cartridge_prompt(cart, request):
    """Prompt tokens that follow a cartridge's document: the chat turns (`Cartridge.chat_prompt`), or the
    completion prompt's text continuing the document."""
    if request.kind == "chat":
        return cart.chat_prompt(request.messages)
    if not request.prompt:
        raise bad("'prompt' is empty; a cartridge needs at least one token after its document", "prompt")
    return encode(cart.tokenizer, request.prompt, False)


def fit_max_tokens(limit, cached, prompt, asked, default, prompt_field="messages"):
    """The tokens to generate: `asked`, or `default` clipped to the context left.

    Args:
        limit (int | None): the model's context in tokens. cached, prompt (int): tokens before the answer.
        asked (int | None): the request's max_tokens. default (int): used when `asked` is None.
        prompt_field (str): the request field a prompt that does not fit is blamed on. Default: "messages".

    Raises:
        APIError: 400 if the prompt leaves no room, or `asked` exceeds the room left.
    """
    room = None if limit is None else limit - cached - prompt
    if room is not None and room < 1:
        raise bad(f"the prompt ({prompt:,} tokens after {cached:,} cached) does not fit the model's context of "
                  f"{limit:,} tokens", prompt_field)
    if asked is None:
        return default if room is None else min(default, room)
    if room is not None and asked > room:
        raise bad(f"'max_tokens' is {asked:,}; the model's context of {limit:,} tokens leaves {room:,} after "
                  f"{cached:,} cached and {prompt:,} prompt tokens", "max_tokens")
    return asked


class Engine:
    """The one worker thread and the pool it serves from.

    Args:
        make_pool (callable): returns the `Pool`; called on the worker thread (it loads the model there).
        default_max_tokens (int): max_tokens for a request that gives none. Default: 512.
    """

    def __init__(self, make_pool, default_max_tokens=512):
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="cartridge-generate")
        self.pool = self._executor.submit(make_pool).result()
        self.default_max_tokens = default_max_tokens
        self._stats, self._stats_lock = Counter(), threading.Lock()
        self._closed = False

    def _count(self, key):
        with self._stats_lock:
            self._stats[key] += 1

    def note_rejected(self):
        """Count a request refused before it was queued (a 4xx from parsing: bad JSON, bad fields)."""
        self._count("requests")
        self._count("refused")

    def stats(self):
        """Counts since start: requests, answered, cancelled, refused, failed, generated_tokens."""
        with self._stats_lock:
            return dict(self._stats)

    def submit(self, job):
        """Queue `job` behind every request before it."""
        self._executor.submit(self._run, job)

    def close(self, wait=False):
        """Stop taking work; queued jobs are dropped, the running one ends at its next token.

        Args:
            wait (bool): also join the worker thread (after its running job ends). Default: False.
        """
        self._closed = True
        self._executor.shutdown(wait=wait, cancel_futures=True)

    def _run(self, job):
        self._count("requests")
        if job.cancelled.is_set() or self._closed:
            self._count("cancelled")
            return
        try:
            plan = self._plan(job.request)
        except (Refused, APIError, CartridgeError) as e:
            self._count("refused")
            return self._refuse(job, e)
        except Exception as e:  # a bug must not stop the server: report it, keep serving
            self._count("failed")
            return job.emit("error", error=APIError(500, f"{type(e).__name__}: {e}", type="server_error"))
        job.emit("start", prompt_tokens=plan.cached + len(plan.prompt), cached_tokens=plan.cached)
        try:
            self._generate(job, plan)
        except Exception as e:
            self._count("failed")
            job.emit("error", error=APIError(500, f"{type(e).__name__}: {e}", type="server_error"))

    @staticmethod
    def _refuse(job, e):
        if isinstance(e, Refused):
            return job.emit("error", error=APIError(e.status, e.message, "model", e.code))
        job.emit("error", error=e if isinstance(e, APIError) else bad(str(e)))

    def _plan(self, request):
        cart = self.pool.get(request.model)
        if cart is None:
            model, tokenizer = self.pool.lm.model, self.pool.lm.tokenizer
            prompt, cache, cached = base_prompt(tokenizer, request), None, 0
        else:
            model, tokenizer, prompt = cart.model, cart.tokenizer, cartridge_prompt(cart, request)
            cache, cached = cart.prompt_cache(), len(cart.tokens)
        max_tokens = fit_max_tokens(context_length(model), cached, len(prompt), request.sampling.max_tokens,
                                    self.default_max_tokens, "prompt" if request.kind == "completion" else "messages")
        return Plan(model, tokenizer, prompt, cache, cached, max_tokens)

    def _generate(self, job, plan):
        s = job.request.sampling
        sampler = make_sampler(s.temperature, top_p=s.top_p if s.top_p < 1 else 0.0)
        if s.seed is not None:
            mx.random.seed(s.seed)
        stops, n, finish = StopText(s.stop), 0, "length"
        for r in mlx_lm.stream_generate(plan.model, plan.tokenizer, plan.prompt, max_tokens=plan.max_tokens,
                                        sampler=sampler, prompt_cache=plan.cache):
            if job.cancelled.is_set() or self._closed:
                self._count("cancelled")
                return
            n = r.generation_tokens
            self._count("generated_tokens")
            text, stopped = stops.feed(r.text)
            job.emit("delta", text=text, token=int(r.token))
            if stopped or r.finish_reason == "stop":
                finish = "stop"
                break
        tail = stops.flush()  # empty after a stop sequence
        if tail:
            job.emit("delta", text=tail, token=None)
        self._count("answered")
        job.emit("done", finish_reason=finish, completion_tokens=n)
