"""Run a document's tokens through a model in chunks, filling mlx-lm's caches (build, extend, calibration).
"""

import inspect

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from .. import calibrate as calibrate_mod

DEFAULT_PREFILL_STEP = 512


def prefill(model, tokens, step=DEFAULT_PREFILL_STEP, progress=None, caches=None):
    """Run `tokens` through the model in chunks and return the filled mlx-lm caches.

    Args:
        model (nn.Module): mlx-lm model. tokens (list[int]): prompt tokens.
        step (int): tokens per forward pass. Default: 512.
        progress (callable | None): called as progress(done_tokens, total_tokens) once with 0 before
            the first chunk and after each chunk.
        caches (list | None): caches to continue (e.g. a cartridge's `prompt_cache()`, for extend);
            None makes fresh mlx-lm caches. Default: None.

    Returns:
        list: mlx-lm's cache objects (`make_prompt_cache`), one per cache layer, filled (or `caches`,
        filled further). Check the model's cache kinds first (`cartridge.models.families.plan_layers`).
    """
    return _feed(model, tokens, step, progress, make_prompt_cache(model) if caches is None else caches)


def prefill_holding(model, tokens, step=DEFAULT_PREFILL_STEP, progress=None):
    """`prefill` that stops once at calibration's split (`calibrate.split_of`) to keep what the sliding-window
    layers store there (`calibrate.hold_windows`): calibration measures a cartridge of the tokens before it.

    Returns:
        tuple: (the filled caches, {layer: (K, V)} of the window layers at the split).
    """
    split = calibrate_mod.split_of(tokens)
    caches = prefill(model, tokens[:split], step, progress and (lambda done, _: progress(done, len(tokens))))
    held = calibrate_mod.hold_windows(caches)
    rest = progress and (lambda done, _: progress(split + done, len(tokens)))
    return prefill(model, tokens[split:], step, rest, caches), held


def _feed(model, tokens, step, progress, caches):
    body = getattr(model, "model", model)  # the transformer without the LM head: its logits are not needed
    if body is not model and "cache" not in inspect.signature(body.__call__).parameters:
        body = model
    ids = mx.array(tokens, dtype=mx.uint32)
    if progress:
        progress(0, len(tokens))  # before the first chunk, so a progress bar's clock starts with the prefill
    for start in range(0, len(tokens), step):
        body(ids[None, start:start + step], cache=caches)
        mx.eval([c.state for c in caches])
        if progress:
            progress(min(start + step, len(tokens)), len(tokens))
    return caches
