"""cartridge: persistent, memory-mappable KV caches for MLX language models.

    cartridge.build(text, "doc.cart")                 # prefill once, write pages
    cartridge.convert("doc.cart", "q4.cart", tier="mlx4g32")  # re-encode fp16 pages, no prefill
    cart = cartridge.load("doc.cart")                 # verify, map pages
    cartridge.extend("doc.cart", more_text)           # prefill only the new text
    mlx_lm.generate(cart.model, cart.tokenizer, cart.question_prompt("..."),
                    prompt_cache=cart.prompt_cache())
"""

import os

from ._blas import OPENBLAS  # noqa: F401  (must run before mlx is imported)

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # silences "PyTorch was not found" on import
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from .build import BuildResult, build  # noqa: E402
from .convert import ConvertResult, convert  # noqa: E402
from .errors import CartridgeError  # noqa: E402
from .format.reader import open_cartridge, verify_cartridge  # noqa: E402
from .load import Cartridge, load  # noqa: E402
from .extend import ExtendResult, extend  # noqa: E402
from .models.loader import load_model  # noqa: E402

__version__ = "0.1.0"
__all__ = ["build", "convert", "load", "load_model", "open_cartridge", "verify_cartridge", "Cartridge", "BuildResult",
           "ConvertResult", "CartridgeError", "extend", "ExtendResult"]
