"""The memory budget of `auto` (cartridge/attention/budget.py, policy.place): which sides are decoded for a
given max_memory, exact byte accounting, the same attention whatever the placement, and load's max_memory."""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from cartridge.attention import budget, pages
from cartridge.attention.caches import CartridgeCache
from cartridge.attention.kernels import merge, portable
from cartridge.attention.pages import make_prefix
from cartridge.attention.policy import place
from cartridge.errors import InputError
from cartridge.tiers import TIERS

N_KV, D, T, PAGE = 2, 32, 300, 64  # 5 pages, the last one padded
SIDE = 12_800  # mlx4g32 bytes of one side: 5 pages x 2 heads x 64 tokens x (16 codes + 2 scale + 2 bias)
DENSE = 5 * N_KV * PAGE * D * 4  # one side decoded to float32: 81,920 bytes


def _prefixes(n_layers=3, tier="mlx4g32"):
    c = TIERS[tier]
    out = []
    for i in range(n_layers):
        k = mx.random.normal((N_KV, T, D), key=mx.random.key(2 * i))
        v = mx.random.normal((N_KV, T, D), key=mx.random.key(2 * i + 1))
        out.append(make_prefix(c, k, c, v, PAGE, layer=i))
    return out


def _sides(prefixes):
    return {(i, s): (p.k_codec if s == "k" else p.v_codec).name for i, p in enumerate(prefixes) for s in "kv"}


