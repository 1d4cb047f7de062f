"""Wording of issue 31 item 10: one cartridge in the singular, a plain file that is no cartridge, a folder
that cannot be written."""

import sys
from types import SimpleNamespace

import pytest

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
from cartridge.cli.main import main


def cli(capsys, *args):
    """Run `cartridge ARGS...` in this process: (exit status, stdout, stderr lines)."""
    try:
        main(list(map(str, args)))
        status = 0
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err.strip().splitlines()


def test_serve_says_one_cartridge(monkeypatch, capsys):
    import cartridge.serve

    def serve(paths, ready, **options):
        ready(SimpleNamespace(entries={"lease": SimpleNamespace(error=None)}, base_id="tiny"))

    monkeypatch.setattr(cartridge.serve, "serve", serve)
    status, _, err = cli(capsys, "serve", "lease.cart", "--port", 0)
    assert status == 0 and err == ["serving 1 cartridge (lease) and the base model 'tiny' on http://127.0.0.1:0/v1"]


def test_serve_names_each_refused_cartridge_at_start(tiny, tmp_path, monkeypatch, capsys):
    import cartridge.serve
    from cartridge.serve.pool import Pool, find_cartridges

    cartridge.build("A lease.", tmp_path / "lease.cart", model=tiny)
    (tmp_path / "empty.cart").mkdir()
    monkeypatch.setattr(cartridge.serve, "serve", lambda paths, ready, **o: ready(Pool(find_cartridges(paths), tiny)))
    status, _, err = cli(capsys, "serve", tmp_path / "lease.cart", tmp_path / "empty.cart", "--port", 0)
    assert status == 0 and len(err) == 2
    assert err[0].startswith(f"warning: empty ({tmp_path / 'empty.cart'}) is refused: ")
    assert err[1] == ("serving 1 cartridge (lease) and the base model 'tiny-seed0' on http://127.0.0.1:0/v1; "
                      "1 refused (above)")


def test_unknown_model_id_lists_one_cartridge(tiny, tmp_path):
    from cartridge.serve.pool import Pool, Refused, find_cartridges

    cartridge.build("A lease.", tmp_path / "lease.cart", model=tiny)
    with pytest.raises(Refused, match="GET /v1/models lists 1 cartridge and the base model 'tiny-seed0'$"):
        Pool(find_cartridges([tmp_path]), tiny).get("nope")


@pytest.mark.parametrize("name, expect", [
    ("notes.txt", "is a file, not a cartridge: a cartridge is a directory (holding MANIFEST, index.lmdb and "
                  "pages.bin) or a packed .cartz file"),
    ("x.cartz", "is a file, not a cartridge: a cartridge is a directory (holding MANIFEST, index.lmdb and "
                "pages.bin) or a packed .cartz file"),  # not a pack: no zstandard frame
])
def test_a_plain_file_is_named_a_file(capsys, tmp_path, name, expect):
    (tmp_path / name).write_text("hello")
    for command in ("inspect", "verify", "ask", "extend"):
        status, _, err = cli(capsys, command, tmp_path / name, *{"ask": ["Who?"], "extend": [tmp_path / name]}.get(command, []))
        assert status == 1 and err == [f"error: {tmp_path / name} {expect}"], (command, err)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc is Linux's")
def test_a_folder_that_cannot_be_written_is_named_not_writable(capsys, tmp_path):
    (tmp_path / "doc.txt").write_text("A lease.")
    status, _, err = cli(capsys, "build", tmp_path / "doc.txt", "-o", "/proc/doc.cart")
    assert status == 1 and err == ["error: folder /proc is not writable (creating a directory in it failed: No such "
                                   "file or directory)"], err


def test_an_output_named_cartz_is_refused_before_any_work(capsys, tmp_path):
    """A writer makes a cartridge directory: an output called x.cartz would be a directory that looks packed."""
    (tmp_path / "doc.txt").write_text("A lease.")
    out = tmp_path / "x.cartz"
    expect = f"error: output {out}: a .cartz is a packed cartridge; write {tmp_path / 'x.cart'} and `cartridge pack` it to {out}"
    for args in (("build", tmp_path / "doc.txt", "-o", out, "--model", tmp_path / "no-model"),
                 ("convert", tmp_path / "none.cart", "-o", out)):
        status, _, err = cli(capsys, *args)
        assert status == 1 and err == [expect], (args, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.txt"]
