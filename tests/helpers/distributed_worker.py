"""Run by tests/distributed/test_distributed.py under `mlx.launch` (or alone, as the one-process reference).

    python tests/helpers/distributed_worker.py answer OUT_DIR CART MODEL_DIR MODE [--other-cart C] [--other-model M]
    python tests/helpers/distributed_worker.py build OUT_DIR DOC MODEL_DIR MODE CART

Each rank writes OUT_DIR/rank{r}.json: the answer's token ids (answer) and what it mapped, or the one-line
error it raised. --other-* give rank 1 a different cartridge or model (the refusal tests).
"""

import argparse
import json
import sys
from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx

from cartridge.distributed import build_sharded, load_sharded_model
from cartridge.errors import CartridgeError

QUESTION = "What does the document say about copying?"


def _answer(args, group):
    import mlx_lm

    rank = group.rank()
    cart_path = args.other_cart if rank == 1 and args.other_cart else args.cart
    model_dir = args.other_model if rank == 1 and args.other_model else args.model
    if args.mode == "single":
        cart = cartridge.load(cart_path, model=cartridge.load_model(model_dir))
        row = {"bytes_read": None}
    else:
        cart = cartridge.load(cart_path, model=load_sharded_model(model_dir, group, args.mode), group=group)
        row = {"bytes_read": cart.bytes_read, "bytes_held": cart.bytes_held, "slice": cart.part.describe(),
               "verified": cart.verified}
    prompt = cart.question_prompt(QUESTION)
    tokens = [r.token for r in mlx_lm.stream_generate(cart.model, cart.tokenizer, prompt, max_tokens=args.max_tokens,
                                                      prompt_cache=cart.prompt_cache())]
    return {**row, "tokens": tokens}


def _build(args, group):
    text = Path(args.doc).read_text()
    if args.mode == "single":
        r = cartridge.build(text, args.cart, model=args.model, page_size=8)
    else:
        r = build_sharded(text, args.cart, load_sharded_model(args.model, group, args.mode), group, page_size=8)
    return {"path": r.path if r else None}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("verb", choices=("answer", "build"))
    p.add_argument("out")
    p.add_argument("doc_or_cart")
    p.add_argument("model")
    p.add_argument("mode", choices=("single", "tensor", "pipeline"))
    p.add_argument("cart", nargs="?")
    p.add_argument("--other-cart")
    p.add_argument("--other-model")
    p.add_argument("--max-tokens", type=int, default=12)
    args = p.parse_args()
    if args.verb == "answer":
        args.cart = args.doc_or_cart
    else:
        args.doc = args.doc_or_cart
    group = mx.distributed.init()
    try:
        row = (_answer if args.verb == "answer" else _build)(args, group)
    except CartridgeError as e:
        row = {"error": f"{type(e).__name__}: {e}"}
    Path(args.out, f"rank{group.rank()}.json").write_text(json.dumps(row))
    return 1 if "error" in row else 0


if __name__ == "__main__":
    sys.exit(main())
