"""CacheBlend's selective recompute in composed cartridges (`cartridge.compose.blend`, `compose(recompute_ratio=)`):
the selected tokens are patched at their composed positions, all of them selected is a fresh prefill,
ratio 0 is the boundary-only composition, bad recompute ratios are refused."""

import cartridge  # noqa: I001  (first: loads OpenBLAS before mlx)
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from helpers.compose_cases import DOC_A, DOC_B, Q, _logits

from cartridge.attention.caches import ComposedCache
from cartridge.attention.caches.composed import part_mass, part_partial
from cartridge.compose import blend
from cartridge.compose.composed import compose
from cartridge.errors import InputError

DOC_C = "Annex C. The deposit is two months of rent, returned within 14 days after the keys. " * 2


@pytest.fixture(scope="module")
def carts(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("blend")
    for name, doc in (("a", DOC_A), ("b", DOC_B), ("c", DOC_C)):
        cartridge.build(doc, d / f"{name}.cart", model=tiny, page_size=16)
    return [cartridge.load(d / f"{n}.cart", model=tiny) for n in "abc"]


def _fresh_kv(tiny, tokens):
    """Per layer (k, v) of a fresh mlx-lm prefill of `tokens`, each (n_kv, T, D)."""
    cache = make_prompt_cache(tiny.model)
    tiny.model(mx.array(tokens)[None], cache=cache)
    return [(c.keys[0, :, : c.offset], c.values[0, :, : c.offset]) for c in cache]


def test_ratio_one_equals_a_fresh_prefill(carts, tiny):
    c = compose(carts[:2], recompute_ratio=1.0)
    b = c.blended[0]
    assert b["selected"] == b["read"] > 0
    q = c.question_prompt(Q)
    np.testing.assert_allclose(_logits(tiny.model, q, c.prompt_cache()),
                               _logits(tiny.model, c.tokens + q, make_prompt_cache(tiny.model)), atol=2e-3)


def test_three_documents_at_ratio_one_equal_a_fresh_prefill(carts, tiny):
    c = compose(carts, recompute=0, recompute_ratio=1.0)
    assert [b["selected"] == b["read"] for b in c.blended] == [True, True]
    q = c.question_prompt(Q)
    np.testing.assert_allclose(_logits(tiny.model, q, c.prompt_cache()),
                               _logits(tiny.model, c.tokens + q, make_prompt_cache(tiny.model)), atol=2e-3)


def test_selected_tokens_are_patched_at_their_positions(carts, tiny):
    """Each selected token's patch is the fresh prefill's K/V at its composed position, on both layers:
    layer 0's stored K/V are exact once rotated (token and position only), so the selected tokens' layer-1
    inputs are the fresh prefill's too; their stored copies are masked out of b's part."""
    c = compose(carts[:2], recompute=4, recompute_ratio=0.3)
    b = c.blended[0]
    n_b = b["fresh"] + b["read"]
    assert b["selected"] == round(0.3 * n_b) - b["fresh"] > 0
    positions = b["positions"]
    assert positions == sorted(set(positions)) and positions[0] >= len(c.tokens) - b["read"]
    part = c._layers[0][1]
    skip = np.array(part.skip)
    assert np.flatnonzero(skip).tolist() == [p - part.shift for p in positions]
    ref = _fresh_kv(tiny, c.tokens)
    for layer, (k_ref, v_ref) in enumerate(ref):
        k, v = c._patches[layer][-1]
        np.testing.assert_allclose(np.array(k), np.array(k_ref[:, positions]), atol=2e-3)
        np.testing.assert_allclose(np.array(v), np.array(v_ref[:, positions]), atol=2e-3)
        assert not np.allclose(np.array(k), np.array(k_ref[:, [p - 1 for p in positions]]), atol=2e-3)


def test_ratio_zero_is_the_boundary_only_composition(carts, tiny):
    for n in (0, 5):
        c = compose(carts[:2], recompute=n, recompute_ratio=0.0)
        assert c.blended[0]["selected"] == 0 and c._layers[0][1].skip is None
        assert len(c._patches[0]) == 1 and c._patches[0][0][0].shape[1] == c.blended[0]["fresh"]


def test_recompute_count_counts_the_boundary():
    assert blend.recompute_count(0.0, 18, 100) == 0
    assert blend.recompute_count(0.1, 2, 100) == 8  # round(0.1 * 102) - 2
    assert blend.recompute_count(0.1, 18, 100) == 0  # the boundary alone exceeds it
    assert blend.recompute_count(1.0, 18, 100) == 100


def test_select_takes_the_largest_deviations_in_order():
    assert blend.select(mx.array([0.1, 3.0, 0.2, 2.0, 2.0]), 3) == [1, 3, 4]
    assert blend.select(mx.array([1.0, 2.0]), 0) == []


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan"), float("inf"), "0.2", True])
def test_bad_ratio_refused(carts, ratio):
    with pytest.raises(InputError, match="recompute_ratio is .* between 0 and 1") as e:
        compose(carts[:2], recompute_ratio=ratio)
    assert "\n" not in str(e.value)


def test_bad_select_layer_refused(carts):
    with pytest.raises(InputError, match="select_layer is 99; the model's layers are 0..1"):
        compose(carts[:2], recompute_ratio=0.2, select_layer=99)


def test_load_and_cli_take_the_ratio(tiny_dir, tmp_path):
    from helpers.clirun import run_inprocess as run

    from cartridge.cli.ask import load_cartridge

    a, b = tmp_path / "a.cart", tmp_path / "b.cart"
    cartridge.build(DOC_A, a, model=str(tiny_dir))
    cartridge.build(DOC_B, b, model=str(tiny_dir))
    c, _ = load_cartridge([str(a), str(b)], str(tiny_dir), "auto", recompute=2, recompute_ratio=0.25)
    n = c.blended[0]["fresh"] + c.blended[0]["read"]
    assert c.recompute_ratio == 0.25 and c.blended[0]["selected"] == round(0.25 * n) - c.blended[0]["fresh"] > 0
    r = run("ask", a, b, "When is rent due?", "--recompute-ratio", "nan")
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 1 and err == ["error: --recompute-ratio is nan; it must be a fraction of the tokens "
                                         "between 0 and 1"], err


def test_part_mass_is_the_softmax_share_of_each_stored_token(carts):
    """Over every part of a composition, the masses and the other partials' shares add up to one per row and
    head; a skipped token gets none."""
    from cartridge.attention.kernels import tail_partial

    c = compose(carts, recompute=2, recompute_ratio=0.0)
    parts, patches = c._layers[1], c._patches[1]
    n_kv, D = parts[0].prefix.n_kv_heads, patches[0][0].shape[-1]
    q = mx.random.normal((n_kv, 5, D), key=mx.random.key(3)) * D ** -0.5
    partials = [part_partial(q, p) for p in parts] + [tail_partial(q, k, v, True) for k, v in patches]
    m = mx.max(mx.stack([pt[1] for pt in partials]), axis=0)
    lse = m + mx.log(sum(li * mx.exp(mi - m) for _, mi, li in partials))
    others = sum(float((li * mx.exp(mi - lse)).sum()) for _, mi, li in partials[len(parts):])
    masses = [part_mass(q, p, partials) for p in parts]
    assert [int(x.shape[0]) for x in masses] == [p.prefix.n_tokens - p.start for p in parts]
    assert sum(float(x.sum()) for x in masses) + others == pytest.approx(n_kv * 5, rel=1e-5)
    skipped = replace(parts[-1], skip=blend.skip_mask(parts[-1].prefix, [parts[-1].start + 1]))
    got = np.array(part_mass(q, skipped, partials))
    assert got[1] == 0 and np.allclose(np.delete(got, 1), np.delete(np.array(masses[-1]), 1))


def test_attention_selection_weights_the_deviation_by_the_probe_mass(carts, tiny):
    """selection="attention" picks the top of deviation x probe mass, "deviation" the top of the deviation alone;
    both patch the same number of tokens, and an unknown selection is refused."""
    by = {s: compose(carts[:2], recompute=2, recompute_ratio=0.3, selection=s) for s in blend.SELECTIONS}
    base = compose(carts[:2], recompute=2, recompute_ratio=0.0)
    b = base.blended[0]
    part = base._layers[1][-1]
    caches = base.prompt_cache()
    mass = np.array(blend.probe_mass(tiny.model, caches, base.question_prompt(blend.PROBE)))
    assert mass.shape == (b["read"],) and (mass > 0).all()
    assert all(c.record for c in caches)
    k = by["deviation"].blended[0]["selected"]
    assert k == by["attention"].blended[0]["selected"] == blend.recompute_count(0.3, b["fresh"], b["read"]) > 0
    first = len(base.tokens) - b["read"]
    chosen = {s: [p - first for p in c.blended[0]["positions"]] for s, c in by.items()}
    dev = chosen_scores(tiny, carts, part)
    assert chosen["deviation"] == blend.select(dev, k)
    assert chosen["attention"] == blend.select(mass * dev, k)
    with pytest.raises(InputError, match="selection is 'mass'; it must be one of attention, deviation"):
        compose(carts[:2], recompute_ratio=0.3, selection="mass")


def chosen_scores(tiny, carts, part):
    """Layer-1 deviation of b's stored tokens from their prefill after a and the boundary (as compose's pass)."""
    c = compose(carts[:2], recompute=2, recompute_ratio=0.0)
    caches = [ComposedCache(p[:1], [], len(carts[0].tokens), r) for p, r in zip(c._layers, c._ropes)]
    tiny.model(mx.array(c.tokens[len(carts[0].tokens):len(c.tokens) - c.blended[0]["read"]])[None], cache=caches)
    fresh = blend.fresh_layer_kv(tiny.model, caches, c.tokens[len(c.tokens) - c.blended[0]["read"]:], 1)
    return np.array(blend.deviation(fresh, blend.stored_kv(part, c._ropes[1])))


@pytest.mark.parametrize("layer", [0, 1])
def test_selection_pass_kv_equal_a_fresh_prefill_over_several_chunks(carts, tiny, monkeypatch, layer):
    """The selection pass's K/V at `layer`, in chunks of 4 tokens, are the fresh prefill's at the same positions
    (each chunk's keys rotated at its own positions, not at the first chunk's)."""
    monkeypatch.setattr(blend, "CHUNK", 4)
    c = compose(carts[:2], recompute=2, recompute_ratio=0.0)
    n_read = c.blended[0]["read"]
    first = len(c.tokens) - n_read
    caches = [ComposedCache(p[:1], [], len(carts[0].tokens), r) for p, r in zip(c._layers, c._ropes)]
    tiny.model(mx.array(c.tokens[len(carts[0].tokens):first])[None], cache=caches)
    k, v = blend.fresh_layer_kv(tiny.model, caches, c.tokens[first:], layer)
    k_ref, v_ref = _fresh_kv(tiny, c.tokens)[layer]
    assert k.shape[1] == n_read > 3 * blend.CHUNK
    np.testing.assert_allclose(np.array(k), np.array(k_ref[:, first:]), atol=2e-3)
    np.testing.assert_allclose(np.array(v), np.array(v_ref[:, first:]), atol=2e-3)
