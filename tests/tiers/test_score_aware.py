"""Score-aware K encoding (issue 49): the codes minimise the score error under the queries' second moment, the
stored format and every decode are the tier's own, and a build gathers the moments from its own prefill."""

import json

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from helpers.family_models import make_model
from helpers.tiny_models import make_tiny

from cartridge.attention import route
from cartridge.write.build import build
from cartridge.write.prefill import prefill
from cartridge.calibrate import queries
from cartridge.errors import InputError
from cartridge.format import keys as K
from cartridge.format.reader import open_cartridge
from cartridge.read.load import load
from cartridge.read.stored import layer_prefix
from cartridge.tiers import TIERS, score_aware
from cartridge.tiers.rotation import rotate

N_KV, T, D = 2, 64, 64
WEIGHTED_TIERS = ("int8", "int6", "mlx4g32", "fp8", "mxfp4", "nvfp4", "kivi4", "int8+rot", "mlx4g32+rot",
                  "mxfp4+rot", "nvfp4+rot", "turbo4", "turbo3", "turbo2")


def anisotropic(seed=0, n=4096):
    """K (N_KV, T, D) with outlier channels, and queries (N_KV, n, D) drawn from a correlated distribution."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((N_KV, T, D)).astype(np.float32) * np.linspace(0.3, 2.0, D, dtype=np.float32)
    k[..., 5] *= 6  # an outlier channel
    mix = rng.standard_normal((N_KV, D, D)) * np.linspace(0.1, 3.0, D)  # queries concentrated on a few directions
    q = (rng.standard_normal((N_KV, n, D)) @ mix).astype(np.float32)
    return k, q


def second_moment(q):
    return np.einsum("nqd,nqe->nde", q.astype(np.float64), q.astype(np.float64)) / q.shape[1]


def encoded(name, x, weight=None, layer=0, side="k"):
    codec = TIERS[name]
    with score_aware.weighting(None if weight is None else {(layer, side): weight}):
        params = codec.make_params(x, layer, side)
    parts = codec.encode(x, params)
    return codec, params, parts


@pytest.fixture
def cpu_device():
    """Exact codes are a float32 CPU property: on a GPU the tier's own encode and the feedback's numpy round ties
    apart (an H100 gave other mxfp4/nvfp4 codes for an identity weight, and TF32 rotations 1e-3 apart)."""
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


@pytest.mark.parametrize("name", WEIGHTED_TIERS)
def test_identity_weight_is_nearest_rounding(name, cpu_device):
    """With H = I no error moves to another coordinate: the codes (and scales) are the tier's own encode's."""
    k, _ = anisotropic()
    x = mx.array(k)
    _, _, plain = encoded(name, x)
    _, params, weighted = encoded(name, x, np.broadcast_to(np.eye(D), (N_KV, D, D)).copy())
    assert score_aware.weight_of(params) is not None
    same = ("codes",) if name.startswith("turbo") else tuple(plain)  # TurboQuant's norm is fitted under H
    for comp in same:
        assert mx.array_equal(plain[comp], weighted[comp]), comp


@pytest.mark.parametrize("name", WEIGHTED_TIERS)
def test_score_error_lower_on_queries_not_seen(name):
    """Codes chosen under one sample of queries' E[q q^T] give a lower score error than nearest rounding on
    another sample of the same distribution, in the tier's own decode; the parts have the tier's shapes."""
    k, q = anisotropic()
    _, held_out = anisotropic(seed=0, n=4096 * 2)
    held_out = held_out[:, 4096:]  # the same mixing, other draws
    x = mx.array(k)
    codec, params, plain = encoded(name, x)
    _, _, weighted = encoded(name, x, second_moment(q))
    for comp in plain:
        assert weighted[comp].shape == plain[comp].shape and weighted[comp].dtype == plain[comp].dtype
    test = second_moment(held_out)
    err_plain = score_aware.score_error(k, np.array(codec.decode(plain, params)), test)
    err_weighted = score_aware.score_error(k, np.array(codec.decode(weighted, params)), test)
    assert err_weighted < 0.9 * err_plain, (err_weighted, err_plain)  # measured 0.80-0.84 plain, 0.40-0.54 rotated


def test_portable_scores_read_weighted_codes_like_any_other(cpu_device):
    """The portable path's scores over score-aware pages are q . decode(k): nothing else reads them otherwise."""
    k, q = anisotropic()
    for name in ("mlx4g32+rot", "turbo3", "mxfp4"):
        codec, params, parts = encoded(name, mx.array(k), second_moment(q))
        pages = {c: p[None] for c, p in parts.items()}  # one page of T tokens: (1, n_kv, T, width)
        query = mx.array(q[:, :3])
        want = query @ codec.decode(pages, params)[0].swapaxes(-1, -2)
        assert mx.allclose(codec.scores(query, pages, params)[0], want, atol=1e-4, rtol=1e-4), name


