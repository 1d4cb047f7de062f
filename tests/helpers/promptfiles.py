"""Helpers for the prompt-cache tests: mlx-lm's own command-line tools run in this process, as a user runs them.

`cache_prompt(model_dir, path, text, *args)` is `mlx_lm.cache_prompt --model DIR --prompt-cache-file PATH
--prompt TEXT ARGS`; `mlx_generate(path, question, *args)` is `mlx_lm.generate --prompt-cache-file PATH --prompt
QUESTION ARGS` and returns what it printed and the prompt token ids it handed to `generate` (its suffix after
the cached prefix)."""

import contextlib
import importlib
import io
import sys

cache_prompt_module = importlib.import_module("mlx_lm.cache_prompt")
generate_module = importlib.import_module("mlx_lm.generate")


def _main(module, argv):
    out = io.StringIO()
    old = sys.argv
    sys.argv = ["mlx_lm", *map(str, argv)]
    try:
        with contextlib.redirect_stdout(out):
            module.main()
    finally:
        sys.argv = old
    return out.getvalue()


def cache_prompt(model_dir, path, text, *args):
    """Run mlx_lm.cache_prompt; returns `path`."""
    _main(cache_prompt_module, ["--model", model_dir, "--prompt-cache-file", path, "--prompt", text, *args])
    return path


def mlx_generate(path, question, *args, monkeypatch):
    """Run mlx_lm.generate over a prompt-cache file, greedy; returns (printed text, prompt token ids fed)."""
    fed = []
    original = generate_module.generate

    def recording(model, tokenizer, prompt, **kwargs):
        fed.append(list(prompt))
        return original(model, tokenizer, prompt, **kwargs)

    monkeypatch.setattr(generate_module, "generate", recording)
    text = _main(generate_module, ["--prompt-cache-file", path, "--prompt", question, "--verbose", "False", *args])
    return text.removesuffix("\n"), fed[0]  # print()'s line end


def save_model_dir(lm, path, **config):
    """A LoadedModel of `conftest.make_tiny` saved as an mlx-lm model folder (TINY_CONFIG with `config`); returns it."""
    import json

    import mlx.core as mx
    from helpers.tiny_models import TINY_CONFIG
    from mlx.utils import tree_flatten

    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({**TINY_CONFIG, **config}))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    lm.tokenizer._tokenizer.save_pretrained(str(path))
    return path


def prefill_file(lm, path, tokens, caches, model_ref):
    """What mlx_lm.cache_prompt writes for a model whose caches are `caches` (e.g. the RotatingKVCache(max_kv_size,
    keep=4) it makes with --max-kv-size for a model without its own `make_cache`): the same prefill loop and save."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import save_prompt_cache

    for _ in generate_step(mx.array(tokens), lm.model, max_tokens=0, prompt_cache=caches):
        pass
    save_prompt_cache(str(path), caches, {"model": str(model_ref), "tokenizer_config": "{}"})
    return path
