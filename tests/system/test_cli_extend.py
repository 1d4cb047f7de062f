"""The command line of issue 20: `extend` in place and to -o, `ask --save-as`, asking the saved
conversation, and one clear line for bad input."""

import cartridge  # noqa: I001  (first: loads OpenBLAS before mlx)
import mlx_lm
from helpers.clirun import run_inprocess, run_process

DOC = "The tenant may terminate this lease with 60 days of notice. Rent is 900 euros a month.\n"
MORE = "Pets are allowed with a deposit of 200 euros.\n"


def run(*args):
    return run_inprocess(*args, text=True)


def test_extend_then_ask_save_as_then_resume(tiny_dir, tmp_path):
    cart = tmp_path / "doc.cart"
    cartridge.build(DOC, cart, model=str(tiny_dir), page_size=16)
    n_old = len(cartridge.open_cartridge(cart)[0].tokens)
    (tmp_path / "more.txt").write_text(MORE)
    r = run_process("extend", cart, tmp_path / "more.txt", "-o", tmp_path / "ext.cart", text=True)  # as a process
    assert r.returncode == 0, r.stderr
    info = cartridge.open_cartridge(tmp_path / "ext.cart")[0]
    assert r.stdout.startswith(f"extended {tmp_path / 'ext.cart'}: {len(info.tokens)} tokens ({n_old} stored kept")
    one = cartridge.build(DOC.rstrip() + "\n\n" + MORE, tmp_path / "one.cart", model=str(tiny_dir))
    assert info.tokens.tolist() == cartridge.open_cartridge(one.path)[0].tokens.tolist()

    r = run("ask", tmp_path / "ext.cart", "Are pets allowed?", "--max-tokens", 5, "--save-as", tmp_path / "chat.cart")
    assert r.returncode == 0, r.stderr
    chat = cartridge.open_cartridge(tmp_path / "chat.cart")[0]
    assert chat.document_tokens == len(info.tokens) and len(chat.tokens) > len(info.tokens)
    assert f"saved {tmp_path / 'chat.cart'}: {len(chat.tokens)} tokens" in r.stderr
    # the saved tokens are the question's and the answer's, each once (mlx-lm feeds every generated token)
    ext = cartridge.load(tmp_path / "ext.cart", model=str(tiny_dir))
    prompt = ext.question_prompt("Are pets allowed?")
    answer = [t.token for t in mlx_lm.stream_generate(ext.model, ext.tokenizer, prompt, max_tokens=5,
                                                      prompt_cache=ext.prompt_cache())]
    assert chat.tokens[len(info.tokens):].tolist() == prompt + answer
    r = run("ask", tmp_path / "chat.cart", "And the deposit?", "--max-tokens", 3)
    assert r.returncode == 0, r.stderr
    assert f"over {len(chat.tokens)} cached" in r.stderr


def test_cli_errors_are_one_line(tiny_dir, tmp_path):
    cart = tmp_path / "doc.cart"
    cartridge.build(DOC, cart, model=str(tiny_dir))
    (tmp_path / "empty.txt").write_text(" \n")
    r = run("extend", cart, tmp_path / "empty.txt")
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "is empty" in r.stderr
    r = run("ask", cart, "Who?", "--save-as", cart)
    assert r.returncode == 1 and r.stderr.strip() == f"error: output {cart} exists; pass --force (Python: force=True) to replace it"


def test_ask_over_two_cartridges(tiny_dir, tmp_path):
    a, b = tmp_path / "a.cart", tmp_path / "b.cart"
    cartridge.build(DOC, a, model=str(tiny_dir))
    cartridge.build(MORE, b, model=str(tiny_dir))
    c = cartridge.load([a, b], recompute=2)
    r = run("ask", a, b, "Are pets allowed?", "--max-tokens", 3, "--recompute", 2)
    assert r.returncode == 0, r.stderr
    assert f"over {len(c.tokens)} cached" in r.stderr
    r = run("ask", a, b, "Who?", "--save-as", tmp_path / "x.cart")
    assert r.returncode == 1 and "--save-as takes one cartridge" in r.stderr


def test_extend_warns_when_little_context_is_left(tiny_dir, tmp_path):
    """As build does (tests/system/test_cli.py): the tiny model's context is 512 tokens; the extended document ~440."""
    cart = tmp_path / "doc.cart"
    cartridge.build(DOC * 4, cart, model=str(tiny_dir))
    (tmp_path / "more.txt").write_text(DOC * 12)
    r = run("extend", cart, tmp_path / "more.txt", "-o", tmp_path / "ext.cart")
    assert r.returncode == 0, r.stderr
    n = len(cartridge.open_cartridge(tmp_path / "ext.cart")[0].tokens)
    warning = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert warning == [f"warning: the document is {n:,} tokens of the model's 512-token context: only {512 - n:,} "
                       "are left for each question and its answer (reserve 256)"]
    r = run("extend", cart, tmp_path / "more.txt", "-o", tmp_path / "ext2.cart", "--reserve", 512 - n)
    assert r.returncode == 0 and "warning:" not in r.stderr, r.stderr
    r = run("extend", cart, tmp_path / "more.txt", "-o", tmp_path / "ext3.cart", "--reserve", 513 - n)
    assert r.returncode == 0 and f"only {512 - n:,} are left" in r.stderr and "(reserve " in r.stderr, r.stderr


def test_ask_save_as_refuses_an_unsaveable_cartridge_before_answering(tiny_dir, tmp_path):
    cart = tmp_path / "p.cart"
    cartridge.build(DOC, cart, model=str(tiny_dir), page_size=16, protect_first=2)
    r = run("ask", cart, "Who?", "--max-tokens", 3, "--save-as", tmp_path / "chat.cart")
    err = r.stderr.strip().splitlines()
    assert r.returncode == 1 and r.stdout == "" and len(err) == 1, (r.stdout, err)
    assert "save takes cartridges without protected tokens only" in err[0]
    assert not (tmp_path / "chat.cart").exists()
