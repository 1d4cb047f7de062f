"""`cartridge ask` with a question from stdin and with a file of questions after one load, and
`cartridge chat` driven through stdin (issue 15)."""

import json
from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import cartridge.models.loader
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache, save_prompt_cache
from helpers.tiny_models import make_tiny
from helpers.clirun import run_inprocess as run

from cartridge.format.reader import open_cartridge


def test_ask_reads_the_question_from_stdin(built):
    out, _ = built
    r = run("ask", out, "-", "--max-tokens", "4", stdin=b"How much is the rent?\n")
    assert r.returncode == 0, r.stderr.decode()
    direct = run("ask", out, "How much is the rent?", "--max-tokens", "4")
    assert r.stdout == direct.stdout  # greedy: the same answer as the question given as an argument


@pytest.mark.parametrize("suffix", [".txt", ".jsonl"])
def test_ask_questions_file_answers_each_from_a_fresh_cache(built, tmp_path, suffix):
    out, _ = built
    qs = ["How much is the rent?", "How much notice is needed?", "How much is the rent?"]
    qfile = tmp_path / f"q{suffix}"
    if suffix == ".txt":
        qfile.write_text("\n".join(qs) + "\n\n")
    else:
        qfile.write_text("".join(json.dumps({"id": i, "question": q}) + "\n" for i, q in enumerate(qs)))
    r = run("ask", out, "--questions", qfile, "--json", tmp_path / "a.jsonl", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr.decode()
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [row["question"] for row in rows] == qs
    assert rows[0]["answer"] == rows[2]["answer"]  # a fresh cache per question: no earlier turn leaks in
    single = run("ask", out, qs[1], "--max-tokens", "4").stdout.decode().strip()
    assert rows[1]["answer"].strip() == single
    err = r.stderr.decode()
    assert [f"Q{i}: TTFT" in err for i in (1, 2, 3)] == [True] * 3 and err.count("load ") == 1


@pytest.mark.parametrize("args, expect", [
    (["Who?", "--questions", "q.txt"], "not both"),
    (["--json", "a.jsonl"], "--json needs --questions"),
    ([], "give a QUESTION"),
    (["--questions", "missing.txt"], "does not exist"),
    (["Who?", "--recompute-ratio", "0.5"], "apply when composing several cartridges"),
    (["Who?", "--recompute", "4"], "apply when composing several cartridges"),
])
def test_ask_bad_question_options(built, tmp_path, args, expect):
    out, _ = built
    (tmp_path / "q.txt").write_text("Who?\n")
    r = run("ask", out, *[str(tmp_path / a) if a.endswith((".txt", ".jsonl")) else a for a in args])
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode != 0 and len(err) == 1 and expect in err[0], err


def test_chat_keeps_the_conversation_and_resets(built):
    out, _ = built
    turns = b"How much is the rent?\nAnd the notice?\n/reset\nHow much is the rent?\n/quit\n"
    r = run("chat", out, "--max-tokens", "4", stdin=turns)
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().splitlines()  # piped: each question echoed before its answer
    assert lines[::2] == ["> How much is the rent?", "> And the notice?", "> How much is the rent?"]
    answers = lines[1::2]
    assert len(answers) == 3
    assert answers[2] == answers[0]  # after /reset the first question is answered as at the start
    first = run("ask", out, "How much is the rent?", "--max-tokens", "4").stdout.decode().splitlines()
    assert answers[0] == first[0]
    assert "(conversation reset)" in r.stderr.decode()


def test_chat_refuses_unknown_commands_and_a_max_tokens_past_the_context(built):
    out, _ = built
    r = run("chat", out, "--max-tokens", "4", stdin=b"/bogus\n/quit\n")
    assert r.returncode == 0 and r.stdout == b"" and "unknown command /bogus" in r.stderr.decode()
    r = run("chat", out, "--max-tokens", "99999999", stdin=b"Who?\n")
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 1 and len(err) == 1 and "does not fit the model's context" in err[0], err


def test_serve_on_a_busy_port_is_one_line_before_any_work(built):
    import socket

    out, _ = built
    with socket.create_server(("127.0.0.1", 0)) as busy:
        r = run("serve", out, "--port", busy.getsockname()[1])
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 1 and len(err) == 1 and err[0].startswith("error: cannot listen on 127.0.0.1:"), err


def test_chat_save_writes_the_conversation_and_ask_continues_it(built, tmp_path, monkeypatch):
    out, _ = built
    saved = tmp_path / "talk.cart"
    r = run("chat", out, "--max-tokens", "4", stdin=f"How much is the rent?\n/save {saved}\n/quit\n".encode())
    assert r.returncode == 0 and f"saved {saved}" in r.stderr.decode(), r.stderr.decode()
    assert run("verify", saved).returncode == 0
    again = run("chat", saved, stdin=b"Who?\n")
    err = again.stderr.decode().strip().splitlines()
    assert again.returncode == 1 and len(err) == 1 and "holds a saved conversation" in err[0], err
    assert run("ask", saved, "And the notice?", "--max-tokens", "3").returncode == 0
    from click.testing import CliRunner

    from cartridge.cli import chat
    from cartridge.cli.main import cli

    monkeypatch.setattr(chat, "load_cartridge", lambda *a, **k: pytest.fail("the model was loaded first"))
    r = CliRunner().invoke(cli, ["chat", str(saved)], input="Who?\n")
    assert r.exit_code == 1 and "holds a saved conversation" in str(r.exception)


def test_max_memory_below_the_stored_pages_and_a_dequantize_once_it_changed_are_said(built):
    import cartridge
    from cartridge.attention.budget import MemoryBudgetWarning

    out, _ = built
    with pytest.warns(MemoryBudgetWarning) as caught:
        cart = cartridge.load(out, attention="dequantize-once", max_memory=1000)
    m, mb = cart.plan["memory"], 1e6
    assert [str(w.message) for w in caught] == [
        f"doc.cart: the memory budget of {1000 / mb:,.1f} MB is below the {m['stored_bytes'] / mb:,.1f} MB of stored "
        f"pages, which are always held (the budget cannot go lower); {m['resident_bytes'] / mb:,.1f} MB are held",
        f"doc.cart: attention dequantize-once: within the memory budget of {1000 / mb:,.1f} MB, 2 of 2 layers take "
        "another path (portable on 2) instead of dense pages"]
    assert {w.filename for w in caught} == {__file__}  # the caller's line, not cartridge/api.py's
    with pytest.warns(MemoryBudgetWarning) as caught_many:
        cartridge.load_many([out, out], max_memory=1000)
    said = [w for w in caught_many if w.category is MemoryBudgetWarning]  # (not a ResourceWarning of the above)
    assert len(said) == 2 and {w.filename for w in said} == {__file__}
    r = run("ask", out, "Who?", "--max-tokens", "2", "--max-memory", "1000", "--attention", "dequantize-once")
    warnings = [line for line in r.stderr.decode().splitlines() if line.startswith("warning:")]
    assert r.returncode == 0 and warnings == [f"warning: {w.message}" for w in caught], r.stderr.decode()
    r = run("ask", out, "Who?", "--max-tokens", "2", "--max-memory", "1G", "--attention", "dequantize-once")
    assert r.returncode == 0 and "warning:" not in r.stderr.decode()  # room for every layer: nothing to say


def test_ask_over_two_cartridges_prints_the_memory_of_each(built, tmp_path):
    import shutil

    out, _ = built
    shutil.copytree(out, tmp_path / "second.cart")
    r = run("ask", out, tmp_path / "second.cart", "Who?", "--max-tokens", "2")
    err = r.stderr.decode().splitlines()
    assert r.returncode == 0, r.stderr.decode()
    for name in ("doc.cart", "second.cart"):
        assert [line.split(" ", 2)[1] for line in err if line.startswith(f"{name}: ")] == ["attention", "memory:"]
    assert err[-1].startswith("MLX active ") and sum(line.count("MLX active") for line in err) == 1


def test_ask_composed_says_what_it_recomputed(built, tiny_dir, tmp_path):
    """Several cartridges: one line with each part's tokens and how many of the later one's were prefilled again."""
    import cartridge
    from cartridge.cli.ask import load_cartridge

    out, _ = built
    other = tmp_path / "annex.cart"
    cartridge.build("Annex B. The landlord repairs the roof and the tenant waters the garden. " * 3, other,
                    model=str(tiny_dir), page_size=16)
    c, _ = load_cartridge([str(out), str(other)], str(tiny_dir), "auto", recompute_ratio=0.6)
    b = c.blended[0]
    n, redone = b["fresh"] + b["read"], b["fresh"] + b["selected"]
    assert redone == round(0.6 * n) and b["selected"] > 0 and n > 40  # boundary tokens and selected ones
    r = run("ask", out, other, "Who repairs the roof?", "--recompute-ratio", "0.6", "--max-tokens", "2")
    assert r.returncode == 0, r.stderr.decode()
    lines = [line for line in r.stderr.decode().splitlines() if line.startswith("composed")]
    assert lines == [f"composed 2 cartridges: {len(c.carts[0].tokens):,} + {n:,} tokens, recomputed {redone:,} of "
                     f"annex's tokens ({100 * redone / n:.0f}%)"]


def test_the_default_max_tokens_is_cut_to_what_the_context_leaves_and_a_given_one_is_not():
    from types import SimpleNamespace

    from cartridge.cli.ask import DEFAULT_MAX_TOKENS, check_room
    from cartridge.errors import InputError

    def cart(limit, held):
        return SimpleNamespace(model=SimpleNamespace(args=SimpleNamespace(max_position_embeddings=limit)),
                               tokens=[0] * held)

    prompt = [1] * 9
    assert check_room(cart(512, 299), None, prompt, None, "q") == 512 - 299 - 9  # 204: less than the default
    assert check_room(cart(8192, 299), None, prompt, None, "q") == DEFAULT_MAX_TOKENS
    assert check_room(cart(512, 299), None, prompt, 204, "q") == 204
    with pytest.raises(InputError, match="--max-tokens 205 does not fit the model's context of 512 tokens"):
        check_room(cart(512, 299), None, prompt, 205, "q")
    with pytest.raises(InputError, match=r"q \(9 tokens\) does not fit"):
        check_room(cart(512, 503), None, prompt, None, "q")
    assert check_room(SimpleNamespace(model=object(), tokens=[0] * 10**6), None, prompt, None, "q") == DEFAULT_MAX_TOKENS


def test_chat_save_over_an_existing_file_says_to_pick_a_new_name_and_keeps_the_file(built):
    out, _ = built
    before = sorted((p.name, p.stat().st_size) for p in Path(out).iterdir())
    r = run("chat", out, "--max-tokens", "2", stdin=f"Who?\n/save {out}\n/quit\n".encode())
    err = r.stderr.decode()
    assert r.returncode == 0 and f"error: {out} exists; /save to a new name" in err and "--force" not in err, err
    assert sorted((p.name, p.stat().st_size) for p in Path(out).iterdir()) == before


@pytest.mark.parametrize("last", ["misspelled.cart", "other.cartz", "DIR"])
def test_ask_with_cartridges_and_no_question_says_so_rather_than_asking_a_path(built, tmp_path, last):
    out, _ = built
    last = str(tmp_path) if last == "DIR" else last
    r = run("ask", out, last, "--max-tokens", "2")
    err = r.stderr.decode().strip().splitlines()
    assert r.returncode == 1 and err == [f"error: no QUESTION: the last argument {last} names a cartridge; give the "
                                         "question after the cartridges (or --questions FILE)"], err
    assert r.stdout == b""


def test_ask_a_prompt_cache_file_says_to_import_it(tiny, tmp_path):
    """A file of mlx-lm's save_prompt_cache (cache classes in its metadata) is named as one."""
    path = tmp_path / "doc.safetensors"
    cache = make_prompt_cache(tiny.model)
    tiny.model(mx.array([[1, 2, 3]]), cache=cache)
    save_prompt_cache(str(path), cache)
    r = run("ask", path, "What?")
    assert r.returncode == 1
    assert r.stderr.decode().startswith(f"error: {path} is a file, not a cartridge (an mlx-lm prompt-cache file: "
                                        "`cartridge import` it first): a cartridge is a directory")


def test_ask_cartridges_of_two_models_names_both_before_loading_one(built, smol_tokenizer, tmp_path, monkeypatch):
    other = cartridge.build("Another document about leases and rents. " * 4, tmp_path / "b.cart",
                            model=make_tiny(smol_tokenizer, seed=1), page_size=16).path
    a = open_cartridge(built[0], verify="header")[0]

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(cartridge.models.loader, "_load_raw", refuse)  # what every load_model calls
    r = run("ask", built[0], other, "What?")
    err = r.stderr.decode()
    assert r.returncode == 1 and err.count("\n") == 1, err
    assert (f"the cartridges were built with different models ({built[0]}: {a.model_ref} (fingerprint "
            f"{a.fingerprint['id'][:12]}); {other}: tiny-seed1 (fingerprint ") in err
