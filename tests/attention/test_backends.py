"""The attention-backend seam: kernel layouts declared by the codecs, the backend registry, the proof gate."""

import re
import sys
import types
import warnings
from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import pytest

from cartridge.attention import auto_table, backends, policy
from cartridge.attention.backends import metal, proof
from cartridge.attention.backends.base import AttentionBackend
from cartridge.attention.pages import make_prefix
from cartridge.attention.policy import DEQUANTIZED
from cartridge.errors import InputError
from cartridge.tiers import TIERS, layout as L

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _on_the_cpu():
    """These tests describe the CPU machine (fake CPU kernels, the CPU's defaults); under DEVICE=gpu
    (tests/conftest.py) they run on the CPU too, as they did not before (7 failed on an H200, 2026-12-03)."""
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


def test_every_codec_declares_the_kernel_layout_the_cuda_kernels_read():
    """The ids, bits and component order are the ones flash_decode.cuh's tiers take (kernels/cuda.py's former
    FUSED_TIERS table); a rotated tier reads as its base."""
    want = {"fp16": (L.FP16, 0, ("values",)), "bf16": (L.BF16, 0, ("values",)),
            "int8": (L.AFF8, 0, L.AFFINE), "int6": (L.AFF6, 0, L.AFFINE), "mlx4g32": (L.AFF4, 0, L.AFFINE),
            "fp8": (L.MXFP8, 0, ("codes", "scales")), "turbo4": (L.TURBO, 4, ("codes", "norms")),
            "turbo3": (L.TURBO, 3, ("codes", "norms")), "turbo2": (L.TURBO, 2, ("codes", "norms")),
            "mxfp4": (L.MXFP4, 0, ("codes", "scales")), "nvfp4": (L.NVFP4, 0, ("codes", "scales")),
            "kivi4": (L.KIVI4, 0, L.AFFINE)}
    got = {name: L.layout_of(codec) for name, codec in TIERS.items()}
    for name, layout in got.items():
        base = name.removesuffix("+rot")
        assert (layout.tier_id, layout.bits, layout.components) == want[base], name
        assert set(layout.components) <= {c.name for c in TIERS[name].components(64)}, name
    assert all(TIERS[n].kernel_layout is None for n in TIERS if n.endswith("+rot"))  # only through .base
    assert (L.FP16, L.KIVI4) == (0, 10)


def test_dense_pages_take_their_dtypes_layout_and_none_without_pages():
    assert L.layout_of(DEQUANTIZED) is None
    for dtype, tid in ((mx.float16, L.FP16), (mx.bfloat16, L.BF16), (mx.float32, L.F32)):
        assert L.layout_of(DEQUANTIZED, {"values": mx.zeros((1, 1, 16, 64), dtype=dtype)}).tier_id == tid
    assert L.layout_of(DEQUANTIZED, {"values": mx.zeros((1,), dtype=mx.int8)}) is None


# --- the registry -----------------------------------------------------------------------------------------

def test_the_registry_lists_each_backend_once_and_the_devices_defaults():
    names = [b.name for b in backends.REGISTRY]
    assert names == ["portable", "dense", "cpu", "cuda", "metal"]
    assert backends.devices() == {"cpu": "dequantize-once", "cuda": "fused", "metal": "portable"}
    assert auto_table.FALLBACK == backends.devices()
    assert backends.device() == "cpu"  # this machine's tests run on the CPU
    assert backends.kernel("cpu") is None and backends.policies(False) == ("portable", "dequantize-once")
    assert [b.name for b in backends.REGISTRY if b.needs_proof] == ["metal"]


def test_policy_and_auto_table_name_no_backend_except_as_data():
    for path in ("cartridge/attention/policy.py", "cartridge/attention/auto_table.py"):
        text = (ROOT / path).read_text()
        assert '"cuda"' not in text and '"metal"' not in text, path


def test_fused_is_refused_where_no_kernel_runs():
    with pytest.raises(InputError, match=r"no fused attention kernel runs on this device \(cpu\); they run on: "
                                         r"cuda, metal"):
        policy.resolve("fused")


def test_metal_is_unavailable_here_and_when_its_module_is_missing(monkeypatch):
    assert not metal.METAL.available()  # mx.metal.is_available() is False on this machine
    monkeypatch.setattr(metal.METAL, "is_current", lambda: True)
    monkeypatch.setitem(sys.modules, metal.MODULE, None)  # import of it raises ImportError
    assert metal.kernels() is None
    assert not metal.METAL.available()
    assert not metal.METAL.supports(None, 64, "decode")


