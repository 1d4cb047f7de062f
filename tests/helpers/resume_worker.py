"""Subprocess of tests/write/test_conversation.py: load a conversation cartridge (with the model it records),
feed the given next-turn token ids and print the greedy continuation and its log-probabilities as JSON.

    python tests/helpers/resume_worker.py CART MAX_TOKENS ID [ID ...]
"""

import json
import sys

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx_lm


path, max_tokens, ids = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3:]]
cart = cartridge.load(path)
out = [(r.token, r.logprobs[r.token].item()) for r in
       mlx_lm.stream_generate(cart.model, cart.tokenizer, ids, max_tokens=max_tokens, prompt_cache=cart.prompt_cache())]
print(json.dumps({"tokens": [t for t, _ in out], "logprobs": [p for _, p in out], "prefix": len(cart.tokens)}))
