"""`cartridge bench`: decode-step attention and end-to-end decode speed per context length, tier and
attention policy, with MLX dense fp16 attention and mlx-lm's QuantizedKVCache path as baselines in
the same run. K/V are synthetic (random) of a real model's shape; speed does not depend on values.
"""

import statistics
import time
from dataclasses import replace

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ..attention import backends
from ..attention.caches import CartridgeCache
from ..attention.pages import make_prefix
from ..attention.policy import backend_for, dequantize
from ..attention.route import install
from ..attention.timing import timeit
from ..tiers import TIERS
from .bench_report import environment, gate, speedups

SHAPES = {  # name -> (n_q_heads, n_kv_heads, head_dim)
    "llama3-8b": (32, 8, 128),
    "llama3.2-1b": (32, 8, 64),
    "smollm2-135m": (9, 3, 64),
}
PAGE_SIZE = 256


def copy_bandwidth(nbytes=1 << 30):
    """Bytes/s of an MLX device copy (read + write) of `nbytes` float16 bytes."""
    x = mx.random.normal((nbytes // 2,)).astype(mx.float16)
    mx.eval(x)
    t = timeit(lambda: x + 0, repeats=10)
    del x
    return 2 * nbytes / t


def random_kv(n_kv, n, head_dim, seed):
    """Seeded standard-normal K and V, each float16 (n_kv, n, head_dim): the inputs `cartridge bench` times.

    Returns:
        tuple[mx.array, mx.array]: (K, V).
    """
    key = mx.random.key(seed)
    k1, k2 = mx.random.split(key)
    return (mx.random.normal((n_kv, n, head_dim), key=k1).astype(mx.float16),
            mx.random.normal((n_kv, n, head_dim), key=k2).astype(mx.float16))


POLICIES = None  # restrict the policies measured (None: every policy this backend has)


def available_policies():
    """The attention policies this device can time (a fused kernel only where it has one), limited to
    `POLICIES` when that is set; list[str]."""
    found = backends.policies(backends.kernel(backends.device()) is not None)
    return [p for p in found if POLICIES is None or p in POLICIES]


def layer_cache(prefix, policy, dtype, head_dim):
    """A CartridgeCache of one layer's `prefix` read under `policy` (None: "fused" has no kernel for it)."""
    p = dequantize(prefix, dtype) if policy == "dequantize-once" else prefix
    record = backend_for(policy, p, head_dim)
    if policy == "fused" and record is None:
        return None
    return CartridgeCache(replace(p, backend=record))


def attention_step(shape, n_tokens, tiers, dtype=None, repeats=20):
    """Decode-step attention (one layer, one query token) in microseconds, per tier and policy.

    Queries, the tail and the dense baseline use `dtype` (default float16 on a GPU, float32 on CPU,
    where MLX's float16 matmul is slow and models run in float32).

    Returns:
        list[dict]: rows {"kind", "tier", "policy", "context", "us", "prefix_bytes", "error"}.
    """
    n_q, n_kv, D = shape
    dtype = dtype or (mx.float32 if backends.device() == "cpu" else mx.float16)
    k, v = random_kv(n_kv, n_tokens, D, seed=n_tokens)
    q = mx.random.normal((1, n_q, 1, D)).astype(dtype)
    new_k = mx.random.normal((1, n_kv, 1, D)).astype(dtype)
    rows = []
    dense_k, dense_v = k[None].astype(dtype), v[None].astype(dtype)  # (1, n_kv, N, D)
    mx.eval(q, new_k, dense_k, dense_v)
    us = timeit(lambda x: mx.fast.scaled_dot_product_attention(x, dense_k, dense_v, scale=D ** -0.5), repeats,
                chain=q) * 1e6
    rows.append({"kind": "baseline", "tier": f"dense {str(dtype)[9:]}", "policy": "mlx-sdpa", "context": n_tokens, "us": us,
                 "prefix_bytes": dense_k.nbytes * 2, "error": None})
    rows.append(_mlx_lm_quantized(q, dense_k, dense_v, n_tokens, repeats))
    for tier in tiers:
        prefix, error = tier_prefix(tier, k, v)
        if prefix is None:
            rows.append({"kind": "cartridge", "tier": tier, "policy": None, "context": n_tokens, "us": None,
                         "prefix_bytes": None, "error": error})
            continue
        rows.append(read_floor(prefix, tier, n_tokens, repeats))
        for policy in available_policies():
            us, held, error = time_policy(prefix, policy, dtype, q, new_k, repeats)
            rows.append({"kind": "cartridge", "tier": tier, "policy": policy, "context": n_tokens,
                         "prefix_bytes": held, "us": us, "error": error})
        del prefix
    return rows


def tier_prefix(tier, k, v):
    """One layer's K/V encoded in `tier` as a LayerPrefix, in pages of `PAGE_SIZE` tokens.

    Args:
        tier (str): a tier name (`cartridge.tiers.TIERS`). k, v (mx.array): (n_kv_heads, N, head_dim).

    Returns:
        tuple: (LayerPrefix, None), or (None, why: str) for a tier that cannot store this shape.
    """
    codec = TIERS[tier]
    try:
        codec.check(k.shape[0], k.shape[-1])
        return make_prefix(codec, k, codec, v, PAGE_SIZE), None
    except Exception as e:
        return None, str(e)


def time_policy(prefix, policy, dtype, q, new_k, repeats, mask=None):
    """One layer's attention under `policy` with `new_k` as its tail, steps chained from `q` (µs).

    Returns:
        tuple: (µs or None, bytes the layer holds: for dequantize-once its dense pages, error or None).
    """
    D, held = q.shape[-1], prefix.nbytes
    try:
        cache = layer_cache(prefix, policy, dtype, D)
        if cache is None:
            return None, held, "no fused kernel for this tier"
        held = cache.prefix.nbytes
        cache.update_and_fetch(new_k, new_k)
        mx.eval(cache.state)
        return timeit(lambda x: cache.attention(x, D ** -0.5, mask), repeats, chain=q) * 1e6, held, None
    except Exception as e:  # recorded, e.g. an out-of-memory or an unsupported shape
        return None, held, f"{type(e).__name__}: {e}"


def multi_token_step(shape, n_tokens, tiers, query_tokens, dtype=None, repeats=5):
    """A question's prefill over the prefix (one layer, `query_tokens` new tokens, causal among themselves),
    in microseconds, per tier and policy, beside MLX's dense attention over the same prefix + question.

    Returns:
        list[dict]: rows {"kind" ("baseline" | "cartridge"), "tier", "policy", "context", "query_tokens",
        "query_rows" (GQA group x query tokens), "us", "error"}.
    """
    n_q, n_kv, D = shape
    L, dtype = query_tokens, dtype or (mx.float32 if backends.device() == "cpu" else mx.float16)
    k, v = random_kv(n_kv, n_tokens, D, seed=n_tokens)
    q = mx.random.normal((1, n_q, L, D)).astype(dtype)
    new_k = mx.random.normal((1, n_kv, L, D)).astype(dtype)
    dk = mx.concatenate([k[None].astype(dtype), new_k], axis=2)
    dv = mx.concatenate([v[None].astype(dtype), new_k], axis=2)
    mx.eval(q, new_k, dk, dv)
    base = {"context": n_tokens, "query_tokens": L, "query_rows": n_q // n_kv * L, "error": None}
    us = timeit(lambda x: mx.fast.scaled_dot_product_attention(x, dk, dv, scale=D ** -0.5, mask="causal"),
                repeats, chain=q) * 1e6
    rows = [{"kind": "baseline", "tier": f"dense {str(dtype)[9:]}", "policy": "mlx-sdpa", "us": us, **base}]
    del dk, dv
    for tier in tiers:
        prefix, error = tier_prefix(tier, k, v)
        if prefix is None:
            rows.append({"kind": "cartridge", "tier": tier, "policy": None, "us": None, **base, "error": error})
            continue
        for policy in available_policies():
            us, _, error = time_policy(prefix, policy, dtype, q, new_k, repeats, "causal")
            rows.append({"kind": "cartridge", "tier": tier, "policy": policy, "us": us, **base, "error": error})
            mx.clear_cache()
        del prefix
    return rows


def read_floor(prefix, tier, n_tokens, repeats=20):
    """The time of a bare streaming read of a prefix's stored bytes: one plain reduction (`mx.sum`) over
    each stored array viewed as 32-bit words, all in one evaluation. A policy cannot read its pages
    faster than this in the same run (on a GPU `benchmarks/gpu_floor.py` measures a tighter floor).

    Returns:
        dict: a row {"kind": "floor", "tier", "policy": "read", "context", "us", "prefix_bytes", "error"}.
    """
    arrays = [a.reshape(-1) for a in (*prefix.k_parts.values(), *prefix.v_parts.values())]
    arrays = [a.view(mx.uint32) if a.nbytes % 4 == 0 else a.view(mx.uint8) for a in arrays]
    us = timeit(lambda: [a.sum() for a in arrays], repeats) * 1e6
    return {"kind": "floor", "tier": tier, "policy": "read", "context": n_tokens, "us": us,
            "prefix_bytes": prefix.nbytes, "error": None}


def _mlx_lm_quantized(q, dense_k, dense_v, n_tokens, repeats):

    row = {"kind": "baseline", "tier": "mlx-lm q4g32", "policy": "mlx-lm-quantized", "context": n_tokens,
           "us": None, "prefix_bytes": None, "error": None}
    try:
        qk = mx.quantize(dense_k, group_size=32, bits=4)
        qv = mx.quantize(dense_v, group_size=32, bits=4)
        mx.eval(qk, qv)
        row["prefix_bytes"] = sum(a.nbytes for a in (*qk, *qv))
        D = q.shape[-1]
        row["us"] = timeit(lambda x: quantized_scaled_dot_product_attention(
            x, qk, qv, scale=D ** -0.5, mask=None, group_size=32, bits=4), repeats,
            inner=10 if backends.device() != "cpu" else None, chain=q) * 1e6  # on a GPU its steps are slow: chains of 10 and 50
    except Exception as e:  # e.g. "No implementation for problem shape" on CUDA with head_dim 64
        row["error"] = f"{type(e).__name__}: {e}"
    return row


def random_model(shape_name, dtype=mx.float16, seed=0):
    """A random-weight mlx-lm llama of a real model's shape (weights do not change decode speed):
    "llama3.2-1b" (head_dim 64) or "llama3-8b" (head_dim 128)."""

    configs = {
        "llama3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
                            rope_theta=500000.0, tie_word_embeddings=True),
        "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                          rope_theta=500000.0, tie_word_embeddings=False),
    }
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict({"model_type": "llama", "rms_norm_eps": 1e-5,
                                                   "max_position_embeddings": 1 << 20, **configs[shape_name]}))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def decode_tokens_per_s(model, caches, n_tokens=32, rounds=None):
    """Greedy decode speed (tokens/s) after a 1-token prompt, through mlx-lm's generate_step: the median time
    between tokens of each round; on a GPU 4 rounds (default) and the median of all but the first, on CPU one round
    (it takes seconds). Each round starts from the same caches: their tails are trimmed back to where they were
    (n_tokens + 1 tokens a round, so every round runs with the same short tail). Not the best round: on an H100 the
    first round of an mlx-lm KVCache at 32K tokens read 186.9 tokens/s, faster than the bytes of a step allow at
    the card's bandwidth, and every later round ~104 (docs/performance.md, 2026-12-06)."""

    prompt = mx.array([1], dtype=mx.uint32)
    start, rates = [c.offset for c in caches], []
    for _ in range(rounds or (1 if backends.device() == "cpu" else 4)):
        for c, n in zip(caches, start):
            c.trim(c.offset - n)
        times = []
        t = time.perf_counter()
        for i, _ in enumerate(generate_step(prompt, model, prompt_cache=caches, max_tokens=n_tokens)):
            now = time.perf_counter()
            if i:
                times.append(now - t)
            t = now
        rates.append(1.0 / statistics.median(times))
    return statistics.median(rates[1:] if len(rates) > 1 else rates)


def model_geometry(model):
    """(n_layers, n_kv_heads, head_dim) of an mlx-lm model, read from its first attention layer."""
    attn = model.layers[0].self_attn
    return len(model.layers), attn.n_kv_heads, attn.head_dim


def dense_caches(model, n_tokens, dtype):
    """One mlx-lm KVCache per layer of `model` holding `n_tokens` seeded random K/V (`random_kv`) in `dtype`.

    Returns:
        tuple: (caches, their bytes).
    """

    n_layers, n_kv, D = model_geometry(model)
    caches = []
    for i in range(n_layers):
        c = KVCache()
        k, v = random_kv(n_kv, n_tokens, D, seed=i)
        c.keys, c.values, c.offset = k[None].astype(dtype), v[None].astype(dtype), n_tokens
        caches.append(c)
    mx.eval([c.state for c in caches])
    return caches, sum(c.nbytes for c in caches)


def cartridge_caches(model, n_tokens, tier, policy, dtype):
    """One CartridgeCache per layer of `model` over the same K/V as `dense_caches`, stored in `tier` and read under
    `policy` (mlx-lm's attention routed to them: `route.install`).

    Returns:
        tuple: (caches, the prefixes' bytes).

    Raises:
        RuntimeError: "fused" without a fused kernel for this tier here.
    """

    install()
    n_layers, n_kv, D = model_geometry(model)
    caches = []
    for i in range(n_layers):
        k, v = random_kv(n_kv, n_tokens, D, seed=i)
        prefix = make_prefix(TIERS[tier], k, TIERS[tier], v, PAGE_SIZE, layer=i)
        cache = layer_cache(prefix, policy, dtype, D)
        if cache is None:
            raise RuntimeError("no fused kernel for this tier")
        caches.append(cache)
    mx.eval([[list(c.prefix.k_parts.values()), list(c.prefix.v_parts.values())] for c in caches])
    return caches, sum(c.prefix.nbytes for c in caches)


def end_to_end(model, n_tokens, tiers, dtype, n_decode=32):
    """Decode tokens/s and peak memory with a dense fp16 KVCache, mlx-lm's QuantizedKVCache, and cartridge
    caches of every tier and policy, all with a prefix of `n_tokens` synthetic tokens."""

    n_layers, n_kv, D = model_geometry(model)
    rows = []

    def run(label, tier, policy, make):
        row = {"kind": label, "tier": tier, "policy": policy, "context": n_tokens, "tokens_per_s": None,
               "peak_bytes": None, "prefix_bytes": None, "error": None}
        try:
            mx.clear_cache()
            caches, nbytes = make()
            mx.clear_cache()
            mx.reset_peak_memory()  # decode-time peak: the resident prefix plus what decoding allocates
            row["prefix_bytes"] = nbytes
            row["tokens_per_s"] = decode_tokens_per_s(model, caches, n_decode)
            row["peak_bytes"] = mx.get_peak_memory()
            del caches
        except Exception as e:  # recorded: unsupported shape, out of memory
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)

    def quantized():
        caches = []
        for i in range(n_layers):
            c = QuantizedKVCache(group_size=32, bits=4)
            k, v = random_kv(n_kv, n_tokens, D, seed=i)
            c.keys = mx.quantize(k[None].astype(dtype), group_size=32, bits=4)
            c.values = mx.quantize(v[None].astype(dtype), group_size=32, bits=4)
            c.offset = n_tokens
            caches.append(c)
        mx.eval([c.state for c in caches])
        return caches, sum(c.nbytes for c in caches)

    run("baseline", f"dense {str(dtype)[9:]}", "mlx-kvcache", lambda: dense_caches(model, n_tokens, dtype))
    run("baseline", "mlx-lm q4g32", "mlx-lm-quantized", quantized)
    for tier in tiers:
        for policy in available_policies():
            run("cartridge", tier, policy, lambda: cartridge_caches(model, n_tokens, tier, policy, dtype))
    return rows