def test_metal_entry_uses_the_kernel_modules_contract(monkeypatch):
    calls = []
    fake = types.ModuleType(metal.MODULE)
    fake.available = lambda: True
    fake.supported = lambda prefix, head_dim, mode: calls.append((head_dim, mode)) or head_dim == 64
    fake.lay_out = lambda prefix: calls.append(prefix) or "record"
    fake.attend = lambda record, prefix, *args: calls.append((record, prefix, len(args))) or "out"
    monkeypatch.setitem(sys.modules, metal.MODULE, fake)
    monkeypatch.setattr(metal.METAL, "is_current", lambda: True)
    assert metal.METAL.available()
    assert metal.METAL.supports("p", 64, "decode") and not metal.METAL.supports("p", 96, "prefill")
    assert metal.METAL.build("p") == "record"
    assert metal.METAL.attend("record", "p", "q", "tail", 0.125, None, "scratch") == "out"
    assert calls == [(64, "decode"), (96, "prefill"), "p", ("record", "p", 5)]


# --- the proof gate, exercised with fake backends (the only kernels that can run on this machine) ----------

def _reference(prefix, queries, tail, scale):
    """Dense attention over the decoded prefix and the tail: what a correct kernel returns."""
    p = policy.dequantize(prefix, mx.float32)
    n = p.n_tokens

    def side(x):  # (n_pages, n_kv, P, D) -> (1, n_kv, n, D)
        return x.transpose(1, 0, 2, 3).reshape(x.shape[1], -1, x.shape[-1])[None, :, :n]
    tk, tv = tail.kv()
    k = mx.concatenate([side(p.k_parts["values"]), tk[None].astype(mx.float32)], axis=2)
    v = mx.concatenate([side(p.v_parts["values"]), tv[None].astype(mx.float32)], axis=2)
    out = mx.fast.scaled_dot_product_attention(queries.astype(mx.float32), k, v, scale=scale)
    return out.astype(queries.dtype)


class FakeKernel(AttentionBackend):
    """A fused kernel on the CPU that needs proof: right, wrong (x 1.5) or failing to build."""

    device = "cpu"
    policy = "fused"
    needs_proof = True

    def __init__(self, name, how):
        self.name, self.how, self.builds = name, how, 0

    def supports(self, prefix, head_dim, mode):
        return None not in (L.layout_of(prefix.k_codec, prefix.k_parts), L.layout_of(prefix.v_codec, prefix.v_parts))

    def build(self, prefix):
        self.builds += 1
        if self.how == "raises":
            raise RuntimeError("kernel failed to compile: undeclared identifier 'simd_sum'")
        return FakeRecord(self.name)

    def attend(self, record, prefix, queries, tail, scale, sinks, scratch):
        out = _reference(prefix, queries, tail, scale)
        return out * 1.5 if self.how == "wrong" else out


class FakeRecord:
    """A fake backend's record of a layer: its name only."""

    def __init__(self, name):
        self.name = name


@pytest.fixture
def fake(monkeypatch, tmp_path):
    """Register a fake kernel entry first in the registry; a fresh user table; returns a factory."""
    monkeypatch.setenv("CARTRIDGE_AUTO_TABLE", str(tmp_path / "auto-table.json"))
    monkeypatch.setattr(proof, "_warned", set())
    monkeypatch.setattr(proof, "_failed", set())

    def make(how):
        entry = FakeKernel(f"fake-{how}", how)
        monkeypatch.setattr(backends, "REGISTRY", [entry, *backends.REGISTRY])
        return entry
    return make


def _layer(tier="mlx4g32", n=300, D=64):
    k1, k2 = mx.random.split(mx.random.key(7))
    k = mx.random.normal((2, n, D), key=k1).astype(mx.float16)
    v = mx.random.normal((2, n, D), key=k2).astype(mx.float16)
    return make_prefix(TIERS[tier], k, TIERS[tier], v, 64)


FUSED_FASTEST = [{"backend": "cpu", "tier": "mlx4g32", "head_dim": 64, "mode": "decode", "context": 300,
                  "policy": "fused", "us": {"fused": 1.0, "portable": 5.0, "dequantize-once": 4.0}, "dense_us": 2.0,
                  "machine": "test", "measured": "2026-12-03"}]


def _place(layer):
    out, report = policy.place([layer], "auto", mx.float32, [(64, 64)], entries=FUSED_FASTEST)
    return out[0], report


def test_a_kernel_that_matches_is_proven_once_recorded_and_then_chosen(fake):
    entry = fake("right")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning
        layer, report = _place(_layer())
        assert isinstance(layer.backend, FakeRecord) and report["policy"] == "fused"
        builds = entry.builds  # the check's small case, its timing, the layer's kernel
        _place(_layer())
    assert entry.builds == builds + 1  # the second load builds the layer's kernel only: no new check
    rec = auto_table.find_proof("fake-right", ("mlx4g32", "mlx4g32"), 64)
    assert rec["ok"] and rec["error"] is None and rec["rel_err"] < proof.TOL and rec["context"] == 300
    assert set(rec["us"]) == {"fused", "portable"} and rec["dense_us"] > 0
    table = auto_table.read_table(auto_table.user_table_path())  # its times, as decode entries for auto
    assert [(e["backend"], e["tier"], e["head_dim"], e["mode"], set(e["us"])) for e in table] == \
        [("cpu", "mlx4g32", 64, "decode", {"fused", "portable"})]
    assert policy._allowed_by_name(("mlx4g32", "mlx4g32"), 64) == ("fused", "portable", "dequantize-once")
    assert policy._allowed_by_name(("int8", "int8"), 64) == ("portable", "dequantize-once")  # never checked


