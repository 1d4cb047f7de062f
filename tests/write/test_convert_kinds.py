"""convert() of models with other layer kinds than "attention": a sliding-window layer's stored window is
re-encoded like an attention layer's pages (its window, start and count records kept), a recurrent state
layer's arrays are copied as stored; the result equals a direct build in that tier, byte for byte, when the
model computes its K/V in fp16 (as tests/write/test_convert.py shows for attention-only models).

Tiny random-weight models (tests/helpers/family_models.py): gemma3_text (window 16 on layers 0 and 2, full
attention on 1 and 3) and lfm2 (recurrent state on layers 0 and 2, full attention on 1 and 3).
"""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import pytest
from helpers.family_models import DOC, WINDOW, make_model

from cartridge.format.layout import DATA_NAME, INDEX_NAME, MANIFEST_NAME
from cartridge.models.loader import LoadedModel, fingerprint

KINDS = {"gemma3_text": ["window", "attention"] * 2, "lfm2": ["state", "attention"] * 2}


@pytest.fixture(scope="module", params=sorted(KINDS))
def model16(request, smol_tokenizer):
    """(family, the tiny model with its weights, and so its K/V, in float16)."""
    lm = make_model(request.param, smol_tokenizer)
    lm.model.set_dtype(mx.float16)
    mx.eval(lm.model.parameters())
    return request.param, LoadedModel(lm.model, lm.tokenizer, lm.ref, fingerprint(lm.model, lm.tokenizer))


def _files(path):
    return {name: (path / name).read_bytes() for name in (MANIFEST_NAME, INDEX_NAME, DATA_NAME)}


@pytest.mark.parametrize("options", [{"tier": "mlx4g32"}, {"tier": "int8"}, {"preset": "balanced"}])
def test_convert_equals_direct_build_bytes(model16, tmp_path, options):
    family, lm = model16
    src = cartridge.build(DOC, tmp_path / "src.cart", model=lm, page_size=32)
    direct = cartridge.build(DOC, tmp_path / "direct.cart", model=lm, page_size=32, calibrate=False, **options)
    conv = cartridge.convert(src.path, tmp_path / "conv.cart", **options)
    info, _ = cartridge.open_cartridge(conv.path)
    assert [m.kind for m in info.layers] == KINDS[family]
    assert _files(tmp_path / "conv.cart") == _files(tmp_path / "direct.cart")
    assert (conv.bytes, conv.bytes_per_token, conv.schema) == (direct.bytes, direct.bytes_per_token, direct.schema)
    assert cartridge.verify_cartridge(conv.path).ok


def test_window_records_kept_and_pages_re_encoded(smol_tokenizer, tmp_path):
    lm = make_model("gemma3_text", smol_tokenizer)  # float32: convert starts from the fp16 pages
    src = cartridge.build(DOC, tmp_path / "src.cart", model=lm, page_size=32)
    conv = cartridge.convert(src.path, tmp_path / "conv.cart", tier="mlx4g32")
    (si, _), (ci, _) = (cartridge.open_cartridge(p) for p in (src.path, conv.path))
    assert [(m.kind, m.window, m.start, m.count) for m in ci.layers] == [
        (m.kind, m.window, m.start, m.count) for m in si.layers]
    assert ci.layers[0].count == WINDOW and ci.layers[0].start == len(si.tokens) - WINDOW
    assert ci.tiers == [{"layer": i, "k": "mlx4g32", "v": "mlx4g32"} for i in range(4)]
    assert ci.extents[(0, "k")][0].shape[0] == 1  # one page: the window's 16 tokens, not the prefix's
    cart = cartridge.load(conv.path, model=lm, attention="portable")
    assert cart.prefixes[0].keys.shape == (1, 2, WINDOW, 32)


def test_cli_convert_of_a_window_model(model16, tmp_path):
    from click.testing import CliRunner

    from cartridge.cli.main import cli

    _, lm = model16
    src = cartridge.build(DOC, tmp_path / "src.cart", model=lm, page_size=32)
    r = CliRunner().invoke(cli, ["convert", src.path, "-o", str(tmp_path / "q.cart"), "--tier", "mlx4g32"])
    assert r.exit_code == 0, r.output
    assert cartridge.verify_cartridge(tmp_path / "q.cart").ok
