"""Reports that add up for a sliding-window model (issue 47 item 5): `ask`'s stored bytes are the stored pages
(as `inspect` and the disk say), not the window layers' float32 decode; `ask` and `inspect` agree on what is
resident; bytes/token says which layers it counts, with the window layers' fixed bytes beside it, in `build`'s
line and in `inspect`."""

import json

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import pytest
from helpers.clirun import run_inprocess
from helpers.family_models import DOC, PAGE, WINDOW, make_model, tiny_config
from mlx.utils import tree_flatten

from cartridge.cli.report import inspect_dict, inspect_table
from cartridge.format.reader import open_cartridge


@pytest.fixture(scope="module")
def gemma3_dir(smol_tokenizer, tmp_path_factory):
    """A tiny gemma3 (window 16 on layers 0 and 2, full attention on 1 and 3) as an mlx-lm model folder."""
    lm = make_model("gemma3_text", smol_tokenizer)
    folder = tmp_path_factory.mktemp("gemma3")
    (folder / "config.json").write_text(json.dumps(tiny_config("gemma3_text", len(smol_tokenizer.vocab))))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    smol_tokenizer._tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="module")
def built(gemma3_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("cart")
    (folder / "doc.txt").write_text(DOC * 3)
    r = run_inprocess("build", folder / "doc.txt", "-o", folder / "doc.cart", "--model", gemma3_dir,
                      "--page-size", PAGE, text=True)
    assert r.returncode == 0, r.stderr
    return folder / "doc.cart", r.stdout


def _window_payload(info):
    return sum(e.page_bytes * e.shape[0] for (p, _), ext in info.extents.items()
               if info.layers[p].kind == "window" for e in ext)


def test_build_and_inspect_say_which_layers_bytes_per_token_counts(built):
    path, out = built
    info, data = open_cartridge(path)
    data.close()
    assert [m.kind for m in info.layers] == ["window", "attention"] * 2
    fixed = _window_payload(info)
    assert fixed == 2 * 2 * PAGE * 2 * 32 * 2  # 2 layers x K, V x one page of 2 heads x 32 fp16
    assert (f"({info.bytes_per_token():,} bytes/token in 2 of 4 layers + {fixed:,} fixed bytes in 2 window layers; "
            in out)
    table = inspect_table(inspect_dict(info, path)).splitlines()
    assert (f"bytes/token   {info.bytes_per_token():,} in the 2 of 4 layers that store every token (fp16 would be "
            f"{info.fp16_bytes_per_token():,}; same as fp16)") in table
    assert (f"fixed         {fixed:,} bytes in 2 window layers (not in bytes/token: each keeps only the last tokens "
            "of its window)") in table


def test_ask_and_inspect_agree_on_stored_and_resident_bytes(built, gemma3_dir):
    path, _ = built
    cart = cartridge.load(path, model=cartridge.load_model(str(gemma3_dir)))
    info = cart.info
    asked, inspected = cart.plan["memory"], inspect_dict(info, path)["attention"]["memory"]
    stored = sum(e.page_bytes * e.shape[0] for ext in info.extents.values() for e in ext)
    assert asked["stored_bytes"] == inspected["stored_bytes"] == stored  # the pages, as on disk
    window_dense = 2 * 2 * WINDOW * 2 * 32 * 4  # 2 window layers x K, V x 16 tokens x 2 heads x 32 float32
    assert asked["resident_bytes"] == inspected["resident_bytes"] >= stored + window_dense


def test_eval_caption_says_which_layers_bytes_per_token_counts(built):
    from cartridge.cli.eval_report import _per_token_caption

    info, data = open_cartridge(built[0])
    data.close()
    split, fixed = info.per_token_split(), _window_payload(info)
    assert split == {"per_token_layers": 2, "layers": 4, "fixed": {"window": {"layers": 2, "bytes": fixed}}}
    assert fixed == info.fixed_bytes()
    rows = [{"label": "fp16", "per_token_split": split}, {"label": "no cartridge"}]
    assert _per_token_caption(rows) == [f"bytes/token: the 2 of 4 layers that store every token; the others "
                                        f"(2 window layers) hold fixed bytes: fp16 {fixed:,}"]
    every = {"per_token_layers": 4, "layers": 4, "fixed": {}}
    assert _per_token_caption([{"label": "fp16", "per_token_split": every}]) == []
