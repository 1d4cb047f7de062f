"""The gate for kernels not yet run on this machine (`AttentionBackend.needs_proof`; issue 30 item 4).

On the first use of a (backend, K tier, V tier, head_dim) under `auto`, `proven` runs the backend's kernel on
a small random case (two pages and an odd remainder, a 3-token tail, 4 query heads per KV head, float16
queries) against the portable path and accepts it if the relative error max|kernel - portable| /
max|portable| is below `TOL` (tests/attention/test_kernels.py's float16 bound). It then times one decode step over the
layer's own pages: kernel, portable path, and MLX's dense SDPA over random float16 K/V of the same shape.
The record is kept in the user auto table (`auto_table.add_proof`), with its times as decode entries
so `auto` chooses between kernel and portable path by measurement; a failure (build error, error or NaN in
the output, no output) gives the portable path and, the first time a backend fails in a process, one
`KernelProofWarning` line. Dense pages made at load are checked as their own pair ("dequantized").
"""

import warnings

import mlx.core as mx

from ...tiers import get_tier
from .. import auto_table
from ..caches import CartridgeCache
from ..pages import make_prefix
from ..prefix import LayerPrefix
from ..timing import timeit

TOL = 2e-3  # relative error, float16 queries (tests/attention/test_kernels.py TOL_FP16)
GROUP = 4  # query heads per KV head in the proof's case and timing (the layer's own is not known at load)
TAIL = 3
_warned = set()  # (backend, tiers, head_dim) told that "fused" runs them unchecked
_failed = set()  # backends whose failed check was reported (one warning per backend and process)


class KernelProofWarning(UserWarning):
    """A kernel that needs proof failed its check here, or `attention="fused"` runs one never checked."""


def tiers_of(prefix):
    """(K tier name, V tier name) of a layer."""
    return prefix.k_codec.name, prefix.v_codec.name


def _case(prefix, head_dim, seed=0):
    """A small LayerPrefix in the layer's tiers and page size: 2 pages and 37 tokens of random K/V."""
    page = next(iter(prefix.k_parts.values())).shape[2]
    n_kv, n = prefix.n_kv_heads, 2 * page + 37
    k1, k2 = mx.random.split(mx.random.key(seed))
    k = mx.random.normal((n_kv, n, head_dim), key=k1).astype(mx.float16)
    v = mx.random.normal((n_kv, n, head_dim), key=k2).astype(mx.float16)
    return make_prefix(prefix.k_codec, k, prefix.v_codec, v, page)


def _cache(prefix, record, tail):
    """A cache over `prefix` read by the backend `record` (None: the portable path), holding `tail` as K and V."""
    cache = CartridgeCache(LayerPrefix(prefix.k_codec, prefix.k_parts, prefix.v_codec, prefix.v_parts,
                                       prefix.n_tokens, prefix.k_params, prefix.v_params, record, prefix.protected))
    cache.update_and_fetch(tail, tail)
    return cache


def _match(backend, prefix, head_dim):
    """(relative error, None) of the kernel against the portable path on a small case, or (None, why not)."""
    try:
        small = _case(prefix, head_dim)
    except Exception as e:  # a tier that cannot encode a random case here (none of the shipped ones)
        return None, f"no check case in these tiers ({type(e).__name__}: {e})"
    n_kv = small.n_kv_heads
    q = mx.random.normal((1, n_kv * GROUP, 1, head_dim), key=mx.random.key(1)).astype(mx.float16)
    tail = mx.random.normal((1, n_kv, TAIL, head_dim), key=mx.random.key(2)).astype(mx.float16)
    try:
        got = _cache(small, backend.build(small), tail).attention(q, head_dim ** -0.5)
        if got is None or got.shape != q.shape:
            return None, "no output for the check's decode step"
        got = got.astype(mx.float32)
        mx.eval(got)
    except Exception as e:  # a compile or launch failure is the kernel's, reported as one line
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    want = _cache(small, None, tail).attention(q, head_dim ** -0.5).astype(mx.float32)
    err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
    if not err < TOL:  # NaN fails too
        return err, f"relative error {err:.2e} against the portable path (bound {TOL:g})"
    return err, None


def _times(backend, prefix, head_dim, repeats=5):
    """µs of one decode step over the layer's pages: {"fused", "portable"} and MLX dense SDPA."""
    n_kv = prefix.n_kv_heads
    q = mx.random.normal((1, n_kv * GROUP, 1, head_dim)).astype(mx.float16)
    tail = mx.random.normal((1, n_kv, 1, head_dim)).astype(mx.float16)
    scale = head_dim ** -0.5
    us = {}
    for policy, record in (("fused", backend.build(prefix)), ("portable", None)):
        cache = _cache(prefix, record, tail)
        us[policy] = timeit(lambda x, c=cache: c.attention(x, scale), repeats, chain=q) * 1e6
    dk = mx.random.normal((1, n_kv, prefix.n_tokens + 1, head_dim)).astype(mx.float16)
    mx.eval(dk)
    dense = timeit(lambda x: mx.fast.scaled_dot_product_attention(x, dk, dk, scale=scale), repeats, chain=q) * 1e6
    return us, dense


