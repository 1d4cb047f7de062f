"""A request's sampler, logits processors and log-probabilities, as mlx_lm.server makes them
(`mlx_lm.sample_utils.make_sampler`, `make_logits_processors`; `server._format_top_logprobs`)."""

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from .protocol import bad


def vocab_size(model, tokenizer):
    """Tokens the model scores: its `vocab_size`, else the tokenizer's."""
    return getattr(getattr(model, "args", None), "vocab_size", None) or len(tokenizer)


def make_generation(s, model, tokenizer):
    """The sampler and logits processors of a request's `Sampling`.

    A top_k of the vocabulary's size or more keeps every token (mlx-lm's `apply_top_k` raises there).

    Returns:
        tuple: (sampler, list of logits processors) for `mlx_lm.stream_generate`.

    Raises:
        APIError: 400 for a logit_bias token id outside the vocabulary.
    """
    vocab = vocab_size(model, tokenizer)
    bad_ids = sorted(t for t in (s.logit_bias or {}) if t >= vocab)
    if bad_ids:
        raise bad(f"'logit_bias' names token {bad_ids[0]}; this model's ids are 0 to {vocab - 1:,}", "logit_bias")
    sampler = make_sampler(s.temperature, top_p=s.top_p if s.top_p < 1 else 0.0, min_p=s.min_p,
                           top_k=s.top_k if s.top_k < vocab else 0, xtc_probability=s.xtc_probability,
                           xtc_threshold=s.xtc_threshold,
                           xtc_special_tokens=list(tokenizer.encode("\n", add_special_tokens=False))
                           + list(tokenizer.eos_token_ids))
    args = {key: value for key, (value, _) in s.penalties.items()}
    sizes = {key.replace("penalty", "context_size"): size for key, (_, size) in s.penalties.items()}
    return sampler, make_logits_processors(s.logit_bias, **args, **sizes)


def _entry(tokenizer, token, logprob):
    text = tokenizer.decode([token])
    return {"id": token, "token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def token_logprobs(logprobs, token, top_n, tokenizer):
    """One generated token's log-probability and the `top_n` most likely tokens at its step.

    Args:
        logprobs (mx.array): (vocab,) float log-probabilities of the step (after the logits processors, before
            the sampler's filters: mlx-lm's `GenerationResponse.logprobs`).
        token (int): the generated token. top_n (int): alternatives to list (0: none).
        tokenizer: decodes each token to its text.

    Returns:
        dict: {"id", "token" (its text), "logprob", "bytes" (UTF-8 of the text), "top_logprobs": [the same
        without "top_logprobs", most likely first]}: OpenAI's chat format with mlx_lm.server's "id".
    """
    entry = _entry(tokenizer, token, logprobs[token].item())
    top = []
    if top_n > 0:
        ids = mx.argpartition(-logprobs, kth=top_n - 1)[:top_n]
        values = logprobs[ids].tolist()
        top = [_entry(tokenizer, i, v) for v, i in sorted(zip(values, ids.tolist()), key=lambda x: -x[0])]
    entry["top_logprobs"] = top
    return entry


def completion_logprobs(entries, offset=0):
    """OpenAI's legacy completions format of `token_logprobs` entries.

    Args:
        entries (list[dict]): from `token_logprobs`. offset (int): characters of text before the first token.

    Returns:
        dict: {"tokens", "token_logprobs", "top_logprobs": [{text: logprob}] or None, "text_offset"}.
    """
    offsets, at = [], offset
    for e in entries:
        offsets.append(at)
        at += len(e["token"])
    tops = [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries]
    return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": tops if any(tops) else None, "text_offset": offsets}
