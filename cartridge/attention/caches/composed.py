"""`ComposedCache` (kind "composed"): one layer's cache over several cartridges' stored prefixes laid out one
after another (`cartridge.compose`), each attended at its own position shift.

Stored keys carry their rotary positions (spec/FORMAT.md 5.1). Instead of rewriting them, a later document's
part is attended with the query rotated back by its shift Δ (RoPE is a rotation: q·R(Δ)k = R(−Δ)q·k), one part
per document (`Part`), merged by log-sum-exp with the recomputed tokens (patches at their true positions) and
the dense tail. `part_mass` is the attention mass its rows put on each stored token of a part (CacheBlend's
probe, `cartridge.compose.blend.probe_mass`).
"""

from dataclasses import dataclass

import mlx.core as mx

from ...errors import CartridgeError
from ..kernels import merge, tail_partial
from .cartridge import CartridgeCache, per_query_head, sink_partial


@dataclass(frozen=True)
class Part:
    """A stored prefix attended in a composed context.

    Attributes:
        prefix (LayerPrefix): one layer's stored pages. shift (int): Δ, true position - stored position.
        start (int): first stored token attended (those before it are skipped or recomputed).
        skip (mx.array | None): bool (n_pages * page_size,), True at stored tokens recomputed as a patch.
    """

    prefix: object
    shift: int
    start: int
    skip: object = None


def part_partial(q, part, before=None):
    """Attention partial over stored tokens [start, n_tokens) of one part, less `part.skip`
    (`kernels.portable.prefix_partial`).

    Args:
        q (mx.array): (n_kv_heads, R, head_dim) float32, pre-scaled, rotated back by the part's shift.
        part (Part): the stored part. before (mx.array | None): (R,) composed position of each query row;
            given, a row sees only stored tokens at composed positions before it (causal). Default: None.
    """
    p = part.prefix
    s = p.k_codec.scores(q, p.k_parts, p.k_params)  # (n_pages, n_kv, R, P)
    n_pages, _, R, page = s.shape
    pos = mx.arange(n_pages * page)
    keep = (pos >= part.start) & (pos < p.n_tokens)
    if part.skip is not None:
        keep = keep & ~part.skip
    keep = keep.reshape(n_pages, 1, 1, page)
    if before is not None:  # (R, n_pages * page) -> (n_pages, 1, R, page)
        causal = (pos[None, :] + part.shift) < before[:, None]
        keep = keep & causal.reshape(R, n_pages, page).transpose(1, 0, 2)[:, None]
    s = mx.where(keep, s, -mx.inf)
    m = s.max(axis=(0, 3))  # (n_kv, R); -inf for a row that sees no token of this part
    pr = mx.exp(s - mx.where(m == -mx.inf, 0.0, m)[None, :, :, None])
    return p.v_codec.weighted_values(pr, p.v_parts, p.v_params), m, pr.sum(axis=(0, 3))


def part_mass(q, part, partials):
    """Attention probability that query rows put on each of the part's stored tokens, summed over rows and heads.

    Args:
        q (mx.array): (n_kv_heads, R, head_dim) float32, pre-scaled, rotated back by the part's shift.
        part (Part): the stored part. partials (list[tuple]): every (o, m, l) partial of these rows
            over the whole context (the part's included): they give each row's softmax normalizer.

    Returns:
        mx.array: (n_tokens - part.start,) float32.
    """
    m = partials[0][1]
    for _, mi, _ in partials[1:]:
        m = mx.maximum(m, mi)
    lse = m + mx.log(sum(li * mx.exp(mi - m) for _, mi, li in partials))  # (n_kv, R)
    p = part.prefix
    s = p.k_codec.scores(q, p.k_parts, p.k_params)  # (n_pages, n_kv, R, P)
    mass = mx.exp(s - lse[None, :, :, None]).sum(axis=(1, 2)).reshape(-1)
    if part.skip is not None:
        mass = mx.where(part.skip, 0.0, mass)
    return mass[part.start:p.n_tokens]


class ComposedCache(CartridgeCache):
    """One layer's cache over several stored parts, recomputed dense K/V, and a dense tail.

    Args:
        parts (list[Part]): stored parts, each with its shift.
        patches (list[tuple]): recomputed (k, v), each (n_kv_heads, T, head_dim), at their true positions.
        length (int): tokens of the composed context before the tail.
        rope (callable): the layer's rotary embedding, called as rope(x, offset=...) (mlx-lm modules).
    """

    def __init__(self, parts, patches, length, rope, chunk_size=256):
        super().__init__(parts[0].prefix, chunk_size)
        self._tail_scale = None  # the tail holds the model's keys; each part's scale goes on its own queries
        self.parts, self.patches, self.length, self.rope = parts, patches, length, rope
        self.record = None  # a list: each attention call appends its rows' mass on the last part (`blend.probe_mass`)

    @property
    def offset(self):
        """Tokens held: composed context + tail (the position of the next token)."""
        return self.length + self.tail_len

    @property
    def meta_state(self):
        """(composed context tokens, tail tokens, chunk size) as strings."""
        return str(self.length), str(self.tail_len), str(self.chunk_size)

    @property
    def nbytes(self):
        """Bytes held: every part's stored pages, the patches and the allocated tail chunks."""
        k_chunks, v_chunks = self.tail_chunks
        held = [x for patch in self.patches for x in patch] + k_chunks + v_chunks
        return sum(p.prefix.nbytes for p in self.parts) + sum(x.nbytes for x in held)

    def _rotated(self, queries, shift):
        """Queries rotated by −shift, every row alike: (1, n_q, L, D) seen as (n_q * L, 1, D) positions."""
        if shift == 0:
            return queries
        _, n_q, L, D = queries.shape
        return self.rope(queries.reshape(n_q * L, 1, D), offset=-shift).reshape(1, n_q, L, D)

    @staticmethod
    def _scaled(queries, prefix):
        """Queries (1, n_q, L, D) times the part's K scale, each query head its KV head's (format 1.11), or as given."""
        return queries if prefix.key_scale is None else queries * per_query_head(prefix.key_scale, queries.shape[1])

    def attention(self, queries, scale, mask=None, sinks=None):
        """Attention of `queries` over every part, patch and the tail (see `CartridgeCache.attention`;
        `sinks`, (n_q_heads,) sink logits, add one more logit per head).

        Raises:
            CartridgeError: for an array mask (composed contexts take None or "causal").
        """
        if mask is not None and not isinstance(mask, str):
            raise CartridgeError("array masks are not supported over composed cartridges")
        _, n_q, L, D = queries.shape
        n_kv = self.prefix.n_kv_heads
        group = n_q // n_kv

        def flat(x):  # (1, n_q, L, D) -> (n_kv, group * L, D), pre-scaled float32
            return (x.astype(mx.float32) * scale).reshape(n_kv, group * L, D)

        q = flat(queries)
        rotated = [flat(self._scaled(self._rotated(queries.astype(mx.float32), p.shift), p.prefix))
                   for p in self.parts]
        partials = [part_partial(r, p) for r, p in zip(rotated, self.parts)]
        partials += [tail_partial(q, k, v, True) for k, v in self.patches]
        partials += self._tail_partials(q, None, n_kv, group, L)
        if sinks is not None:
            partials.append(sink_partial(sinks, n_kv, L, D))
        if self.record is not None:
            self.record.append(part_mass(rotated[-1], self.parts[-1], partials))
        # (n_kv, group * L, D) -> (1, n_q, L, D)
        return merge(partials).reshape(1, n_q, L, D).astype(queries.dtype)
