"""Every cache kind of `cartridge.attention.caches.KINDS` speaks mlx-lm's cache protocol (`PROTOCOL`) and, over a
tiny model's prefix, attends like mlx-lm's own KVCache holding the same K/V: the same logits for a few new tokens,
the same offset, the same mask, and a trim that steps the tail back as KVCache.trim does (the kinds that cannot
step back refuse it)."""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, save_prompt_cache

from cartridge.attention import route
from cartridge.attention.caches import (KINDS, PROTOCOL, BlendCache, CartridgeCache, ComposedCache, Part,
                                        PipelineCache, PrefillCache, PrefixKVCache, SharedPrefixCache)
from cartridge.attention.pages import decode_prefix, make_prefix
from cartridge.errors import CartridgeError
from cartridge.tiers import get_tier

PREFIX = [1, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67]  # 19 tokens: a partial last page
NEW = [101, 102, 103, 104, 105]
AGAIN = [201, 202]
FAR = 10 ** 6  # a trim past every tail token


@pytest.fixture(scope="module")
def stored(tiny):
    """Per layer of the tiny model, its prefix's K/V stored in fp16 pages of 8 tokens (a LayerPrefix) and what
    they decode to, (1, n_kv_heads, T, head_dim) float32 each."""
    kv = [KVCache() for _ in tiny.model.layers]
    tiny.model(mx.array(PREFIX)[None], cache=kv)
    fp16 = get_tier("fp16")
    prefixes = [make_prefix(fp16, c.keys[0, :, :len(PREFIX)], fp16, c.values[0, :, :len(PREFIX)], 8) for c in kv]
    decoded = [decode_prefix(p, mx.float32) for p in prefixes]
    mx.eval(decoded)
    return prefixes, decoded


def reference(decoded):
    """mlx-lm's own KVCache per layer, holding the decoded prefix."""
    caches = [KVCache() for _ in decoded]
    for c, (k, v) in zip(caches, decoded):
        c.update_and_fetch(k, v)
    return caches


def ropes(tiny):
    return [layer.self_attn.rope for layer in tiny.model.layers]


# kind -> (its caches for one layer each over the stored prefix, (model, prefixes, decoded) -> list)
MAKE = {
    "cartridge": lambda m, ps, ds: [CartridgeCache(p) for p in ps],
    "pipeline": lambda m, ps, ds: [PipelineCache(p) for p in ps],
    "dense": lambda m, ps, ds: [PrefixKVCache(k, v) for k, v in ds],
    "prefill": lambda m, ps, ds: [PrefillCache(p, len(PREFIX), mx.float32) for p in ps],
    "composed": lambda m, ps, ds: [ComposedCache([Part(p, 0, 0)], [], len(PREFIX), r) for p, r in zip(ps, ropes(m))],
    # every new token selected, at the positions right after the prefix: a plain prefill of them
    "blend": lambda m, ps, ds: [BlendCache([Part(p, 0, 0)], [], len(PREFIX), r,
                                           mx.arange(len(PREFIX), len(PREFIX) + len(NEW) + len(AGAIN)))
                                for p, r in zip(ps, ropes(m))],
    # two rows of the walk, the last over a "replacement" equal to the prefix
    "shared_prefix": lambda m, ps, ds: [SharedPrefixCache(k, v, k, v, replaced_rows=1) for k, v in ds],
}
# kinds whose `offset` is not the token count: a BlendCache's is the selected tokens done (their rotary offset)
COUNTS_SELECTED = {"blend"}
# kinds that cannot step back: `is_trimmable()` is False and `trim` raises
NOT_TRIMMABLE = {"blend", "shared_prefix"}
# kinds that trim into the prefix as mlx-lm's KVCache does (extend's cache is a plain KVCache of decoded pages)
TRIMS_PREFIX = {"prefill"}
ROWS = {"shared_prefix": 2}  # rows fed at once (the walk's batch); one elsewhere


def feed(tiny, tokens, caches, rows=1):
    """Logits (rows, L, vocab) of `tokens` fed after what `caches` hold, attention routed."""
    route.install()
    return tiny.model(mx.array([tokens] * rows), cache=caches)


