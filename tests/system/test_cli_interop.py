"""`cartridge import` / `cartridge export`: what they print, and one error line with exit 1 for every bad input."""

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import pytest
from helpers.clirun import run_inprocess, run_process
from mlx_lm.models.cache import load_prompt_cache
from helpers.promptfiles import cache_prompt
from helpers.cartfiles import write as write_synthetic

from cartridge.format import keys as K
from cartridge.format.reader import open_cartridge
from cartridge.promptcache.importer import cache_prompt_tokens

DOC = "Opening hours: the museum opens at nine and closes at five, except on Mondays when it stays closed. " * 3


@pytest.fixture(scope="module")
def made(tiny_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("cli-pc")
    (folder / "doc.txt").write_text(DOC)
    return folder, cache_prompt(tiny_dir, folder / "doc.safetensors", DOC)


def _one_error_line(r, message):
    lines = r.stderr.decode().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines


def test_import_then_export_print_one_line_each(made, tmp_path):
    folder, pfile = made
    r = run_inprocess("import", pfile, "-o", tmp_path / "doc.cart", "--document", folder / "doc.txt")
    assert r.returncode == 0, r.stderr
    out = r.stdout.decode()
    assert out.startswith(f"imported {pfile} -> {tmp_path / 'doc.cart'}: ") and "token ids from the document" in out
    assert "recomputed and matched" in out and len(out.splitlines()) == 1
    r = run_inprocess("export", tmp_path / "doc.cart", "-o", tmp_path / "back.safetensors")
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode() == (f"exported {tmp_path / 'doc.cart'} -> {tmp_path / 'back.safetensors'}: "
                                 f"{load_prompt_cache(str(tmp_path / 'back.safetensors'))[0].offset} tokens, "
                                 f"{(tmp_path / 'back.safetensors').stat().st_size:,} bytes (2 KVCache); use: "
                                 f"mlx_lm.generate --prompt-cache-file {tmp_path / 'back.safetensors'} --prompt \"...\"\n")


def test_bad_inputs_get_one_line_and_nothing_is_written(made, tiny_dir, tmp_path):
    folder, pfile = made
    (tmp_path / "notes.txt").write_text("not a prompt cache")
    cases = [
        (("import", tmp_path / "notes.txt", "-o", tmp_path / "a.cart"), "is not a safetensors file"),
        (("import", tiny_dir / "model.safetensors", "-o", tmp_path / "a.cart"), "not an mlx-lm prompt cache"),
        (("import", pfile, "-o", tmp_path / "a.cart"), "holds no token ids (mlx_lm.cache_prompt stores none): pass "
                                                       "--document"),
        (("import", pfile, "-o", tmp_path / "a.cart", "--document", tmp_path / "notes.txt"), "the document is"),
        (("import", pfile, "-o", tmp_path / "a.cart", "--document", folder / "doc.txt", "--preset", "safe", "--tier",
          "int8"), "--preset safe sets the tiers"),
        (("export", folder, "-o", tmp_path / "a.safetensors"), "not a cartridge"),
    ]
    for args, message in cases:
        _one_error_line(run_inprocess(*args), message)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_a_real_process_refuses_an_output_without_the_safetensors_suffix(made, tmp_path):
    folder, pfile = made
    cartridge.import_prompt_cache(pfile, tmp_path / "doc.cart", document=DOC)
    r = run_process("export", tmp_path / "doc.cart", "-o", tmp_path / "doc.bin")
    _one_error_line(r, "must end in .safetensors: mlx_lm.generate --prompt-cache-file reads the file by that "
                       "extension")
    assert not (tmp_path / "doc.bin").exists() and r.stdout == b""


def test_import_takes_the_document_without_the_newline_the_shell_dropped(tiny, tiny_dir, tmp_path):
    """`mlx_lm.cache_prompt --prompt "$(cat doc.txt)"` prefills the text without its trailing newline: `import
    --document doc.txt` takes it so, saying it in one warning line."""
    text = DOC.rstrip()
    (tmp_path / "doc.txt").write_text(text + "\n")
    assert len(cache_prompt_tokens(tiny.tokenizer, text + "\n")) != len(cache_prompt_tokens(tiny.tokenizer, text))
    pfile = cache_prompt(tiny_dir, tmp_path / "doc.safetensors", text)
    r = run_inprocess("import", pfile, "-o", tmp_path / "doc.cart", "--document", tmp_path / "doc.txt")
    assert r.returncode == 0, r.stderr
    assert r.stderr.decode().splitlines() == [
        f"warning: the document's trailing whitespace left out: {pfile} holds "
        f"{len(cache_prompt_tokens(tiny.tokenizer, text))} tokens, the document without it (as `--prompt "
        f"\"$(cat FILE)\"` passes it)"]
    info, _ = open_cartridge(tmp_path / "doc.cart")
    assert info.tokens.tolist() == cache_prompt_tokens(tiny.tokenizer, text) and info.source["bytes"] == len(text)


def test_export_of_a_gguf_models_cartridge_prints_why_mlx_lm_cannot_load_it_not_a_use_hint(tmp_path):
    path = write_synthetic(tmp_path / "g.cart", extra={K.MODEL_REF: "gemma3-270m"})
    r = run_inprocess("export", path, "-o", tmp_path / "g.safetensors")
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode() == (f"exported {path} -> {tmp_path / 'g.safetensors'}: "
                                 f"{len(open_cartridge(path)[0].tokens)} tokens, "
                                 f"{(tmp_path / 'g.safetensors').stat().st_size:,} bytes (2 KVCache)\n")
    assert r.stderr.decode().splitlines() == [
        "warning: the file names model gemma3-270m, a GGUF model, which mlx_lm.generate cannot load (cartridge makes "
        "no mlx-lm folder of its weights); use the file from Python: mlx_lm's load_prompt_cache with "
        "cartridge.load_model('gemma3-270m')"]
