"""`BlendCache` (kind "blend"): one layer's cache while CacheBlend recomputes selected tokens of the last
document of a composed context (`cartridge.compose.blend`)."""

import mlx.core as mx

from ..kernels import merge, tail_partial
from .base import NOT_SAVED, refuse_state, refuse_trim
from .cartridge import sink_partial
from .composed import ComposedCache, part_partial


class BlendCache(ComposedCache):
    """One layer's cache while selected tokens of the last part are recomputed (CacheBlend's fusion,
    `cartridge.compose.blend`).

    The model rotates each forward pass's L tokens at offset (selected tokens done) + 0..L-1; their queries
    and keys are rotated on to `positions`. A selected token attends over the earlier parts and the patches,
    the last part's stored tokens before it (less the selected ones, `Part.skip`), and the selected tokens'
    fresh K/V up to itself.

    Args:
        parts, patches, length, rope: as `ComposedCache`; parts[-1] is the document being recomputed.
        positions (mx.array): (S,) int32 composed positions of the selected tokens, ascending.
    """

    def __init__(self, parts, patches, length, rope, positions):
        super().__init__(parts, patches, length, rope)
        self.positions, self.done, self.fresh = positions, 0, ([], [])

    @property
    def offset(self):
        """Selected tokens done: the model's rotary offset, moved on to `positions` here."""
        return self.done

    @property
    def state(self):
        """([fresh k], [fresh v], NOT_SAVED): the selected tokens' K/V so far, for `mx.eval`, and the marker
        mlx-lm's `save_prompt_cache` stops at."""
        return (*self.fresh, NOT_SAVED)

    @state.setter
    def state(self, v):
        refuse_state("BlendCache", "a composed cartridge's recompute")

    @property
    def meta_state(self):
        """(composed context tokens, selected tokens done, selected tokens) as strings."""
        return str(self.length), str(self.done), str(self.positions.shape[0])

    def is_trimmable(self):
        """False: a recompute runs forward only."""
        return False

    def trim(self, n):
        """Refused (`is_trimmable` is False).

        Raises:
            CartridgeError: always.
        """
        refuse_trim("BlendCache", "a recompute of selected tokens runs forward only")

    @property
    def nbytes(self):
        """Bytes held: the parts' stored pages, the patches and the selected tokens' fresh K/V."""
        return super().nbytes + sum(x.nbytes for side in self.fresh for x in side)

    def _at_positions(self, x, start):
        """(1, n, L, D) rotated at start..start+L-1 -> rotated at positions[start:start+L]."""
        L = x.shape[2]
        delta = self.positions[start:start + L] - mx.arange(start, start + L)
        # (1, n, L, D) -> (L, n, 1, D): one rotary offset per token
        return self.rope(x.transpose(2, 1, 0, 3), offset=delta).transpose(2, 1, 0, 3)

    def update_and_fetch(self, keys, values):
        """Keep the selected tokens' K/V (1, n_kv_heads, L, head_dim), keys moved to their positions."""
        self.fresh[0].append(self._at_positions(keys, self.done)[0])
        self.fresh[1].append(values[0])
        self.done += keys.shape[2]
        return self.fresh

    def fresh_kv(self):
        """The selected tokens' (k, v) so far, each (n_kv_heads, done, head_dim)."""
        return tuple(mx.concatenate(side, axis=1) for side in self.fresh)

    def attention(self, queries, scale, mask=None, sinks=None):
        """Attention of the last L selected tokens, causal by composed position (`mask` is not read)."""
        _, n_q, L, D = queries.shape
        n_kv, start = self.prefix.n_kv_heads, self.done - L
        group = n_q // n_kv
        at = self._at_positions(queries.astype(mx.float32), start)
        rows = self.positions[start:self.done][mx.arange(group * L) % L]  # (group * L,) composed positions

        def flat(x):  # (1, n_q, L, D) -> (n_kv, group * L, D), pre-scaled
            return (x * scale).reshape(n_kv, group * L, D)

        last = len(self.parts) - 1
        partials = [part_partial(flat(self._rotated(at, p.shift)), p, rows if i == last else None)
                    for i, p in enumerate(self.parts)]
        q = flat(at)
        partials += [tail_partial(q, k, v, True) for k, v in self.patches]
        k, v = self.fresh_kv()
        partials.append(tail_partial(q, k, v, self.positions[None, :self.done] <= rows[:, None]))
        if sinks is not None:
            partials.append(sink_partial(sinks, n_kv, L, D))
        return merge(partials).reshape(1, n_q, L, D).astype(queries.dtype)