def test_sizes_of_a_side():
    p = _prefixes(1)[0]
    assert p.nbytes == 2 * SIDE
    # the dense pages, then one chunk decoded (here the whole side: under DECODE_CHUNK elements) in float32 with
    # its temporaries (DECODE_BYTES an element), and its cast
    elements = DENSE // 4
    assert elements <= pages.DECODE_CHUNK and pages.DECODE_BYTES == 10
    s = budget.side_sizes(0, "k", SIDE, (5, N_KV, PAGE, D), mx.float32)
    assert (s.dense, s.transient) == (DENSE, DENSE + elements * 10)
    s16 = budget.side_sizes(0, "k", SIDE, (5, N_KV, PAGE, D), mx.float16)
    assert (s16.dense, s16.transient) == (DENSE // 2, DENSE // 2 + elements * (10 + 2))
    big = budget.side_sizes(0, "k", SIDE, (4096, N_KV, PAGE, D), mx.float32)  # chunks of whole pages
    per_page = N_KV * PAGE * D
    assert big.transient == big.dense + pages.DECODE_CHUNK // per_page * per_page * 10


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the measured peak is the CPU's")
@pytest.mark.parametrize("tier, dtype", [("mxfp4", mx.float32), ("nvfp4", mx.float32), ("mlx4g32", mx.float16)])
def test_decoding_a_side_stays_within_its_planned_bytes(tier, dtype, monkeypatch):
    """decode_pages decodes a chunk of pages at a time into one buffer: MLX's measured peak while it decodes a side
    stays within what the plan counts for it (its stored pages + `Side.transient`); a whole-side decode of
    mxfp4 held 2.3x its float32 output."""
    monkeypatch.setattr(pages, "DECODE_CHUNK", 4 * 8 * 256 * 128)  # 4 pages a chunk, as on a 27 MB side
    codec = TIERS[tier]
    prefix = make_prefix(codec, mx.random.normal((8, 26 * 256, 128), key=mx.random.key(0)), codec,
                         mx.zeros((8, 256, 128)), 256)
    parts = prefix.k_parts
    mx.eval(parts)
    mx.clear_cache()
    stored = sum(a.nbytes for a in parts.values())
    side = budget.side_sizes(0, "k", stored, (26, 8, 256, 128), dtype)
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    out = pages.decode_pages(codec, parts, prefix.k_params, dtype)
    assert out.shape == (26, 8, 256, 128) and out.dtype == dtype
    assert mx.get_peak_memory() - before <= side.transient
    np.testing.assert_array_equal(np.array(out), np.array(codec.decode(parts, prefix.k_params).astype(dtype)))


@pytest.fixture
def no_decode_temporaries(monkeypatch):
    """The plan's exact byte thresholds below count the dense pages only (no chunk temporaries)."""
    monkeypatch.setattr(pages, "DECODE_BYTES", 0)


def test_plan_decodes_k_sides_first_in_layer_order_within_the_budget():
    sides = [budget.Side(i, s, 100, 400, 400) for i in range(3) for s in "kv"]
    held = 600
    # K0 peaks at 600 + 400, then 900 held; K1 would peak at 1300 > 1299, and so would every other side
    assert budget.plan_decoded(sides, held, 1299) == ([(0, "k")], 900, 1000)
    assert budget.plan_decoded(sides, held, 1300) == ([(0, "k"), (1, "k")], 1200, 1300)
    assert budget.plan_decoded(sides, held, 599)[0] == []  # below the stored bytes: nothing decoded
    assert budget.plan_decoded(sides, held, None) == ([(0, "k"), (1, "k"), (2, "k"), (0, "v"), (1, "v"), (2, "v")],
                                              2400, 2100 + 400)


def test_default_budget_is_stored_times_1_25_plus_one_layer():
    sides = [budget.Side(0, "k", 10, 400, 400), budget.Side(0, "v", 10, 300, 300), budget.Side(1, "k", 10, 500, 500)]
    assert budget.default_budget(1000, sides) == 1250 + 700
    assert budget.default_budget(1000, []) == 1250


@pytest.mark.parametrize("max_memory, decoded", [
    (None, {(0, "k"), (1, "k"), (2, "k"), (0, "v"), (1, "v"), (2, "v")}),  # named policy, no limit: all
    (76_800 + DENSE - 1, set()),
    (76_800 + DENSE, {(0, "k")}),
    (76_800 + 2 * DENSE - 12_800, {(0, "k"), (1, "k")}),  # each decoded side frees its 12,800 stored bytes
    (76_800 + 3 * DENSE - 2 * 12_800, {(0, "k"), (1, "k"), (2, "k")}),
    (76_800 + 4 * DENSE - 3 * 12_800, {(0, "k"), (1, "k"), (2, "k"), (0, "v")}),
])
def test_place_decodes_the_sides_a_max_memory_allows(max_memory, decoded, no_decode_temporaries):
    prefixes = _prefixes()
    assert sum(p.nbytes for p in prefixes) == 76_800
    out, report = place(list(prefixes), "dequantize-once", mx.float32, [(D, D)] * 3, max_memory, unpack=False)
    want = {key: ("dequantized" if key in decoded else "mlx4g32") for key in _sides(prefixes)}
    assert _sides(out) == want
    m = report["memory"]
    assert m["resident_bytes"] == sum(p.nbytes for p in out)  # the accounting is the arrays held
    assert m["resident_bytes"] == 76_800 + len(decoded) * (DENSE - 12_800)
    if max_memory is not None:
        assert m["planned_peak_bytes"] <= max_memory
    names = {"dequantize-once" if {(i, "k"), (i, "v")} <= decoded else
             "dequantize-once (K only)" if (i, "k") in decoded else "portable" for i in range(3)}
    assert report["policy"] == (names.pop() if len(names) == 1 else "mixed")


def test_auto_uses_the_default_budget_and_a_named_policy_does_not(no_decode_temporaries):
    entries = [{"backend": "cpu", "tier": "mlx4g32", "head_dim": D, "mode": "decode", "context": 256,
                "policy": "dequantize-once", "us": {"portable": 2.0, "dequantize-once": 1.0}, "dense_us": 1.5,
                "machine": "m", "measured": "d"}]
    if mx.default_device() != mx.cpu:
        pytest.skip("the table entry is for the CPU")
    prefixes = _prefixes()
    out, report = place(list(prefixes), "auto", mx.float32, [(D, D)] * 3, entries=entries, unpack=False)
    limit = int(76_800 * 1.25) + 2 * DENSE
    assert report["memory"]["budget_bytes"] == limit
    assert report["memory"]["planned_peak_bytes"] <= limit
    # 96,000 + 163,840: K0 (peak 158,720), K1 (peak 227,840), K2 would peak at 296,960
    assert {k for k, v in _sides(out).items() if v == "dequantized"} == {(0, "k"), (1, "k")}
    assert report["layers"][0]["policy"] == "dequantize-once (K only)"
    assert report["layers"][2]["policy"] == "portable"
    assert "2 of 6 layer-sides decoded" in report["reason"]
    entries[0]["policy"], entries[0]["us"] = "portable", {"portable": 1.0, "dequantize-once": 2.0}
    out, report = place(list(prefixes), "auto", mx.float32, [(D, D)] * 3, entries=entries, unpack=False)
    assert set(_sides(out).values()) == {"mlx4g32"} and report["policy"] == "portable"
    assert report["reason"].startswith("portable: 0.50x dequantize-once, 0.67x dense at 256 tokens")


def test_auto_decodes_fp16_pages_whole_without_a_budget():
    """An fp16 cartridge's pages are as big as dense ones: auto decodes them as before (no default budget)."""
    entries = [{"backend": "cpu", "tier": "fp16", "head_dim": D, "mode": "decode", "context": 256,
                "policy": "dequantize-once", "us": {"portable": 2.0, "dequantize-once": 1.0}, "dense_us": 1.5,
                "machine": "m", "measured": "d"}]
    if mx.default_device() != mx.cpu:
        pytest.skip("the table entry is for the CPU")
    out, report = place(list(_prefixes(tier="fp16")), "auto", mx.float32, [(D, D)] * 3, entries=entries)
    assert report["memory"]["budget_bytes"] is None and report["policy"] == "dequantize-once"
    assert set(_sides(out).values()) == {"dequantized"}
    out, report = place(list(_prefixes(tier="fp16")), "auto", mx.float32, [(D, D)] * 3, max_memory=1, entries=entries)
    assert set(_sides(out).values()) == {"fp16"} and report["policy"] == "portable"  # a max_memory still holds


def test_every_placement_attends_the_same():
    prefixes = _prefixes()
    q = mx.random.normal((1, 4, 1, D), key=mx.random.key(9))
    k_new = mx.random.normal((1, N_KV, 1, D), key=mx.random.key(10))
    outs = []
    for max_memory in (76_800, 76_800 + DENSE, None):
        placed, _ = place(list(prefixes), "dequantize-once", mx.float32, [(D, D)] * 3, max_memory)
        cache = CartridgeCache(placed[1])
        cache.update_and_fetch(k_new, k_new)
        outs.append(np.array(cache.attention(q, D ** -0.5)))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[0], outs[2], rtol=1e-5, atol=1e-6)


