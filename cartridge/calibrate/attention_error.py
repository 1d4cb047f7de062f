"""The attention-output error of one layer with its stored K or V replaced (`cartridge.calibrate.measure`):
the measure by which a layer's measured KL is shared between its sides and candidate tiers."""

import mlx.core as mx
import numpy as np

from ..attention.caches.shared_prefix import shifted_exp, window_visible

LEAD_TOKENS = 32  # heavy hitters are looked for among the first prefix tokens (the format protects first N)


class AttentionError:
    """Squared relative error ||o' - o||^2 / ||o||^2 of one layer's softmax(scale q K^T) V over the stored
    prefix when K or V is replaced; the fp16 softmax and output are computed once per layer. For a layer
    that stores every token, each error keeps the pieces over the first LEAD_TOKENS tokens that give it again
    with any leading tokens kept in fp16 (`protected`), without another pass over the prefix.

    Args:
        q (mx.array): (n_heads, E, D) float32 queries. k, v (mx.array): (1, n_kv, S, D) reference K/V.
        scale (float | None): the layer's softmax scale. Default: None (D ** -0.5).
        window (int | None): a sliding-window layer's size: each query attends only the stored keys within
            its window (`shared_prefix.window_visible`); queries that see none of them are left out. Leading tokens
            are not protected (the layer does not store them). Default: None (every query sees every key).
    """

    def __init__(self, q, k, v, scale=None, window=None):
        h, e, d = q.shape
        s, n_kv = k.shape[2], k.shape[1]
        scale = d ** -0.5 if scale is None else scale
        self.hidden = None  # (group * E', S) float32: 0 where a query attends a key, -inf where the window hides it
        if window is not None:
            e = max(0, min(e, window - 1))  # query i sees a stored key only when i < window - 1
            q = q[:, :e]
            self.hidden = mx.tile(mx.where(window_visible(e, s, window), 0.0, -mx.inf), (h // n_kv, 1))
        self.q = q.reshape(n_kv, h // n_kv * e, d) * scale  # (n_kv, group * E, D): GQA groups
        self.v32 = v[0].astype(mx.float32)  # (n_kv, S, D)
        s_full = self._scores(k[0].astype(mx.float32))  # (n_kv, group * E, S) logits
        self.lead = 0 if window is not None else min(LEAD_TOKENS, s)
        mx.eval(s_full)
        self.s_lead = mx.array(np.array(np.asarray(s_full)[..., :self.lead]))  # a copy: shifted_exp overwrites
        (ex,), (z,) = shifted_exp(s_full)
        self.p = ex / mx.maximum(z, 1e-30)  # a query with no key (E' = 0 rows) has none
        self.o = self.p @ self.v32  # (n_kv, group * E, D)
        self.norm = (self.o ** 2).sum()

    def _scores(self, keys):
        """Scaled logits of the queries over keys (n_kv, S, D), the window's hidden keys at -inf."""
        s = self.q @ keys.swapaxes(-1, -2)
        return s if self.hidden is None else s + self.hidden

    def mass(self):
        """(S,) float32: the mean attention probability of each prefix token over heads and query rows."""
        return self.p.mean(axis=(0, 1))

    def __call__(self, side, x2):
        """(error, pieces): the error (a lazy scalar) with `side` ("k" or "v") replaced by x2 (1, n_kv, S, D),
        and what `protected` needs (lazy arrays)."""
        x2, n = x2[0].astype(mx.float32), self.lead
        if side == "v":
            o2 = self.p @ x2
            return self._err(o2), (o2, self.v32[:, :n] - x2[:, :n])
        # exp(s2 - top) and exp(s_lead - top), top the max of both: (n_kv, group * E, S), (.., lead)
        (e2, *e_lead), (z2, *_) = shifted_exp(self._scores(x2), *([mx.array(self.s_lead)] if n else []))
        u2 = e2 @ self.v32  # unnormalized output; z2 is softmax's sum
        return self._err(u2 / mx.maximum(z2, 1e-30)), (u2, z2, e_lead[0] - e2[..., :n] if n else None)

    def protected(self, side, pieces, first):
        """The error of `__call__`'s replacement with its first `first` (<= lead) tokens kept in fp16."""
        if side == "v":
            o2, diff = pieces  # (n_kv, rows, D), (n_kv, lead, D): V minus its replacement
            return self._err(o2 + self.p[..., :first] @ diff[:, :first])
        u2, z2, de = pieces  # de: exp of the reference logits minus the replaced ones', over the lead tokens
        de = de[..., :first]
        return self._err((u2 + de @ self.v32[:, :first]) / (z2 + de.sum(axis=-1, keepdims=True)))

    def _err(self, o2):
        return ((o2 - self.o) ** 2).sum() / mx.maximum(self.norm, 1e-30)
