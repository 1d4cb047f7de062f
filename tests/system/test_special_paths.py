"""Outputs and inputs that are not plain files or plain text: FIFOs, device-like nodes, symlinks,
non-UTF-8 names, byte-order marks, zero-width text. Found by new-user trials; each is refused with one
error, or handled, and nothing is lost or left behind."""

import os
import subprocess
import sys

import pytest
from helpers.cartfiles import write

import cartridge
from cartridge.cli.common import check_output_file, read_corpus
from cartridge.errors import CorruptCartridgeError, InputError, OutputExistsError
from cartridge.format import pack as P
from cartridge.format.layout import MANIFEST_NAME
from cartridge.format.writer import check_output_path
from cartridge.models.prompt import check_text

DOC = "The tenant may terminate this lease with 60 days of notice. Rent is 900 euros a month.\n"


def test_pack_never_replaces_what_is_not_a_cartz(tmp_path):
    src = write(tmp_path / "a.cart")
    text = tmp_path / "corpus.txt"
    text.write_text(DOC)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for dest in (text, fifo):
        with pytest.raises(OutputExistsError, match="is not a .cartz file"):
            P.pack(src, dest, force=True)
    assert text.read_text() == DOC and not fifo.is_file()
    P.pack(src, tmp_path / "a.cartz")
    P.pack(src, tmp_path / "a.cartz", force=True)  # a .cartz is replaced with force


def test_output_files_must_be_regular_even_with_force(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link.json"
    link.symlink_to(tmp_path / "elsewhere.json")
    for path in (fifo, link):
        with pytest.raises(OutputExistsError, match="not a regular file"):
            check_output_file(str(path), "--json", True)
    plain = tmp_path / "old.json"
    plain.write_text("{}")
    assert check_output_file(str(plain), "--json", True) == plain
    with pytest.raises(OutputExistsError, match="pass --force"):
        check_output_file(str(plain), "--json", False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_output_file_folder_must_be_writable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(cartridge.CartridgeError, match="is not writable"):
            check_output_file(str(ro / "x.json"), "--json", False)
    finally:
        ro.chmod(0o755)


def test_force_build_over_a_symlink_leaves_no_hidden_link(tmp_path):
    target = write(tmp_path / "target.cart")
    link = tmp_path / "link.cart"
    link.symlink_to(target)
    write(link, force=True)
    assert link.is_dir() and not link.is_symlink() and (target / MANIFEST_NAME).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.cart", "target.cart"]


def test_a_fifo_member_is_refused_without_blocking(tmp_path):
    cart = write(tmp_path / "a.cart")
    (cart / MANIFEST_NAME).unlink()
    os.mkfifo(cart / MANIFEST_NAME)
    code = ("import sys; from cartridge.format.reader import open_cartridge\n"
            "try:\n    open_cartridge(sys.argv[1], verify='header')\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", code, str(cart)], capture_output=True, timeout=60, text=True)
    assert r.stdout.startswith(CorruptCartridgeError.__name__) and "is not a regular file" in r.stdout


def test_non_utf8_cartridge_path_is_refused_before_work(tmp_path):
    with pytest.raises(InputError, match="is not valid UTF-8"):
        check_output_path(str(tmp_path / "bad\udcff.cart"), False)


@pytest.mark.parametrize("text, what", [("\ufeff", "empty"), ("\u200b\u00a0\n", "empty"), ("a \udcff b", "UTF-8"),
                                        (None, "must be text")])
def test_text_that_is_not_a_prompt_is_refused(text, what):
    with pytest.raises(InputError, match=what):
        check_text(text, "the question")


def test_cli_corpus_reads_like_python_open(tmp_path):
    p = tmp_path / "c.txt"
    p.write_bytes(b"\xef\xbb\xbfline one\r\nline two\rline three\n")
    assert read_corpus(str(p)) == "line one\nline two\nline three\n"
    p.write_bytes(b"\xef\xbb\xbf\xe2\x80\x8b\r\n")
    with pytest.raises(InputError, match=r"corpus .* is empty \(or only whitespace\)"):
        read_corpus(str(p))


@pytest.mark.parametrize("kwargs, what", [({"page_size": 2.5}, "page size must be an integer"),
                                          ({"page_size": True}, "page size must be an integer"),
                                          ({"prefill_step": "512"}, "prefill step must be an integer")])
def test_build_option_types(kwargs, what, tmp_path):
    with pytest.raises(InputError, match=what):
        cartridge.build(DOC, tmp_path / "x.cart", model="/nonexistent-model", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_build_refuses_a_document_that_is_not_text(tmp_path):
    with pytest.raises(InputError, match="must be text"):
        cartridge.build(None, tmp_path / "x.cart", model="/nonexistent-model")


def test_cartz_cache_folder_blocked_by_a_file(tmp_path, monkeypatch):
    src = write(tmp_path / "a.cart")
    P.pack(src, tmp_path / "a.cartz")
    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(cartridge.CartridgeError, match="cannot use the cache folder .*set XDG_CACHE_HOME"):
        P.unpack_cached(tmp_path / "a.cartz")


def test_an_output_inside_a_cartridge_folder_is_refused(tmp_path):
    outer = tmp_path / "outer.cart"
    outer.mkdir()
    (outer / MANIFEST_NAME).write_text("{}")
    for inside in (outer / "sub.cart", outer / "a" / "b.cart"):
        with pytest.raises(InputError, match=f"output {inside} is inside the cartridge {outer}; write it somewhere else"):
            check_output_path(str(inside), True)
    assert sorted(p.name for p in outer.iterdir()) == [MANIFEST_NAME]
    check_output_path(str(tmp_path / "next.cart"), False)  # beside it is fine
