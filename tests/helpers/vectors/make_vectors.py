"""Regenerate tests/helpers/vectors/tiny-1.5.cart and tiny-1.11.cart (tiny-1.0.cart, tiny.cart (format 1.2) and tiny-1.4.cart are kept
as written then). Running this is a deliberate format change: the committed bytes
pin the writer (tests/format/test_vectors.py), so review the diff and bump the spec if they move.

    python tests/helpers/vectors/make_vectors.py
"""

import shutil
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))
sys.path.insert(0, str(HERE.parents[1]))  # tests/

from helpers.cartfiles import header  # noqa: E402

from cartridge.format import keys as K  # noqa: E402

from cartridge.format.writer import CartridgeWriter  # noqa: E402

# 1 layer, 1 KV head, head_dim 4, pages of 2 tokens, 3 tokens -> 2 pages of 16 bytes per (layer, side)
N_TOKENS, PAGE, N_KV, HEAD_DIM = 3, 2, 1, 4
TOKENS = [17, 4242, 99]
FINGERPRINT = {"id": "1" * 64, "config": "2" * 64, "weights": "3" * 64, "tokenizer": "4" * 64,
               "chat_template": "5" * 64}


PROTECT = (1, 1)  # format 1.5: token 0 and token 2 also kept in fp16 (spec 4.5.4)
KEY_SCALE = np.array([[2.0, 0.5, 1.0, 4.0]], dtype=np.float32)  # format 1.11: K stored as K / s (spec 4.5.6)


def vector_header():
    """The JSON header records of the vector (spec 4.2, section 5.5 of format 1.4, 4.6 of 1.5)."""
    h = header(n_layers=1, n_kv=N_KV, head_dim=HEAD_DIM, page=PAGE, n_tokens=N_TOKENS,
               writer="cartridge test vector", ref="vector", fingerprint=FINGERPRINT,
               config={"model_type": "llama", "vocab_size": 4243})
    h.update({K.FORMAT_MINOR: 5, K.layer_kind(0): "attention",
              K.layer_shape(0, "k"): [N_KV, HEAD_DIM], K.layer_shape(0, "v"): [N_KV, HEAD_DIM],
              K.PROTECT_FIRST: PROTECT[0], K.PROTECT_LAST: PROTECT[1]})
    return h


def vector_pages(side):
    """K: 0.5 * (0..15), V: -(0..15) + 0.25, as float16 (2 pages, 1 head, 2 tokens, 4); token 3 is padding."""
    x = np.arange(16, dtype=np.float32).reshape(2, 1, 2, 4)
    x = 0.5 * x if side == "k" else -x + 0.25
    x[1, :, 1, :] = 0  # the third token slot of page 1 is padding: zeros (spec 3.1)
    return x.astype(np.float16)


def vector_protected(side):
    """The fp16 copies of the protected tokens: (1 head, N + M = 2, 4): tokens 0 and 2 of the pages."""
    x = vector_pages(side)  # (2 pages, 1, 2, 4): token t is page t // 2, slot t % 2
    return np.stack([x[0, :, 0], x[1, :, 0]], axis=1)


def scaled_header():
    """The 1.5 vector's header as format 1.11 with layer 0's K scaled (K codec_version 2)."""
    return {**vector_header(), K.FORMAT_MINOR: 11, K.layer_codec_version(0, "k"): 2}


def stored(side, x, scaled):
    """x as the vector stores it: K divided by KEY_SCALE (exact in float16: powers of two) when `scaled`."""
    return (x / KEY_SCALE[:, None, :] if scaled and side == "k" else x).astype(np.float16)


def write_vector(path, header=None, force=False, scaled=False):
    """Write the vector with the given header dict (default `vector_header()`, or `scaled_header()` with
    `scaled`: the same K and V, its K pages and protected copies divided by KEY_SCALE, which it records)."""
    with CartridgeWriter(path, force=force) as w:
        for side in "kv":
            w.add_extent(0, side, "values", stored(side, vector_pages(side), scaled))
            w.add_record(K.layer_protected(0, side), stored(side, vector_protected(side), scaled).astype("<f2").tobytes())
        if scaled:
            w.add_record(K.layer_key_scale(0), KEY_SCALE.astype("<f4").tobytes())
        return w.commit(header or (scaled_header() if scaled else vector_header()), np.asarray(TOKENS, dtype=np.uint32))


if __name__ == "__main__":
    for name, scaled in (("tiny-1.5.cart", False), ("tiny-1.11.cart", True)):
        target = HERE / name
        shutil.rmtree(target, ignore_errors=True)
        print(write_vector(target, scaled=scaled))