def test_bind_only_where_a_weight_of_the_shape_is_held():
    k, q = anisotropic()
    x, w = mx.array(k), second_moment(q)
    params = {"mode": "affine"}
    assert score_aware.bind(params, x, 0, "k") is params  # no weighting
    with score_aware.weighting({(0, "k"): w}):
        bound = score_aware.bind(params, x, 0, "k")
        assert bound == params and score_aware.weight_of(bound) is w
        assert json.dumps(bound) == json.dumps(params)  # the header stores the same params
        assert score_aware.bind(params, x, 0, "v") is params  # V is not weighted
        assert score_aware.bind(params, x, 1, "k") is params  # another layer
        assert score_aware.bind(params, x[:1], 0, "k") is params  # another shape


def test_rotated_weight_is_the_weight_in_the_rotated_basis(cpu_device):
    """+rot: the base tier encodes R x under R H R^T, so scores in the rotated basis keep q^T H q's meaning."""
    _, q = anisotropic()
    codec = TIERS["mlx4g32+rot"]
    params = score_aware.with_weight({"rotation": {"kind": "block_hadamard_signs", "block": D, "seed": 7}},
                                     second_moment(q))
    rotated = score_aware.weight_of(score_aware.rotated_weight(params, lambda m: rotate(m, params["rotation"])))
    q_rot = np.array(rotate(mx.array(q), params["rotation"]))
    np.testing.assert_allclose(rotated, second_moment(q_rot), rtol=1e-4, atol=1e-3)
    assert codec.name == "mlx4g32+rot"


def test_zero_weight_head_falls_back_to_nearest():
    k, q = anisotropic()
    w = second_moment(q)
    w[1] = 0  # a KV head no query read
    _, _, plain = encoded("mlx4g32", mx.array(k))
    _, _, weighted = encoded("mlx4g32", mx.array(k), w)
    assert mx.array_equal(plain["codes"][1], weighted["codes"][1])
    assert not mx.array_equal(plain["codes"][0], weighted["codes"][0])


def test_query_moments_pool_each_kv_heads_group():
    """Query head i is read against KV head i // (n_heads / n_kv_heads); each KV head's moment is the mean q q^T
    over its group's heads and positions, summed over calls."""
    rng = np.random.default_rng(1)
    cache = object()
    moments = queries.QueryMoments()
    calls = [rng.standard_normal((1, 4, n, 8)).astype(np.float32) for n in (3, 5)]  # 4 query heads, 2 KV heads
    keys = mx.zeros((1, 2, 8, 8))
    for q in calls:
        moments(mx.array(q), keys, keys, cache, None)
    other = object()
    moments(mx.array(calls[0]), keys, keys, other, None)  # another cache: not in the layers' list
    assert sorted(moments.weights([cache])) == [(0, "k")]
    assert sorted(moments.weights([other, cache])) == [(0, "k"), (1, "k")]
    w = moments.weights([cache])[(0, "k")]
    qs = np.concatenate([q[0] for q in calls], axis=1)  # (4, 8, 8)
    for h in range(2):
        group = qs[2 * h:2 * h + 2].reshape(-1, 8).astype(np.float64)
        np.testing.assert_allclose(w[h], group.T @ group / len(group), rtol=1e-5, atol=1e-6)


def test_prefill_gathers_every_layers_queries(tiny):
    moments, watch = queries.collecting()
    with watch:
        caches = prefill(tiny.model, list(range(100, 140)), step=16)
    w = moments.weights(caches)
    assert sorted(w) == [(0, "k"), (1, "k")]
    assert all(m.shape == (2, 16, 16) and np.all(np.linalg.eigvalsh(m) > -1e-6) for m in w.values())
    assert [moments.counts[id(c)] for c in caches] == [2 * 40, 2 * 40]  # 2 query heads per KV head x 40 positions
    assert not route._WATCHERS


@pytest.fixture(scope="module")
def tiny32(smol_tokenizer):
    """The tiny llama with head_dim 32: one group of the 4-bit tiers."""
    return make_tiny(smol_tokenizer, seed=3, head_dim=32)


