"""Sharded cartridges (issue 22): per-rank bytes read, load time and decode tokens/s, N ranks against 1.

    # a random-weight qwen2 model dir and a cartridge of about TOKENS tokens (one process)
    python benchmarks/distributed.py setup OUT --tokens 4096 [--layers 8 --hidden 512 --heads 8 --kv-heads 4]
    # the one-process baseline, then N ranks (CPU: ring on 127.0.0.1; two GPUs: --backend nccl)
    python benchmarks/distributed.py run OUT single
    mlx.launch --hosts 127.0.0.1 -n 2 --backend ring python benchmarks/distributed.py run OUT tensor
    mlx.launch --hosts 127.0.0.1 -n 2 --backend ring python benchmarks/distributed.py run OUT pipeline

Each rank writes OUT/run-MODE-nSIZE-rankR.json; rank 0 prints one line. "load" is `cartridge.load` with
the (already sharded) model: header, fingerprint, the rank's bytes read and checked, the agreement
collective, and the attention policy's preparation. Model loading is timed apart ("model_s").
"""

import argparse
import json
import time
from pathlib import Path

import cartridge  # noqa: F401  (before mlx: the BLAS the CLI uses)
import mlx.core as mx
from mlx.utils import tree_flatten

QUESTION = "What does the document say about copying?"


def setup(args):
    from mlx_lm.models import qwen2

    from cartridge.models.gguf import tokenizer_from_metadata
    from cartridge.models.loader import default_gguf_path

    out = Path(args.out)
    model_dir = out / "model"
    model_dir.mkdir(parents=True)
    cfg = {"model_type": "qwen2", "hidden_size": args.hidden, "num_hidden_layers": args.layers,
           "intermediate_size": 2 * args.hidden, "num_attention_heads": args.heads,
           "num_key_value_heads": args.kv_heads, "rms_norm_eps": 1e-5, "vocab_size": 49152, "rope_theta": 10000.0,
           "max_position_embeddings": 4 * args.tokens + 1024, "tie_word_embeddings": False}
    mx.random.seed(0)
    model = qwen2.Model(qwen2.ModelArgs.from_dict(cfg))
    model.set_dtype(mx.float16 if args.fp16 else mx.float32)
    mx.eval(model.parameters())
    (model_dir / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(model_dir / "model.safetensors"), dict(tree_flatten(model.parameters())))
    _, meta = mx.load(str(default_gguf_path()), return_metadata=True)
    tok = tokenizer_from_metadata(meta)
    tok._tokenizer.save_pretrained(str(model_dir))
    sample = (Path(cartridge.__file__).parent / "samples" / "lgpl-3.0.txt").read_text()
    text = sample
    while len(tok.encode(text)) < args.tokens:
        text += "\n\n" + sample
    ids = tok.encode(text)[: args.tokens]
    r = cartridge.build(tok.decode(ids), out / "doc.cart", model=str(model_dir), page_size=256)
    print(f"built {r.path}: {r.tokens} tokens, {r.bytes:,} bytes, {r.seconds:.1f} s")


def run(args):
    import mlx_lm

    from cartridge.distributed import load_sharded_model

    out = Path(args.out)
    group = mx.distributed.init()
    t0 = time.perf_counter()
    if args.mode == "single":
        lm = cartridge.load_model(str(out / "model"))
    else:
        lm = load_sharded_model(str(out / "model"), group, args.mode)
    model_s = time.perf_counter() - t0
    cart = cartridge.load(out / "doc.cart", model=lm, group=None if args.mode == "single" else group)
    pages = sum(e.shape[0] * e.page_bytes for ex in cart.info.extents.values() for e in ex)
    last = None
    for last in mlx_lm.stream_generate(cart.model, cart.tokenizer, cart.question_prompt(QUESTION),
                                       max_tokens=args.decode, prompt_cache=cart.prompt_cache()):
        pass
    row = {"mode": args.mode, "ranks": group.size(), "rank": group.rank(), "tokens": len(cart.tokens),
           "pages_bytes": pages, "bytes_read": getattr(cart, "bytes_read", pages),
           "bytes_held": getattr(cart, "bytes_held", pages), "load_s": cart.load_seconds, "model_s": model_s,
           "decode_tokens_per_s": last.generation_tps, "prompt_tokens_per_s": last.prompt_tps,
           "attention": cart.attention, "device": str(mx.default_device())}
    name = f"run-{args.mode}-n{group.size()}-rank{group.rank()}.json"
    (out / name).write_text(json.dumps(row, indent=1))
    if group.rank() == 0:
        print(f"{args.mode} n={group.size()}: rank 0 read {row['bytes_read']:,} of {pages:,} page bytes "
              f"({row['bytes_read'] / pages:.2f}), load {row['load_s']:.3f} s, decode "
              f"{row['decode_tokens_per_s']:.1f} tokens/s ({row['attention']}, {row['device']})")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="verb", required=True)
    s = sub.add_parser("setup")
    s.add_argument("out")
    s.add_argument("--tokens", type=int, default=4096)
    s.add_argument("--layers", type=int, default=8)
    s.add_argument("--hidden", type=int, default=512)
    s.add_argument("--heads", type=int, default=8)
    s.add_argument("--kv-heads", type=int, default=4)
    s.add_argument("--fp16", action="store_true", help="fp16 weights (GPU runs); float32 otherwise")
    r = sub.add_parser("run")
    r.add_argument("out")
    r.add_argument("mode", choices=("single", "tensor", "pipeline"))
    r.add_argument("--decode", type=int, default=32, help="tokens to generate")
    args = p.parse_args()
    (setup if args.verb == "setup" else run)(args)


if __name__ == "__main__":
    main()