def test_cpu_split_over_streams_equals_one_pass():
    c = TIERS["mlx4g32"]
    k = mx.random.normal((N_KV, 1000, D), key=mx.random.key(3))
    p = make_prefix(c, k, c, k, PAGE)  # 16 pages, 1000 tokens: the last page padded
    q = mx.random.normal((N_KV, 3, D), key=mx.random.key(4))
    with mx.stream(mx.cpu):
        split = merge([portable._split_partial(q, p, 1000, 16)])
        whole = merge([portable._partial(q, p, 1000)])
    np.testing.assert_allclose(np.array(split), np.array(whole), rtol=1e-5, atol=1e-6)


def test_load_refuses_a_bad_max_memory(tmp_path):
    for bad in (0, -5, 1.5, True, "1G"):
        with pytest.raises(InputError, match="max_memory"):
            cartridge.load(tmp_path / "none.cart", max_memory=bad)


def test_load_reports_the_plan(tiny, tmp_path):
    r = cartridge.build("The kettle warranty lasts 24 months. " * 20, tmp_path / "a.cart", model=tiny,
                        tier="fp16", page_size=64)
    stored = sum(e.page_bytes * e.shape[0] for ex in cartridge.open_cartridge(r.path)[0].extents.values()
                 for e in ex)
    cart = cartridge.load(r.path, model=tiny, attention="dequantize-once", max_memory=stored)
    assert cart.attention == "portable"  # nothing fits above the stored pages
    assert cart.plan["memory"]["resident_bytes"] == stored == cart.plan["memory"]["stored_bytes"]
    cart = cartridge.load(r.path, model=tiny, attention="dequantize-once")
    assert cart.attention == "dequantize-once" and cart.plan["memory"]["budget_bytes"] is None


UNPACKED = 5 * N_KV * PAGE * (D + 2 * 4)  # mlx4g32 side unpacked: uint8 codes, float32 scales and biases
STEP = DENSE  # a decode step's float32 cast of one unpacked side


def test_sizes_of_an_unpacked_side():
    from cartridge.attention import unpacked

    assert unpacked.sizes(TIERS["mlx4g32"], (5, N_KV, PAGE, D)) == (UNPACKED, 5 * N_KV * PAGE * D, STEP)
    assert unpacked.sizes(TIERS["int8"], (5, N_KV, PAGE, D)) == (UNPACKED, 0, STEP)  # its codes are viewed


