"""Per-channel K scaling folded into the query (issue 49 item 3, format 1.11) and V encoded for the attention
output through o_proj (item 4): exact where nothing is rounded, read by every attention path, carried by extend,
save, compose and convert, and the same stored format for V."""

import json
from dataclasses import replace

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from helpers import metal_source
from helpers.fresh_prefill import decode_loop, greedy
from helpers.metal_emulator import emulate_metal_device
from helpers.tiny_models import make_tiny

from cartridge.attention.backends import device, proof
from cartridge.attention.kernels import cpu
from cartridge.attention.prefix import LayerPrefix
from cartridge.calibrate import outputs
from cartridge.errors import InputError
from cartridge.format import keys as K
from cartridge.format.reader import open_cartridge
from cartridge.models.prompt import full_prompt_tokens
from cartridge.read.load import load
from cartridge.tiers import TIERS, key_scale, score_aware
from cartridge.write.build import build

DOC = "The lease runs from March 1, 2024. The tenant pays 1,450 euros each month, due on the fifth. " * 6
QUESTION = "When is the rent due?"
STEPS = 6
TOL = 1e-3 if mx.default_device() == mx.cpu else 1e-2  # float32 on the CPU; a GPU's matmuls round more (H100: 3e-3)


@pytest.fixture(scope="module")
def tiny64(smol_tokenizer):
    """The tiny llama with head_dim 64 (a rotation block and a Metal kernel's head), 4 query heads over 2 KV."""
    return make_tiny(smol_tokenizer, seed=5, head_dim=64)


@pytest.fixture(scope="module")
def carts(tiny64, tmp_path_factory):
    """{(tier, scaled): path} of the document built with and without --k-scale."""
    root = tmp_path_factory.mktemp("scaled")
    out = {}
    for tier in ("fp16", "mlx4g32+rot"):
        for scaled in (False, True):
            out[(tier, scaled)] = root / f"{tier}-{scaled}.cart"
            build(DOC, out[(tier, scaled)], model=tiny64, tier=tier, k_scale=scaled, page_size=64, reserve=0)
    return out


def _decode(cart, n=STEPS, forced=None):
    """(greedy or `forced` tokens, (n, vocab) float32 log-probabilities) of the question and n - 1 decode steps."""
    return decode_loop(cart, cart.question_prompt(QUESTION), n, forced)


