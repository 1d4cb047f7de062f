"""Subprocess of tests/system/test_concurrency.py: load a cartridge (with the model it records) and print the
greedy answer's token ids as JSON on stdout (the test also calls `answer` in its own process).

    python tests/helpers/answer_worker.py CART QUESTION MAX_TOKENS
"""

import json
import sys
import time

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx_lm


def answer(path, question, max_tokens):
    """{"tokens": greedy answer ids, "prefix": cartridge tokens, "started"/"answered": time.time() stamps}."""
    started = time.time()
    cart = cartridge.load(path)
    tokens = [r.token for r in mlx_lm.stream_generate(cart.model, cart.tokenizer, cart.question_prompt(question),
                                                       max_tokens=max_tokens, prompt_cache=cart.prompt_cache())]
    return {"tokens": tokens, "prefix": len(cart.tokens), "started": started, "answered": time.time()}


if __name__ == "__main__":
    print(json.dumps(answer(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