def run(contexts, tiers, shape="llama3-8b", e2e_model=None, e2e_contexts=None, repeats=20, progress=None,
        e2e_tiers=None, query_tokens=()):
    """Everything `cartridge bench` measures, in one run.

    Args:
        contexts (list[int]): prefix lengths in tokens for the attention microbenchmark.
        tiers (list[str]): tiers to measure.
        shape (str): a key of SHAPES for the microbenchmark.
        e2e_model (tuple | None): (model, dtype) for end-to-end decode, or None to skip it.
        e2e_contexts (list[int] | None): prefix lengths for end-to-end decode (default: `contexts`).
        e2e_tiers (list[str] | None): tiers for end-to-end decode (default: `tiers`).
        progress (callable | None): called with a short description before each step.
        query_tokens (tuple[int]): question lengths for `multi_token_step` at every context (TTFT's attention).

    Returns:
        dict: {"environment", "shape", "copy_bytes_per_s", "attention": [...], "multi_token": [...],
        "speedups": [...], "end_to_end": [...]}.
    """
    say = progress or (lambda *_: None)
    say("copy bandwidth")
    result = {"environment": environment(), "shape": {"name": shape, "n_q_heads": SHAPES[shape][0],
              "n_kv_heads": SHAPES[shape][1], "head_dim": SHAPES[shape][2]},
              "copy_bytes_per_s": copy_bandwidth(1 << 30 if backends.device() == "cuda" else 1 << 27),
              "attention": [], "multi_token": [], "end_to_end": []}
    for n in contexts:
        say(f"attention at {n} tokens")
        result["attention"] += attention_step(SHAPES[shape], n, tiers, repeats=repeats)
        mx.clear_cache()
        for L in query_tokens:
            say(f"question of {L} tokens over {n} tokens")
            result["multi_token"] += multi_token_step(SHAPES[shape], n, tiers, L, repeats=max(3, repeats // 4))
            mx.clear_cache()
    result["speedups"] = speedups(result["attention"])
    result["gate"] = gate(result)
    if e2e_model is not None:
        model, dtype = e2e_model
        for n in e2e_contexts or contexts:
            say(f"end-to-end decode at {n} tokens")
            result["end_to_end"] += end_to_end(model, n, e2e_tiers or tiers, dtype)
    return result
