"""The reference of the real-model tests: a fresh mlx-lm prefill of the same tokens with mlx-lm's own caches
(`make_prompt_cache`: a RotatingKVCache for a sliding-window layer, a KVCache for the others).

Each check that compares a cartridge's cache with the reference also runs on mlx-lm's own caches filled with
the document (`mlx_cache`): a check that mlx-lm's own cache fails would test the harness, not the cartridge.
"""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from cartridge.models.prompt import encode_text

CHUNK = 64  # teacher-forced rows per forward pass: 64 x 262,144 float32 logits (gemma3) = 64 MiB


def greedy(model, tokenizer, prompt, n, cache=None):
    """`n` greedy tokens of `mlx_lm.stream_generate` (a fresh mlx-lm cache when `cache` is None)."""
    return [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=n, prompt_cache=cache)]


def mlx_cache(model, tokens, stored=None):
    """mlx-lm's own caches after one prefill of `tokens` (as `stream_generate` prefills a prompt of up to
    2,048 tokens); with `stored` (a dtype), every cached K/V rounded to it, as an fp16 cartridge stores them."""
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    for c in cache:
        if stored is not None:
            c.keys, c.values = (x.astype(stored).astype(x.dtype) for x in (c.keys, c.values))
    mx.eval([c.state for c in cache])
    return cache


def teacher_forced(model, cache, stream, rows):
    """Log-probabilities (float32 numpy, len(rows) x vocab) after stream[i] for each i of `rows`, fed to `model`
    over `cache` (filled further) `CHUNK` tokens at a time: only the rows asked for are kept."""
    out, rows = {}, sorted(rows)
    for start in range(0, len(stream), CHUNK):
        logits = model(mx.array(stream[start:start + CHUNK])[None], cache=cache)[0].astype(mx.float32)
        for i in (r for r in rows if start <= r < start + CHUNK):
            row = logits[i - start]
            out[i] = np.array(row - mx.logsumexp(row))
    return np.stack([out[i] for i in rows])


def run_turns(model, cache, turns, loop):
    """Feed each turn's prompt tokens to `cache` and generate its count of greedy tokens with `loop`
    ("generate_step" or "stream_generate", the tokenizer for the latter as `loop[1]`).

    Args:
        turns (list): (prompt tokens, tokens to generate) per turn.

    Returns:
        tuple: (stream, yielded): every token fed after the document in order, and {index in stream of the
        token before a generated one: the log-probabilities (float32 numpy) the loop gave for it}.
    """
    stream, yielded = [], {}
    for prompt, n in turns:
        stream += prompt
        for token, logprobs in _steps(model, prompt, cache, n, loop):
            yielded[len(stream) - 1] = np.array(logprobs.astype(mx.float32))
            stream.append(token)
    return stream, yielded


def _steps(model, prompt, cache, n, loop):
    if loop[0] == "generate_step":
        # range first: zip(generate_step(...), range(n)) would pull an extra step, which the cache also feeds
        for _, (y, logprobs) in zip(range(n), generate_step(mx.array(prompt), model, prompt_cache=cache)):
            yield int(y), logprobs
    else:
        for r in mlx_lm.stream_generate(model, loop[1], prompt, max_tokens=n, prompt_cache=cache):
            yield r.token, r.logprobs


def document_of(tokenizer, text, n):
    """A passage of `text` whose plain prefix (BOS + passage) is exactly `n` tokens: the longest start of `text`
    (cut after a character) that is, else of `text` from its next paragraph on, and so on.

    Raises:
        ValueError: no such passage (a word of several tokens straddles the count at every paragraph).
    """
    start = 0
    while start >= 0:
        found = _cut(tokenizer, text[start:], n)
        if found is not None:
            return found
        start = text.find("\n\n", start + 1)
    raise ValueError(f"no passage of the text is {n} tokens")


def _cut(tokenizer, text, n):
    def count(k):
        return len(encode_text(tokenizer, text[:k].rstrip(), True))

    lo, hi = 1, len(text)
    while lo < hi:  # the first cut of more than n tokens (token counts grow with the cut, give or take a merge)
        mid = (lo + hi) // 2
        lo, hi = (mid + 1, hi) if count(mid) <= n else (lo, mid)
    return next((text[:k].rstrip() for k in range(lo - 1, max(lo - 40, 0), -1) if count(k) == n), None)


def decode_loop(cart, prompt, n, forced=None):
    """The decode loop on a fresh cache of `cart`: the prompt, then n - 1 single tokens (argmax, or `forced`'s).

    Returns:
        tuple: (the n tokens chosen, (n, vocab) float32 numpy log-probabilities of each step).
    """
    cache, tokens, rows = cart.prompt_cache(), [], []
    x = prompt
    for i in range(n):
        logits = cart.model(mx.array(x)[None], cache=cache)[0, -1].astype(mx.float32)
        rows.append(np.array(logits - mx.logsumexp(logits)))
        tokens.append(int(np.argmax(rows[-1])) if forced is None else forced[i])
        x = [tokens[-1]]
    return tokens, np.stack(rows)