def check(backend, prefix, head_dim):
    """Run the proof of `backend` for a layer.

    Args:
        backend (AttentionBackend): a kernel entry. prefix (LayerPrefix): the layer's stored pages.
        head_dim (int): the layer's head_dim (K and V).

    Returns:
        dict: the record {"backend", "tiers" [K, V], "head_dim", "ok", "error" (str | None), "rel_err",
        "context" (the layer's tokens), "us" ({"fused", "portable"} or None), "dense_us"}.
    """
    err, why = _match(backend, prefix, head_dim)
    rec = {"backend": backend.name, "tiers": list(tiers_of(prefix)), "head_dim": head_dim, "ok": why is None,
           "error": why, "rel_err": err, "context": prefix.n_tokens, "us": None, "dense_us": None}
    if why is None:
        try:
            rec["us"], rec["dense_us"] = _times(backend, prefix, head_dim)
        except Exception as e:  # timed after matching: a failure here is still a failure to run
            rec.update(ok=False, error=f"{type(e).__name__} while timing: {e}")
    return rec


def check_tiers(backend, tiers, n_kv_heads, head_dim, n_tokens, path=None, page_size=256):
    """`check` each tier (K and V the same) on random K/V of one shape, keeping each record (`cartridge bench
    --calibrate` on a device whose kernel needs proof). Tiers the kernel does not read, or that cannot store
    the shape, are left out.

    Returns:
        list[dict]: the records, as `check` returns them.
    """
    k1, k2 = mx.random.split(mx.random.key(n_tokens))
    k = mx.random.normal((n_kv_heads, n_tokens, head_dim), key=k1).astype(mx.float16)
    v = mx.random.normal((n_kv_heads, n_tokens, head_dim), key=k2).astype(mx.float16)
    out = []
    for name in tiers:
        codec = get_tier(name)
        try:
            codec.check(n_kv_heads, head_dim)
        except Exception:  # the tier cannot store this shape: nothing to check
            continue
        prefix = make_prefix(codec, k, codec, v, page_size)
        if backend.supports(prefix, head_dim, "decode"):
            out.append(check(backend, prefix, head_dim))
            auto_table.add_proof(out[-1], path)
        del prefix
    return out


def lines(records):
    """The `cartridge bench --calibrate` report of kernel checks: one line per record."""
    if not records:
        return []
    out = ["\nkernel checks (a kernel that needs proof, against the portable path; auto takes it only where ok): "
           "relative error, one decode step's µs",
           f"{'backend':<8} {'tier':<12} {'head_dim':>8} {'context':>8} {'ok':<4} {'rel err':>9} {'kernel':>10} "
           f"{'portable':>10} {'dense':>10}"]
    for r in records:
        us = r["us"] or {}

        def num(x, fmt):
            return format(x, fmt) if x is not None else "-"
        out.append(f"{r['backend']:<8} {'/'.join(dict.fromkeys(r['tiers'])):<12} {r['head_dim']:>8} {r['context']:>8} "
                   f"{'yes' if r['ok'] else 'NO':<4} {num(r['rel_err'], '.1e'):>9} {num(us.get('fused'), '.1f'):>10} "
                   f"{num(us.get('portable'), '.1f'):>10} {num(r['dense_us'], '.1f'):>10}"
                   + ("" if r["ok"] else f"  ({r['error']})"))
    return out


def _label(backend, tiers, head_dim):
    return f"{backend.name} attention kernel for {'/'.join(dict.fromkeys(tiers))} at head_dim {head_dim}"


def proven(backend, prefix, head_dim, path=None):
    """True if `backend` may serve this layer under `auto`: it needs no proof, or its record (stored, or made
    now by `check` and stored) says it matched. A failed check warns once (`KernelProofWarning`)."""
    if not backend.needs_proof:
        return True
    tiers = tiers_of(prefix)
    rec = auto_table.find_proof(backend.name, tiers, head_dim, path)
    if rec is None:
        rec = check(backend, prefix, head_dim)
        auto_table.add_proof(rec, path)
        if not rec["ok"] and backend.name not in _failed:
            _failed.add(backend.name)
            warnings.warn(f"{_label(backend, tiers, head_dim)} failed its check on this machine ({rec['error']}); "
                          "those layers take the portable path", KernelProofWarning, stacklevel=2)
    return bool(rec["ok"])


def proven_by_name(backend, tiers, head_dim, path=None):
    """`proven` from the stored record alone (a header's tier names: no pages to check); False without one."""
    if not backend.needs_proof:
        return True
    rec = auto_table.find_proof(backend.name, tuple(tiers), head_dim, path)
    return bool(rec and rec["ok"])


def warn_unchecked(backend, prefix, head_dim, path=None):
    """For `attention="fused"`: warn once per process if `backend` needs proof and was never checked here."""
    tiers = tiers_of(prefix)
    key = (backend.name, tiers, head_dim)
    if not backend.needs_proof or key in _warned or auto_table.find_proof(backend.name, tiers, head_dim, path):
        return
    _warned.add(key)
    warnings.warn(f"{_label(backend, tiers, head_dim)} was never checked on this machine (attention=\"fused\" runs "
                  "it anyway; `cartridge bench --calibrate` or attention=\"auto\" checks it)", KernelProofWarning,
                  stacklevel=2)


__all__ = ["KernelProofWarning", "TOL", "check", "check_tiers", "lines", "proven", "proven_by_name", "warn_unchecked"]
