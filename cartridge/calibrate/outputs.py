"""W_o's Gram per KV head: the weight under which V's codes are chosen for the attention output (issue 49 item 4).

A KV head's V reaches the residual stream only through the attention weights and the output projection: query
head h adds W_o[:, h] sum_t a_t v_t, so V's rounding error e_t costs |W_o[:, h] sum_t a_t e_t|^2, whose part per
token is a_t^2 e_t^T (W_h^T W_h) e_t, W_h the (hidden, head_dim) block of o_proj that head h's output enters
(GQA: summed over the group's query heads). Nearest rounding minimises |e_t|^2, right for W_h^T W_h = I only;
`score_aware.feedback_round` under G = sum_h W_h^T W_h rounds for the output instead (the same GPTQ feedback, here
with a weight of the model, not of the document). The attention mass a_t scales every coordinate of a token's
error alike, so for tiers whose grid is a token's own (all but kivi4's K) it does not change a token's codes:
it is not used.
"""

import mlx.core as mx
import numpy as np
import mlx.nn as nn

from .measure import body_of, text_model


def _dense_weight(linear):
    """A Linear's or QuantizedLinear's weight (out, in) as float32."""
    if isinstance(linear, nn.QuantizedLinear):
        return mx.dequantize(linear.weight, linear.scales, getattr(linear, "biases", None), linear.group_size,
                             linear.bits, mode=getattr(linear, "mode", "affine")).astype(mx.float32)
    return linear.weight.astype(mx.float32)


def output_weights(model, kinds, shapes):
    """(layer, "v") -> (n_kv_heads, head_dim, head_dim) float64 G = sum over the group's query heads of
    W_h^T W_h, scaled to a mean diagonal of 1, for every "attention" layer with an `o_proj` of the expected width.

    Args:
        model (nn.Module): the mlx-lm model. kinds (list[str]): each layer's kind (`LayerPlan.kind`).
        shapes (list): each layer's V (n_kv_heads, head_dim) (`LayerPlan.v_shape`).

    Returns:
        dict: possibly empty (a model whose attention has no `self_attn.o_proj` keeps nearest V).
    """
    out = {}
    layers = body_of(text_model(model)).layers
    for i, (layer, kind, shape) in enumerate(zip(layers, kinds, shapes)):
        proj = getattr(getattr(layer, "self_attn", None), "o_proj", None)
        if kind != "attention" or proj is None or shape is None:
            continue
        n_kv, d = shape
        w = np.array(_dense_weight(proj))  # (hidden, n_q_heads * head_dim)
        if w.shape[1] % (n_kv * d):
            continue
        blocks = w.reshape(w.shape[0], -1, d)  # (hidden, n_q_heads, head_dim): head h is columns h*d .. h*d+d-1
        gram = np.einsum("ohd,ohe->hde", blocks, blocks, dtype=np.float64)  # (n_q_heads, D, D)
        g = gram.reshape(n_kv, -1, d, d).sum(axis=1)  # query head h reads KV head h // group
        out[(i, "v")] = g / (np.einsum("nii->n", g)[:, None, None] / d)
    return out
