"""The attention policy (cartridge/attention/policy.py): `resolve` checks a policy name for this device, `place`
makes each layer's choice and says why, per layer and for the whole prefix. The memory budget's part of `place` is
tests/attention/test_budget.py's; the fused kernels' proof, test_backends.py's."""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from cartridge.attention.layers import StateLayer
from cartridge.attention.pages import make_prefix
from cartridge.attention.policy import place, resolve
from cartridge.errors import InputError
from cartridge.tiers import TIERS

N_KV, D, T, PAGE = 2, 32, 40, 16  # 3 pages, the last one padded
ON_CPU = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the table entries are the CPU's")


def _layers(*tiers):
    """One page-attended layer of random K/V per tier name."""
    out = []
    for i, tier in enumerate(tiers):
        k, v = (mx.random.normal((N_KV, T, D), key=mx.random.key(2 * i + s)) for s in range(2))
        out.append(make_prefix(TIERS[tier], k, TIERS[tier], v, PAGE, layer=i))
    return out


def _entry(tier, us):
    """A CPU table entry of `tier` measured at 256 tokens: {policy: microseconds a decode step}."""
    return {"backend": "cpu", "tier": tier, "head_dim": D, "mode": "decode", "context": 256,
            "policy": min(us, key=us.get), "us": us, "dense_us": 1.5, "machine": "m", "measured": "d"}


@pytest.mark.parametrize("name", ["auto", "portable", "dequantize-once"])
def test_resolve_keeps_a_policy_every_device_runs(name):
    assert resolve(name) == name


def test_resolve_refuses_an_unknown_policy_naming_the_policies():
    with pytest.raises(InputError) as e:
        resolve("fastest")
    assert str(e.value) == "attention policy 'fastest' is unknown; choose one of auto, fused, portable, dequantize-once"


def test_portable_reads_every_layers_stored_pages_as_asked():
    layers = _layers("mlx4g32", "fp16")
    out, report = place(list(layers), "portable", mx.float32, [(D, D)] * 2)
    for got, stored in zip(out, layers):
        assert (got.k_codec, got.v_codec, got.backend) == (stored.k_codec, stored.v_codec, None)
        assert got.k_parts is stored.k_parts and got.v_parts is stored.v_parts  # the stored arrays, no copy
    assert report["layers"] == [{"layer": i, "policy": "portable", "reason": "portable: asked for"} for i in (0, 1)]
    assert (report["policy"], report["reason"]) == ("portable", "portable: asked for")
    stored_bytes = sum(p.nbytes for p in layers)
    assert report["memory"] == {"budget_bytes": None, "stored_bytes": stored_bytes, "resident_bytes": stored_bytes,
                                "planned_peak_bytes": stored_bytes}


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32])
def test_dequantize_once_without_a_limit_decodes_both_sides_of_every_layer_to_the_models_dtype(dtype):
    layers = _layers("fp16", "mlx4g32")
    out, report = place(list(layers), "dequantize-once", dtype, [(D, D)] * 2)
    for got, stored in zip(out, layers):
        for codec, parts, want in ((got.k_codec, got.k_parts, stored.k_codec.decode(stored.k_parts, stored.k_params)),
                                   (got.v_codec, got.v_parts, stored.v_codec.decode(stored.v_parts, stored.v_params))):
            assert codec.name == "dequantized"
            assert parts["values"].dtype == dtype and parts["values"].shape == (3, N_KV, PAGE, D)
            np.testing.assert_allclose(np.array(parts["values"].astype(mx.float32)),
                                       np.array(want.astype(dtype).astype(mx.float32)), rtol=1e-3, atol=1e-3)
    assert [x["policy"] for x in report["layers"]] == ["dequantize-once"] * 2
    assert report["reason"] == "dequantize-once: asked for" and report["memory"]["budget_bytes"] is None


@ON_CPU
def test_auto_chooses_each_layer_by_its_own_tiers_and_reports_the_mix():
    layers = _layers("fp16", "mlx4g32")
    entries = [_entry("fp16", {"portable": 2.0, "dequantize-once": 1.0}),
               _entry("mlx4g32", {"portable": 1.0, "dequantize-once": 3.0})]
    out, report = place(list(layers), "auto", mx.float32, [(D, D)] * 2, max_memory=10**9, entries=entries)
    assert [(p.k_codec.name, p.v_codec.name) for p in out] == [("dequantized", "dequantized"), ("mlx4g32", "mlx4g32")]
    first = "dequantize-once: 0.50x portable, 0.67x dense at 256 tokens (fp16, head_dim 32), measured d on m"
    second = "portable: 0.33x dequantize-once, 0.67x dense at 256 tokens (mlx4g32, head_dim 32), measured d on m"
    assert report["layers"] == [{"layer": 0, "policy": "dequantize-once", "reason": first},
                                {"layer": 1, "policy": "portable", "reason": second}]
    assert report["policy"] == "mixed"
    assert report["reason"] == "dequantize-once on 1 layer, portable on 1 layer; " + first


@ON_CPU
def test_auto_without_a_measurement_takes_the_devices_default_and_says_so():
    entries = [_entry("int8", {"portable": 1.0})]
    out, report = place(_layers("fp16"), "auto", mx.float32, [(D, D)], entries=entries)
    assert out[0].k_codec.name == "dequantized"  # the CPU's default (backends.devices())
    assert report["layers"] == [{"layer": 0, "policy": "dequantize-once",
                                 "reason": "dequantize-once: no measurement of fp16 on cpu in the auto table; "
                                           "the default there"}]


def test_a_layer_that_is_not_page_attended_passes_through_with_no_choice():
    attended = _layers("int8")[0]
    state = StateLayer(2, {0: mx.zeros((1, 4, 8)), 1: mx.ones((1, 8))})
    out, report = place([attended, state], "portable", mx.float32, [(D, D), None])
    assert out[1] is state
    assert report["layers"] == [{"layer": 0, "policy": "portable", "reason": "portable: asked for"}, None]
    assert report["memory"]["stored_bytes"] == attended.nbytes + state.nbytes