def test_choose_balances_key_and_query_second_moments():
    """s_c^4 proportional to E[k_c^2] / E[q_c^2] (Cauchy-Schwarz under a rotation), geometric mean 1 per head,
    a channel no query reads shrunk MAX_SCALE times beyond the others, no further."""
    k2 = np.array([[4.0, 1.0, 16.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    q2 = np.array([[1.0, 1.0, 1.0, 16.0], [1.0, 0.0, 1.0, 1.0]])
    keys = np.sqrt(k2)[:, None, :] * np.array([[1.0], [-1.0]])  # two tokens of +-sqrt(E[k^2])
    moment = np.zeros((2, 4, 4))
    moment[:, range(4), range(4)] = q2
    s = key_scale.choose(moment, keys)
    want = (k2[0] / q2[0]) ** 0.25
    np.testing.assert_allclose(s[0], want / np.exp(np.log(want).mean()), rtol=1e-6)
    np.testing.assert_allclose(np.exp(np.log(s).mean(axis=1)), [1.0, 1.0], rtol=1e-6)
    assert s[1, 1] / s[1, 0] == pytest.approx(key_scale.MAX_SCALE, rel=1e-5) and s.dtype == np.float32


def test_scaling_lowers_the_score_error_of_a_rotated_tier():
    """K with a large channel that queries barely read: K / s under mlx4g32+rot, read with q * s, gives a lower
    expected score error on queries not used to choose s than K itself."""
    rng = np.random.default_rng(1)
    n_kv, t, d = 2, 256, 64
    k = rng.standard_normal((n_kv, t, d)).astype(np.float32)
    k[..., :4] *= 20  # loud key channels
    q = rng.standard_normal((n_kv, 8192, d)).astype(np.float32)
    q[..., :4] *= 0.05  # that the queries hardly read
    moment = np.einsum("nqd,nqe->nde", q[:, :4096], q[:, :4096]) / 4096
    held_out = np.einsum("nqd,nqe->nde", q[:, 4096:], q[:, 4096:]) / 4096
    s = key_scale.choose(moment, k)
    codec = TIERS["mlx4g32+rot"]

    def round_trip(x):
        params = codec.make_params(mx.array(x), 0, "k")
        return np.array(codec.decode(codec.encode(mx.array(x), params), params))

    plain = score_aware.score_error(k, round_trip(k), held_out)
    scaled = score_aware.score_error(k, round_trip(k / s[:, None, :]) * s[:, None, :], held_out)
    assert scaled < 0.5 * plain, (scaled, plain)


def test_scaled_build_records_format_1_11_and_answers_as_a_fresh_prefill(tiny64, carts):
    """fp16 with --k-scale: every attention layer's K codec_version 2 and its scale; K / s rounded to fp16 costs
    what fp16 itself costs: the greedy answer is a fresh mlx-lm prefill's, log-probabilities the unscaled one's."""
    info, _ = open_cartridge(carts[("fp16", True)])
    assert info.format_version == "1.11" and sorted(info.key_scales) == [0, 1]
    for layer in (0, 1):
        assert info.key_scales[layer].shape == (2, 64)
        assert info.records[K.layer_codec_version(layer, "k")] == b"2"
        assert info.records[K.layer_codec_version(layer, "v")] == b"1"
    plain, _ = open_cartridge(carts[("fp16", False)])
    assert plain.key_scales == {} and K.layer_key_scale(0) not in plain.records
    scaled_cart = load(carts[("fp16", True)], model=tiny64, attention="portable")
    tokens, rows = _decode(scaled_cart)
    prompt = full_prompt_tokens(tiny64.tokenizer, DOC, QUESTION)
    assert tokens == greedy(tiny64.model, tiny64.tokenizer, prompt, STEPS)
    _, plain_rows = _decode(load(carts[("fp16", False)], model=tiny64, attention="portable"), forced=tokens)
    assert np.abs(rows - plain_rows).max() < 2 * TOL


def _paths(tiny64, path, monkeypatch):
    """{name: a cartridge loaded on that attention path} for the paths this machine runs."""
    out = {"dequantize-once": load(path, model=tiny64, attention="dequantize-once")}
    if device() == "cuda":  # the CUDA kernels over the stored pages (DEVICE=gpu on an NVIDIA GPU)
        out["cuda"] = load(path, model=tiny64, attention="fused")
        assert all(p.backend is not None for p in out["cuda"].prefixes)
    if device() == "cpu":
        by_hand = load(path, model=tiny64, attention="portable")
        by_hand.prefixes = [replace(p, backend=cpu.QuestionPrefill()) for p in by_hand.prefixes]
        out["cpu"] = by_hand
    return out


def test_every_attention_path_multiplies_the_queries_by_the_scale(tiny64, carts, monkeypatch):
    """mlx4g32+rot with --k-scale: dequantize-once, the CPU's question prefill, the CUDA kernels (on a CUDA device)
    and the Metal kernels (CPU emulator) give the portable path's log-probabilities; the same pages read without the scale give others (the check
    can fail)."""
    path = carts[("mlx4g32+rot", True)]
    portable = load(path, model=tiny64, attention="portable")
    tokens, want = _decode(portable)
    for name, cart in _paths(tiny64, path, monkeypatch).items():
        _, got = _decode(cart, forced=tokens)
        assert np.abs(got - want).max() < TOL, name
    unscaled = load(path, model=tiny64, attention="portable")
    unscaled.prefixes = [replace(p, key_scale=None) for p in unscaled.prefixes]
    _, wrong = _decode(unscaled, forced=tokens)
    assert np.abs(wrong - want).max() > 3 * TOL  # 0.06 measured on the CPU
    if metal_source.compiler() is not None:
        emulate_metal_device(monkeypatch)
        monkeypatch.setattr(proof, "_warned", set())
        with pytest.warns(proof.KernelProofWarning):
            metal = load(path, model=tiny64, attention="fused")
        assert [type(p.backend).__name__ for p in metal.prefixes] == ["MetalInputs"] * 2
        _, got = _decode(metal, n=3, forced=tokens)
        assert np.abs(got - want[:3]).max() < TOL


def _logprobs(cart, cache, tokens):
    """Float32 numpy log-probabilities of the last position after feeding `tokens` to `cache`."""
    logits = cart.model(mx.array(tokens)[None], cache=cache)[0, -1].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits))


def test_extend_save_compose_and_convert_carry_the_scale(tiny64, carts, tmp_path):
    """Each operation that makes a cartridge from a scaled one keeps K / s under the same scale (the new tokens'
    too) and answers as the same operation on the unscaled cartridge, within fp16 rounding."""
    out = {}
    for scaled in (False, True):
        src = carts[("fp16", scaled)]
        out[("extend", scaled)] = cartridge.extend(src, "The deposit is two months of rent.",
                                                   tmp_path / f"e{scaled}.cart", model=tiny64).path
        out[("convert", scaled)] = cartridge.convert(src, tmp_path / f"c{scaled}.cart", tier="int8").path
        cart = load(src, model=tiny64)
        cache = cart.prompt_cache()
        prompt = cart.question_prompt(QUESTION)
        cart.model(mx.array(prompt)[None], cache=cache)
        out[("save", scaled)] = cart.save(tmp_path / f"s{scaled}.cart", cache, tokens=prompt).path
    for op in ("extend", "convert", "save"):
        plain, scaled = (open_cartridge(out[(op, s)])[0] for s in (False, True))
        assert plain.key_scales == {} and sorted(scaled.key_scales) == [0, 1], op
        for layer in (0, 1):
            np.testing.assert_array_equal(scaled.key_scales[layer], open_cartridge(carts[("fp16", True)])[0]
                                          .key_scales[layer])
            assert scaled.records[K.layer_codec_version(layer, "k")] == b"2", op
        rows = [_logprobs(c, c.prompt_cache(), c.question_prompt("Who pays?"))
                for c in (load(out[(op, s)], model=tiny64, attention="portable") for s in (False, True))]
        assert np.abs(rows[1] - rows[0]).max() < (2e-2 if op == "convert" else 2e-3), op
    composed = [cartridge.load_many([carts[("fp16", False)], carts[("fp16", s)]], model=tiny64) for s in (False, True)]
    rows = [_logprobs(c, c.prompt_cache(), c.question_prompt(QUESTION)) for c in composed]
    assert np.abs(rows[1] - rows[0]).max() < 2e-3


@pytest.mark.filterwarnings("ignore::cartridge.promptcache.exporter.MlxLoadWarning")  # an in-memory model: no folder
def test_export_writes_the_models_own_keys(carts, tmp_path):
    """The exported mlx-lm prompt cache holds K, not K / s: the unscaled fp16 cartridge's export within fp16."""
    from mlx_lm.models.cache import load_prompt_cache
    got = []
    for scaled in (False, True):
        out = tmp_path / f"{scaled}.safetensors"
        cartridge.export_prompt_cache(carts[("fp16", scaled)], out)
        got.append(load_prompt_cache(str(out)))
    for plain, scaled in zip(*got):
        np.testing.assert_allclose(np.array(scaled.keys, dtype=np.float32), np.array(plain.keys, dtype=np.float32),
                                   rtol=2e-3, atol=2e-3)


def test_output_weights_are_each_kv_heads_o_proj_gram(tiny64):
    """G = sum over a KV head's query heads h of W_h^T W_h, W_h the o_proj columns of head h, mean diagonal 1."""
    w = outputs.output_weights(tiny64.model, ["attention", "attention"], [(2, 64), (2, 64)])
    assert sorted(w) == [(0, "v"), (1, "v")]
    o = np.array(tiny64.model.model.layers[1].self_attn.o_proj.weight, dtype=np.float64)  # (hidden, 4 * 64)
    heads = [o[:, h * 64:(h + 1) * 64] for h in range(4)]
    want = np.stack([heads[0].T @ heads[0] + heads[1].T @ heads[1], heads[2].T @ heads[2] + heads[3].T @ heads[3]])
    want /= (np.einsum("nii->n", want) / 64)[:, None, None]
    np.testing.assert_allclose(w[(1, "v")], want, rtol=1e-5)
    assert outputs.output_weights(tiny64.model, ["window", "attention"], [(2, 64), (2, 64)]).keys() == {(1, "v")}


def test_output_v_encoder_changes_v_codes_only_same_format(tiny64, tmp_path):
    built = {}
    for enc in ("nearest", "output"):
        built[enc] = tmp_path / f"{enc}.cart"
        build(DOC, built[enc], model=tiny64, tier="mlx4g32", v_encoder=enc, page_size=64, reserve=0)
    a, b = (load(built[e], model=tiny64) for e in ("nearest", "output"))
    assert set(a.info.records) | {K.ENCODERS} == set(b.info.records) and a.info.params == b.info.params
    assert json.loads(b.info.records[K.ENCODERS]) == {"k": "nearest", "v": "output"}
    assert b.info.key_scales == {}
    for layer in range(2):
        pa, pb = a.prefixes[layer], b.prefixes[layer]
        assert all(mx.array_equal(pa.k_parts[c], pb.k_parts[c]) for c in pa.k_parts)
        assert not mx.array_equal(pa.v_parts["codes"], pb.v_parts["codes"])


def test_encoder_options_are_checked_before_any_work(tiny64, tmp_path):
    with pytest.raises(InputError, match="V encoder 'gptq' is not one of nearest, output"):
        build("text", tmp_path / "x.cart", model=tiny64, v_encoder="gptq")
    with pytest.raises(InputError, match="k_scale is 'yes'; expected True or False"):
        build("text", tmp_path / "x.cart", model=tiny64, k_scale="yes")
    assert not (tmp_path / "x.cart").exists()


def test_calibrated_presets_encode_score_aware_and_scaled_unless_told(tiny64, tmp_path):
    """balanced / compact measured at build: K scaled and score-aware (`PRESET_ENCODING`); --no-calibrate, a tier
    given, or the encoders named keep nearest rounding without a scale."""
    doc = DOC * 2
    runs = {"preset": dict(preset="balanced"), "named": dict(preset="balanced", k_encoder="nearest", k_scale=False),
            "fixed": dict(preset="balanced", calibrate=False), "tier": dict(tier="mlx4g32+rot")}
    info = {}
    for name, kw in runs.items():
        build(doc, tmp_path / f"{name}.cart", model=tiny64, page_size=64, reserve=0, **kw)
        info[name] = open_cartridge(tmp_path / f"{name}.cart")[0]
    assert sorted(info["preset"].key_scales) == [0, 1]
    assert info["named"].key_scales == info["fixed"].key_scales == info["tier"].key_scales == {}


def test_generate_step_over_a_scaled_cache_across_tail_chunks_is_a_fresh_prefill(tiny64, carts):
    """mlx-lm's own generate_step over the scaled fp16 cartridge, its tail in chunks of 4 tokens (the question and
    12 answer tokens cross them), picks a fresh mlx-lm prefill's greedy tokens, with the log-probabilities of the same
    loop over mlx-lm's own KVCache of the document rounded to fp16 (the harness's control, which picks them too)."""
    from mlx_lm.generate import generate_step
    from helpers.fresh_prefill import mlx_cache

    from cartridge.attention.caches import CartridgeCache, PromptCache

    cart = load(carts[("fp16", True)], model=tiny64, attention="portable")
    prompt = full_prompt_tokens(tiny64.tokenizer, DOC, QUESTION)
    want = greedy(tiny64.model, tiny64.tokenizer, prompt, 12)
    n = len(cart.info.tokens)
    assert prompt[:n] == cart.info.tokens.tolist()

    def loop(cache):
        steps = list(generate_step(mx.array(prompt[n:]), tiny64.model, max_tokens=12, prompt_cache=cache))
        return [int(t) for t, _ in steps], np.stack([np.array(p.astype(mx.float32)) for _, p in steps])

    chunked = PromptCache([CartridgeCache(p, chunk_size=4) for p in cart.prefixes], n)
    tokens, rows = loop(chunked)
    assert tokens == want and chunked[0].tail_len > 2 * chunked[0].chunk_size
    control_tokens, control = loop(mlx_cache(tiny64.model, prompt[:n], stored=mx.float16))
    assert control_tokens == want
    assert np.abs(rows - control).max() < 2 * TOL  # the same fp16-rounded K, read through the scale
