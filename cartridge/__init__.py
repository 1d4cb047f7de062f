"""cartridge: persistent, memory-mappable KV caches for MLX language models.

    cartridge.build(text, "doc.cart")                 # prefill once, write pages
    cartridge.convert("doc.cart", "q4.cart", tier="mlx4g32")  # re-encode fp16 pages, no prefill
    cart = cartridge.load("doc.cart")                 # verify, map pages
    both = cartridge.load_many(["a.cart", "b.cart"])  # several documents in one context
    cartridge.extend("doc.cart", more_text)           # prefill only the new text
    cartridge.import_prompt_cache("doc.safetensors", "doc.cart", document=text)  # an mlx_lm.cache_prompt file
    cartridge.export_prompt_cache("doc.cart", "doc.safetensors")  # for mlx_lm.generate --prompt-cache-file
    mlx_lm.generate(cart.model, cart.tokenizer, cart.question_prompt("..."),
                    prompt_cache=cart.prompt_cache())

The public names are imported on first use: `import cartridge` does not load mlx-lm and transformers
(about 4 s of a 5 s import on a 2-core Linux machine), so `cartridge inspect`/`verify`/`--help` start fast.
"""

import importlib
import os

from ._blas import OPENBLAS  # noqa: F401  (must run before mlx is imported)

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # silences "PyTorch was not found" on import
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "build": ".write.build", "BuildResult": ".write.build",
    "convert": ".write.convert", "ConvertResult": ".write.convert",
    "CartridgeError": ".errors",
    "open_cartridge": ".format.reader", "verify_cartridge": ".format.reader",
    "load": ".api", "load_many": ".compose.load", "load_sharded": ".distributed.load", "Cartridge": ".read.loaded",
    "extend": ".grow.extend", "ExtendResult": ".grow.extend",
    "load_model": ".models.loader",
    "import_prompt_cache": ".promptcache.importer", "ImportResult": ".promptcache.importer",
    "export_prompt_cache": ".promptcache.exporter", "ExportResult": ".promptcache.exporter",
}
__all__ = ["build", "convert", "load", "load_many", "load_sharded", "load_model", "open_cartridge", "verify_cartridge",
           "Cartridge", "BuildResult", "ConvertResult", "CartridgeError", "extend", "ExtendResult", "import_prompt_cache",
           "ImportResult", "export_prompt_cache", "ExportResult"]


def __getattr__(name):
    """Import public name `name` from its module on first use (PEP 562)."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'cartridge' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))