@pytest.mark.parametrize("how, why", [("wrong", r"relative error 5\.0\de-01 against the portable path"),
                                       ("raises", "RuntimeError: kernel failed to compile")])
def test_a_kernel_that_fails_its_check_warns_once_and_takes_the_portable_path(fake, how, why):
    entry = fake(how)
    with pytest.warns(proof.KernelProofWarning) as seen:
        layer, report = _place(_layer())
    assert len(seen) == 1
    assert re.search(f"fake-{how} attention kernel for mlx4g32 at head_dim 64 failed its check on this machine "
                     f"\\({why}.*\\); those layers take the portable path", str(seen[0].message))
    assert layer.backend is None and report["policy"] != "fused"
    builds = entry.builds
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the stored failure: no second check, no second warning
        layer, _ = _place(_layer())
    assert layer.backend is None and entry.builds == builds
    rec = auto_table.find_proof(f"fake-{how}", ("mlx4g32", "mlx4g32"), 64)
    assert not rec["ok"] and rec["us"] is None
    assert auto_table.read_table(auto_table.user_table_path()) == []  # no times from a failed proof
    assert policy._allowed_by_name(("mlx4g32", "mlx4g32"), 64) == ("portable", "dequantize-once")


def test_fused_runs_a_kernel_never_checked_and_says_so_once(fake):
    entry = fake("wrong")
    assert policy.resolve("fused") == "fused"
    with pytest.warns(proof.KernelProofWarning, match=r"fake-wrong attention kernel for mlx4g32 at head_dim 64 was "
                                                      r"never checked on this machine"):
        record = policy.backend_for("fused", _layer(), 64)
    assert record is not None and entry.builds == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert policy.backend_for("fused", _layer(), 64) is not None  # once per process
    assert auto_table.find_proof("fake-wrong", ("mlx4g32", "mlx4g32"), 64) is None  # "fused" proves nothing


def test_an_unwritable_table_keeps_the_proof_for_this_process(fake, monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("CARTRIDGE_AUTO_TABLE", str(blocker / "auto-table.json"))  # its folder is a file
    monkeypatch.setattr(auto_table, "_SESSION_PROOFS", [])
    fake("raises")
    with pytest.warns(proof.KernelProofWarning):
        _place(_layer())
    assert not auto_table.find_proof("fake-raises", ("mlx4g32", "mlx4g32"), 64)["ok"]


def test_calibrate_checks_each_tier_the_kernel_reads_and_prints_the_checks(fake):
    from cartridge.cli.bench import _check_lines, _kernel_checks

    entry = fake("wrong")
    records = _kernel_checks(["fp16", "kivi4", "turbo2"], (6, 2, 64), 300, None)
    assert [(r["tiers"], r["ok"]) for r in records] == [(["fp16", "fp16"], False), (["kivi4", "kivi4"], False),
                                                        (["turbo2", "turbo2"], False)]
    assert [p["tiers"][0] for p in auto_table.proofs()] == ["fp16", "kivi4", "turbo2"]
    text = _check_lines(records)
    assert text[2].split()[:5] == ["fake-wrong", "fp16", "64", "300", "NO"]
    assert text[2].split()[6:9] == ["-", "-", "-"] and "relative error" in text[2]
    backends.REGISTRY.remove(entry)  # the CPU's own backends need no proof: nothing to check
    assert _kernel_checks(["fp16"], (6, 2, 64), 300, None) == []


def test_a_bench_table_keeps_the_proofs(fake, tmp_path):
    fake("raises")
    with pytest.warns(proof.KernelProofWarning):
        _place(_layer())
    path = auto_table.user_table_path()
    auto_table.write_bench_table({"version": 1, "entries": FUSED_FASTEST}, path)
    assert auto_table.read_table(path) == FUSED_FASTEST
    assert [p["backend"] for p in auto_table.proofs()] == ["fake-raises"]


def test_tail_chunks_are_the_caches_own_chunks_holding_the_tail():
    cache = proof._cache(_layer(), None, mx.arange(2 * 3 * 64, dtype=mx.float16).reshape(1, 2, 3, 64))
    k_chunks, v_chunks = cache.tail_chunks
    assert len(k_chunks) == len(v_chunks) == 1 and k_chunks[0].shape == (1, 2, cache.chunk_size, 64)
    assert k_chunks[0][0, 1, 2, 63].item() == 2 * 3 * 64 - 1 and cache.tail_len == 3
    assert k_chunks is cache.state[0]  # the same lists mlx-lm's `state` hands out, not copies
