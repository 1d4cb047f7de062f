"""Subprocess of tests/test_concurrency.py: load a cartridge (with the model it records) and print the
greedy answer's token ids as JSON on stdout.

    python tests/answer_worker.py CART QUESTION MAX_TOKENS
"""

import json
import sys
import time

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx_lm


path, question, max_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
started = time.time()
cart = cartridge.load(path)
tokens = [r.token for r in mlx_lm.stream_generate(cart.model, cart.tokenizer, cart.question_prompt(question),
                                                   max_tokens=max_tokens, prompt_cache=cart.prompt_cache())]
print(json.dumps({"tokens": tokens, "prefix": len(cart.tokens), "started": started, "answered": time.time()}))
