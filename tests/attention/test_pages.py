"""encode_pages: a long side encoded a block of whole pages at a time gives, for every tier, the parts one encode
of the whole side gives, bit for bit (cartridge/attention/pages.py)."""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest

from cartridge.attention import pages
from cartridge.tiers import TIERS

N_KV, D, PAGE = 2, 64, 32  # head_dim 64: every tier's group, block and rotation; pages of whole kivi4 groups
T = 5 * PAGE + 7  # 6 pages, the last one partial


def one_shot(codec, x, params):
    """The whole side padded to whole pages, encoded at once and laid out in pages (the unchunked encode)."""
    n_kv, t, _ = x.shape
    x = mx.pad(x, [(0, 0), (0, -t % PAGE), (0, 0)])
    n_pages = x.shape[1] // PAGE
    # (n_kv, n_pages * P, W) -> (n_pages, n_kv, P, W)
    return {name: part.reshape(n_kv, n_pages, PAGE, part.shape[-1]).transpose(1, 0, 2, 3)
            for name, part in codec.encode(x, params).items()}


def raw(a):
    """The bytes of an array (any dtype, bfloat16 included), for a bitwise comparison."""
    return np.array(mx.contiguous(a).view(mx.uint8))


def side(seed=0):
    """(N_KV, T, D) float16 K: random normal, one outlier channel, and a zero token (a zero norm for turbo)."""
    x = mx.random.normal((N_KV, T, D), key=mx.random.key(seed)) * mx.where(mx.arange(D) == 5, 20.0, 1.0)
    return (x * (mx.arange(T) != 40)[:, None]).astype(mx.float16)


@pytest.mark.parametrize("tier", list(TIERS))
def test_blocks_of_pages_encode_as_one_encode(tier, monkeypatch):
    monkeypatch.setattr(pages, "ENCODE_CHUNK", 2 * N_KV * PAGE * D)  # blocks of 2 pages: 3 blocks, the last partial
    codec = TIERS[tier]
    x = side()
    params = codec.make_params(x, 3, "v")
    got = pages.encode_pages(codec, x, params, PAGE)
    want = one_shot(codec, x, params)
    assert sorted(got) == sorted(want) == sorted(c.name for c in codec.components(D))
    for name, part in want.items():
        assert got[name].shape == (6, N_KV, PAGE, part.shape[-1]) and got[name].dtype == part.dtype
        np.testing.assert_array_equal(raw(got[name]), raw(part), err_msg=f"{tier} {name}")


def test_a_side_of_one_block_is_one_encode(monkeypatch):
    """Under ENCODE_CHUNK elements the side is encoded at once and left unevaluated for the caller."""
    codec = TIERS["mlx4g32"]
    x = side(1)
    got = pages.encode_pages(codec, x, {}, PAGE)
    want = one_shot(codec, x, {})
    for name in want:
        np.testing.assert_array_equal(raw(got[name]), raw(want[name]))


@pytest.mark.parametrize("tier", ["nvfp4", "nvfp4+rot"])
def test_statistics_in_blocks_of_tokens_are_the_whole_sides(tier, monkeypatch):
    """nvfp4's global scale (the side's absolute maximum, after the rotation for +rot) taken a block of tokens at a
    time equals the one of the whole side at once; here the maximum lies in the last block."""
    from cartridge.tiers import base, rotation

    monkeypatch.setattr(base, "STATS_BLOCK", 16 * N_KV * D)  # 16 tokens a block: 11 blocks
    codec = TIERS[tier]
    x = side(2) * mx.where(mx.arange(T) == T - 3, 4.0, 1.0)[:, None]
    whole = x.astype(mx.float32)
    if tier.endswith("+rot"):
        whole = rotation.rotate(x, rotation.rotation_params(D, 3, "v"))
    assert codec.make_params(x, 3, "v")["global_scale"] == float(mx.abs(whole).max())


@pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the measured peak is the CPU's")
@pytest.mark.parametrize("tier", ["turbo4", "nvfp4+rot"])
def test_a_long_side_encodes_within_three_times_its_fp16_bytes(tier, monkeypatch):
    """MLX's peak over make_params + encode_pages of a 64-page side, blocks of one page: the input, the output and
    one block's temporaries, under 3x the side's fp16 bytes + the output (one encode of the whole side: 48.5x for
    turbo4 at 131,072 tokens, docs/performance.md "Encode memory")."""
    n_kv, d, page = 8, 128, 64
    monkeypatch.setattr(pages, "ENCODE_CHUNK", n_kv * page * d)
    x = mx.random.normal((n_kv, 64 * page, d), key=mx.random.key(3)).astype(mx.float16)
    mx.eval(x)
    mx.clear_cache()
    codec = TIERS[tier]
    mx.reset_peak_memory()
    held = mx.get_active_memory() - x.nbytes  # arrays earlier tests keep alive count in the peak: not x
    parts = pages.encode_pages(codec, x, codec.make_params(x, 0, "k"), page)
    mx.eval(parts)
    assert mx.get_peak_memory() - held <= 3 * x.nbytes + sum(a.nbytes for a in parts.values())