def test_the_table_names_every_kind_once_and_each_has_every_method_of_the_protocol(tiny, stored):
    assert set(KINDS) == set(MAKE)  # a new kind needs its round trip here
    assert len(set(KINDS.values())) == len(KINDS)
    made = {name: MAKE[name](tiny, *stored)[0] for name in KINDS}  # (KVCache's `offset` is set in __init__)
    missing = {name: [m for m in PROTOCOL if not hasattr(c, m)] for name, c in made.items()}
    assert missing == {name: [] for name in KINDS}


@pytest.mark.parametrize("kind", sorted(MAKE))
def test_new_tokens_attend_as_over_mlx_lms_kv_cache(kind, tiny, stored):
    prefixes, decoded = stored
    caches, ref = MAKE[kind](tiny, prefixes, decoded), reference(decoded)
    assert all(type(c) is KINDS[kind] for c in caches)
    rows = ROWS.get(kind, 1)
    got, want = feed(tiny, NEW, caches, rows), feed(tiny, NEW, ref)
    for row in range(rows):
        np.testing.assert_allclose(np.array(got[row]), np.array(want[0]), rtol=1e-4, atol=1e-4)
    c, r = caches[0], ref[0]
    assert c.offset == (len(NEW) if kind in COUNTS_SELECTED else r.offset) and c.size() == c.offset
    for n, want_mask in ((1, None), (3, "causal")):  # as mlx-lm's models ask (mlx_lm.models.base)
        assert c.make_mask(n, return_array=False, window_size=None) == want_mask
        assert r.make_mask(n, return_array=False, window_size=None) == want_mask
    if kind not in COUNTS_SELECTED:
        masks = [x.make_mask(3, return_array=True, window_size=None) for x in (c, r)]
        assert masks[0].shape == (3, c.offset + 3) and np.array_equal(np.array(masks[0]), np.array(masks[1]))
    assert not c.empty() and c.nbytes >= prefixes[0].nbytes
    assert isinstance(c.meta_state, tuple) and all(isinstance(s, str) for s in c.meta_state)


@pytest.mark.parametrize("kind", sorted(set(MAKE) - NOT_TRIMMABLE))
def test_trim_steps_the_tail_back_as_kv_cache_trim(kind, tiny, stored):
    prefixes, decoded = stored
    caches, ref = MAKE[kind](tiny, prefixes, decoded), reference(decoded)
    feed(tiny, NEW, caches), feed(tiny, NEW, ref)
    assert all(c.is_trimmable() for c in caches)
    assert [c.trim(2) for c in caches] == [r.trim(2) for r in ref] == [2] * len(ref)
    assert caches[0].offset == ref[0].offset == len(PREFIX) + len(NEW) - 2
    got, want = feed(tiny, AGAIN, caches), feed(tiny, AGAIN, ref)  # over the kept tokens only
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    left = len(NEW) - 2 + len(AGAIN)
    floor = 0 if kind in TRIMS_PREFIX else len(PREFIX)  # the others never trim their shared prefix
    assert caches[0].trim(FAR) == left + len(PREFIX) - floor and caches[0].offset == floor


@pytest.mark.parametrize("kind", sorted(NOT_TRIMMABLE))
def test_a_kind_that_cannot_step_back_says_so_and_refuses_trim(kind, tiny, stored):
    c = MAKE[kind](tiny, *stored)[0]
    assert not c.is_trimmable()
    with pytest.raises(CartridgeError, match=f"a {KINDS[kind].__name__} cannot be trimmed"):
        c.trim(1)


@pytest.mark.parametrize("kind", sorted(MAKE))
def test_no_kind_is_saved_by_mlx_lm_or_made_from_saved_state(kind, tiny, stored, tmp_path):
    c = MAKE[kind](tiny, *stored)[0]
    with pytest.raises(ValueError, match="not serializable: .*cart.save"):
        save_prompt_cache(str(tmp_path / "c.safetensors"), [c])
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CartridgeError, match=f"a {KINDS[kind].__name__} is made by .*, not from saved state"):
        KINDS[kind].from_state(c.state)
