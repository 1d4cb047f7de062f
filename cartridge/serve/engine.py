"""One queue for the model: every request is prepared and generated, in arrival order, on one thread.

Exactness over batching: a request's tokens are those it would get alone (the same prompt, cache and
sampler, and `seed` applied just before its first token), whatever else is queued. All MLX work
(loading the model and the cartridges, encoding a prefix the shelf saves) runs on that thread. A request
whose client has gone is skipped, or stopped at its next token, so it frees the queue.

A request for the base model is answered from the longest cartridge whose tokens its rendered prompt
starts with (`Pool.match`); only the rest of the prompt is prefilled.
"""

import asyncio
import logging
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import mlx.core as mx
import mlx_lm
from mlx_lm.models.cache import make_prompt_cache

from ..write.options import context_length
from ..errors import CartridgeError
from ..models.prompt import prompt_mode
from .pool import Refused
from .prompts import base_prompt, cartridge_prompt, default_stops
from .protocol import APIError, bad
from .sampling import make_generation, token_logprobs

PREFILL_STEP = 2048  # mlx_lm.server's --prefill-step-size default
log = logging.getLogger("cartridge.serve")


class Job:
    """One request on its way through the queue; the worker reports to it as events.

    Events, in order: ("start", {"prompt_tokens", "cached_tokens"}) or ("error", {"error": APIError});
    then ("delta", {"text", "token", "logprobs"}) per token; then ("done", {"finish_reason",
    "completion_tokens"}) or ("error", ...).

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
class Generation:
    """What one request generates with: a model, the prompt tokens after the cache, the cache and its cached
    tokens, the sampler, and the prefix to save after the answer (`save`: (tokens, text) or None)."""

    model: object
    tokenizer: object
    prompt: list
    cache: list
    cached: int
    max_tokens: int
    mode: str
    sampler: object = None
    processors: list = None
    save: tuple = None


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
    """The one worker thread, the pool it serves from and the shelf it saves prefixes to.

    Args:
        make_pool (callable): returns the `Pool`; called on the worker thread (it loads the model there).
        default_max_tokens (int): max_tokens for a request that gives none. Default: 512.
        make_shelf (callable | None): called with the pool on the worker thread; returns the `Shelf` that
            saves unmatched prefixes, or None. Default: None.
        template_args (dict | None): --chat-template-args for the base model's prompts. Default: None.
        prefill_step (int): prompt tokens per forward pass. Default: 2048 (mlx_lm.server's).
    """

    def __init__(self, make_pool, default_max_tokens=512, make_shelf=None, template_args=None,
                 prefill_step=PREFILL_STEP):
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="cartridge-generate")
        try:
            self.pool = self._executor.submit(make_pool).result()
            self.shelf = None if make_shelf is None else self._executor.submit(make_shelf, self.pool).result()
        except BaseException:
            self._executor.shutdown()
            raise
        self.default_max_tokens, self.template_args, self.prefill_step = default_max_tokens, template_args, prefill_step
        self._stats, self._stats_lock = Counter(), threading.Lock()
        self._closed = False

    def _count(self, key, n=1):
        with self._stats_lock:
            self._stats[key] += n

    def note_rejected(self):
        """Count a request refused before it was queued (a 4xx from parsing: bad JSON, bad fields)."""
        self._count("requests")
        self._count("refused")

    def stats(self):
        """Counts since start: requests, answered, cancelled, refused, failed, generated_tokens, and
        prefix_hits / cached_tokens (prompts answered from a cartridge they start with)."""
        with self._stats_lock:
            return dict(self._stats)

    @property
    def healthy(self):
        """True while the worker takes requests (mlx_lm.server's /health)."""
        return not self._closed

    def submit(self, job):
        """Queue `job` behind every request before it."""
        self._executor.submit(self._run, job)

    def close(self, wait=False):
        """Stop taking work; queued jobs are dropped, the running one ends at its next token.

        Args:
            wait (bool): also join the worker thread (after its running job ends) and let the shelf write
                the prefixes it has queued. Default: False.
        """
        self._closed = True
        self._executor.shutdown(wait=wait, cancel_futures=True)
        if wait and self.shelf is not None:
            self.shelf.close()

    def _run(self, job):
        self._count("requests")
        if job.cancelled.is_set() or self._closed:
            self._count("cancelled")
            return
        try:
            gen = self._prepare(job.request)
        except (Refused, APIError, CartridgeError) as e:
            self._count("refused")
            return self._refuse(job, e)
        except Exception as e:  # a bug must not stop the server: report it, keep serving
            self._count("failed")
            return job.emit("error", error=APIError(500, f"{type(e).__name__}: {e}", type="server_error"))
        job.emit("start", prompt_tokens=gen.cached + len(gen.prompt), cached_tokens=gen.cached)
        try:
            generated = self._generate(job, gen)
        except Exception as e:
            self._count("failed")
            return job.emit("error", error=APIError(500, f"{type(e).__name__}: {e}", type="server_error"))
        if gen.save is not None and generated:  # the answer is sent: the prompt's prefix is prefilled in gen.cache
            self._save(gen)

    @staticmethod
    def _refuse(job, e):
        if isinstance(e, Refused):
            return job.emit("error", error=APIError(e.status, e.message, "model", e.code))
        job.emit("error", error=e if isinstance(e, APIError) else bad(str(e)))

    def _prepare(self, request):
        cart = self.pool.get(request.model)
        if cart is None:
            gen = self._prepare_base(request)
        else:
            gen = Generation(cart.model, cart.tokenizer, cartridge_prompt(cart, request), cart.prompt_cache(),
                        len(cart.tokens), 0, cart.info.prompt_mode)
        gen.max_tokens = fit_max_tokens(context_length(gen.model), gen.cached, len(gen.prompt),
                                         request.sampling.max_tokens, self.default_max_tokens,
                                         "prompt" if request.kind == "completion" else "messages")
        gen.sampler, gen.processors = make_generation(request.sampling, gen.model, gen.tokenizer)
        return gen

    def _prepare_base(self, request):
        """The base model's generation: from the longest cartridge the prompt starts with, else a fresh cache
        (kept to save the prompt's prefix from, when the shelf wants it)."""
        lm = self.pool.lm
        base = base_prompt(lm.tokenizer, request, self.template_args)
        for name, n in self.pool.match(base.tokens):
            try:
                cart = self.pool.get(name)
            except (Refused, CartridgeError, OSError) as e:  # refused, or evicted meanwhile: the next one
                log.info("prefix %s not used: %s", name, getattr(e, "message", e))
                continue
            if self.shelf is not None:
                self.shelf.touch(name)
            self._count("prefix_hits")
            self._count("cached_tokens", n)
            log.info("prompt of %s tokens: %s from cartridge %s, %s to prefill", f"{len(base.tokens):,}", f"{n:,}",
                     name, f"{len(base.tokens) - n:,}")
            return Generation(cart.model, cart.tokenizer, base.tokens[n:], cart.prompt_cache(), n, 0, base.mode)
        gen = Generation(lm.model, lm.tokenizer, base.tokens, None, 0, 0, prompt_mode(lm.tokenizer))
        if self.shelf is not None:
            keep = base.prefix_length(lm.tokenizer)
            if keep > self.shelf.min_tokens:
                gen.cache, gen.save = make_prompt_cache(lm.model), (base.tokens[:keep], base.text[:base.cut])
        return gen

    def _save(self, gen):
        try:
            self.shelf.capture(*gen.save, gen.cache)
        except Exception as e:  # the answer is sent: a prefix that cannot be saved is one line, never a failure
            log.warning("prefix of %s tokens not saved: %s: %s", f"{len(gen.save[0]):,}", type(e).__name__, e)

    def _generate(self, job, gen):
        """Stream the answer's events; returns the tokens generated (0 if cancelled before the first)."""
        s = job.request.sampling
        if s.seed is not None:
            mx.random.seed(s.seed)
        stops, n, finish = StopText(s.stop + default_stops(gen.tokenizer, gen.mode)), 0, "length"
        for r in mlx_lm.stream_generate(gen.model, gen.tokenizer, gen.prompt, max_tokens=gen.max_tokens,
                                        sampler=gen.sampler, logits_processors=gen.processors,
                                        prompt_cache=gen.cache, prefill_step_size=self.prefill_step):
            n = r.generation_tokens
            if job.cancelled.is_set() or self._closed:
                self._count("cancelled")
                return n
            self._count("generated_tokens")
            text, stopped = stops.feed(r.text)
            logprobs = token_logprobs(r.logprobs, int(r.token), s.top_logprobs, gen.tokenizer) if s.logprobs else None
            job.emit("delta", text=text, token=int(r.token), logprobs=logprobs)
            if stopped or r.finish_reason == "stop":
                finish = "stop"
                break
        tail = stops.flush()  # empty after a stop sequence
        if tail:
            job.emit("delta", text=tail, token=None, logprobs=None)
        self._count("answered")
        job.emit("done", finish_reason=finish, completion_tokens=n)
        return n