def test_plan_unpacked_unpacks_every_k_side_or_none():
    sides = [budget.Side(i, s, 100, 400, 400, *((150, 80, 400) if s == "k" else (0, 0, 0)))
             for i in range(3) for s in "kv"]
    # all three K sides: 600 + 3 x 50 held after, + the 400-byte step cast; the third's unpacking peaks at 930
    assert budget.plan_unpacked(sides, 600, 1150) == ([], [(0, "k"), (1, "k"), (2, "k")], 750, 1150)
    # one byte less: nothing unpacked; the dense plan decodes K0 (peak 1000) as `plan_decoded` does
    assert budget.plan_unpacked(sides, 600, 1149) == ([(0, "k")], [], 900, 1000)
    # K0 dense: 750 + 250 held after, and the larger of 150 more while it decodes and the 400-byte step cast
    assert budget.plan_unpacked(sides, 600, 1400) == ([(0, "k")], [(1, "k"), (2, "k")], 1000, 1400)
    assert budget.plan_unpacked(sides, 600, 1399) == ([], [(0, "k"), (1, "k"), (2, "k")], 750, 1150)
    assert budget.plan_unpacked(sides, 600, None) == budget.plan_decoded(sides, 600, None)[:1] + ([],) + \
        budget.plan_decoded(sides, 600, None)[1:]


@pytest.mark.parametrize("max_memory, decoded, packed", [
    (76_800 + 3 * (UNPACKED - SIDE) + STEP - 1, {(0, "k")}, set()),  # not every K side fits unpacked
    (76_800 + 3 * (UNPACKED - SIDE) + STEP, set(), {(0, "k"), (1, "k"), (2, "k")}),
    # then K0 dense: 56,320 more held, and the larger of the step cast and its decode's 2 x 25,600 more
    # (it is decoded from unpacked codes, beside its stored pages)
    (76_800 + 3 * (UNPACKED - SIDE) + (DENSE - UNPACKED) + STEP, {(0, "k")}, {(1, "k"), (2, "k")}),
    (76_800 + 3 * (UNPACKED - SIDE) + (DENSE - UNPACKED) + STEP - 1, set(), {(0, "k"), (1, "k"), (2, "k")}),
])
def test_place_unpacks_the_k_sides_a_max_memory_allows(max_memory, decoded, packed, no_decode_temporaries):
    prefixes = _prefixes()
    out, report = place(list(prefixes), "dequantize-once", mx.float32, [(D, D)] * 3, max_memory, unpack=True)
    want = {key: "dequantized" if key in decoded else "unpacked" if key in packed else "mlx4g32"
            for key in _sides(prefixes)}
    assert _sides(out) == want
    m = report["memory"]
    assert m["resident_bytes"] == sum(p.nbytes for p in out)  # the accounting is the arrays held
    assert m["planned_peak_bytes"] <= max_memory
    if packed:
        assert m["planned_peak_bytes"] >= m["resident_bytes"] + STEP
        assert f"{len(packed)} of them with their codes unpacked" in report["reason"]
    assert {x["policy"] for x in report["layers"]} <= {"portable (K unpacked)", "dequantize-once (K only)",
                                                      "portable"}


@pytest.mark.parametrize("tier", ["int8", "mlx4g32"])
def test_every_placement_attends_the_same_unpacked_or_not(tier):
    prefixes = _prefixes(tier=tier)
    q = mx.random.normal((1, 4, 3, D), key=mx.random.key(9))
    k_new = mx.random.normal((1, N_KV, 3, D), key=mx.random.key(10))
    outs = []
    for max_memory, unpack in ((None, False), (1 << 30, True), (None, True), (sum(p.nbytes for p in prefixes), True)):
        placed, _ = place(list(prefixes), "dequantize-once", mx.float32, [(D, D)] * 3, max_memory, unpack=unpack)
        cache = CartridgeCache(placed[1])
        cache.update_and_fetch(k_new, k_new)
        outs.append(np.array(cache.attention(q, D ** -0.5, mask="causal")))
    assert _sides(placed) == _sides(prefixes)  # the last: at the stored bytes, nothing unpacked or decoded
    for got in outs[1:]:
        np.testing.assert_allclose(got, outs[0], rtol=1e-5, atol=1e-6)