def test_build_score_encoder_same_format_different_codes(tiny32, tmp_path):
    """A score-aware build writes the same header keys and component shapes; its K codes differ, V's do not;
    it loads and answers."""
    tiny = tiny32
    doc = "The quick brown fox jumps over the lazy dog. " * 12
    paths = {}
    for enc in ("nearest", "score"):
        paths[enc] = tmp_path / f"{enc}.cart"
        build(doc, paths[enc], model=tiny, tier="mlx4g32+rot", k_encoder=enc, page_size=32)
    a, b = (load(paths[e], model=tiny) for e in ("nearest", "score"))
    assert set(a.info.records) | {K.ENCODERS} == set(b.info.records) and a.info.params == b.info.params
    for layer in range(2):
        ka, kb = (np.asarray(c.prefixes[layer].k_parts["codes"]) for c in (a, b))
        va, vb = (np.asarray(c.prefixes[layer].v_parts["codes"]) for c in (a, b))
        assert ka.shape == kb.shape and not np.array_equal(ka, kb)
        assert np.array_equal(va, vb)
    cache = b.prompt_cache()
    logits = b.model(mx.array(b.question_prompt("Where does the fox jump?", cache))[None], cache=cache)
    assert bool(mx.all(mx.isfinite(logits)))


def test_unknown_k_encoder_refused(tiny, tmp_path):
    with pytest.raises(InputError, match="K encoder 'gptq' is not one of nearest, score"):
        build("text", tmp_path / "x.cart", model=tiny, k_encoder="gptq")
    assert not (tmp_path / "x.cart").exists()


def test_calibrated_build_of_window_layers_encodes_every_stored_layers_k(smol_tokenizer, tmp_path):
    """gemma3's sliding-window layers: a balanced build with k_encoder="score" measures and writes score-aware K on
    the window layers and the full-attention layer alike, V as nearest's, in the same format; it loads and answers."""
    lm = make_model("gemma3_text", smol_tokenizer, num_hidden_layers=4, sliding_window_pattern=4)
    doc = "The lease runs from March 1, 2024. The tenant pays 1,450 euros each month, due on the fifth. " * 4
    built = {enc: build(doc, tmp_path / f"{enc}.cart", model=lm, reserve=0, page_size=32, tier="mlx4g32+rot",
                        k_encoder=enc) for enc in ("nearest", "score")}
    infos = {enc: open_cartridge(r.path) for enc, r in built.items()}
    (a, da), (b, db) = infos["nearest"], infos["score"]
    assert [m.kind for m in b.layers] == ["window"] * 3 + ["attention"]
    assert set(a.records) | {K.ENCODERS} == set(b.records) and a.params == b.params
    for layer in range(4):
        pa, pb = (layer_prefix(info, data, layer, info.layers[layer]) for info, data in ((a, da), (b, db)))
        ka, kb = np.asarray(pa.k_parts["codes"]), np.asarray(pb.k_parts["codes"])
        assert ka.shape == kb.shape and not np.array_equal(ka, kb), layer
        assert np.array_equal(np.asarray(pa.v_parts["codes"]), np.asarray(pb.v_parts["codes"])), layer
    calibrated = build(doc, tmp_path / "balanced.cart", model=lm, reserve=0, page_size=32, preset="balanced",
                       k_encoder="score")
    assert calibrated.calibration["measured_layers"] == 4
    cart = load(calibrated.path, model=lm)
    cache = cart.prompt_cache()
    logits = cart.model(mx.array(cart.question_prompt("When is rent due?", cache))[None], cache=cache)
    assert bool(mx.all(mx.isfinite(logits)))



def test_feedback_factor_is_the_upper_cholesky_factor_of_the_damped_inverse():
    """GPTQ's U: H_damped^-1 = U^T U, U upper triangular with a positive diagonal (the unique such factor)."""
    _, q = anisotropic()
    w = second_moment(q)
    u = score_aware.feedback_factor(w)
    damped = w + score_aware.DAMPING * np.einsum("nii->n", w)[:, None, None] / D * np.eye(D)
    want = np.linalg.cholesky(np.linalg.inv(damped)).transpose(0, 2, 1)
    assert u.dtype == np.float32 and np.all(np.tril(u, -1) == 0) and np.all(np.diagonal(u, axis1=1, axis2=2) > 0)
    np.testing.assert_allclose(u, want, rtol=1e-4, atol=1e-5 * np.abs(want).max())
