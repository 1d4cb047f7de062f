"""mlx-lm's generation flags on `ask` and `chat` (`cartridge.cli.generation`: --prompt, --system-prompt, --temp,
--top-p, --top-k, --min-p, --seed, -m), and a base model (no chat template): its answers end before the plain
prompt's next "Question:" line, `ask` and `chat` say once that the model has no template, `build` and `inspect`
name the prompt format. The base model is scripted (`helpers.tiny_models.make_scripted`): after "Answer:" it writes
ANSWER and then the next turn, so an answer that does not stop there runs on to --max-tokens."""

import json
import subprocess
import sys

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import cartridge.models.loader
import pytest
from helpers.clirun import run_inprocess as run
from helpers.tiny_models import TINY_CONFIG, hub_snapshot, make_scripted, save_model_dir
from helpers.servers import start_server, stop

from cartridge.models.prompt import PLAIN, question_tokens

DOC = "The tenant may terminate this lease with 60 days of notice. Rent is 900 euros a month.\n"
Q1, Q2 = "How much is the rent?", "And the notice?"
ANSWER = " Nine hundred euros."
SHOWN = ANSWER.strip()  # mlx-lm's streaming detokenizer trims the first token's space
NOTE = ('note: the model has no chat template: the prompt is plain text (Question: ... Answer:) and an answer ends '
        'at a new "Question:" line')
STOPPED = "(7 tokens, stopped before a new 'Question:' line)"  # ANSWER's 4 tokens, then "\n", "Question", ":"
PLAIN_FORMAT = ('plain text, the model has no chat template: "Question: ...\\nAnswer:" turns; an answer ends at a new '
                '"Question:" line')


@pytest.fixture(scope="session")
def base_dir(smol_tokenizer, tmp_path_factory):
    """A base model's folder (no chat template) that answers ANSWER, then writes "\\nQuestion:" and goes on."""
    after = question_tokens(smol_tokenizer, Q1, PLAIN)[-1]  # the ":" of "Answer:"
    lm = make_scripted(smol_tokenizer, after, ANSWER + "\nQuestion:")
    config = {**TINY_CONFIG, "tie_word_embeddings": False}
    return save_model_dir(lm, tmp_path_factory.mktemp("base-model"), config, chat_template=False)


@pytest.fixture(scope="session")
def base_built(base_dir, tmp_path_factory):
    """(the base model's cartridge of DOC x 3, the build's CompletedProcess)."""
    folder = tmp_path_factory.mktemp("base")
    (folder / "doc.txt").write_text(DOC * 3)
    r = run("build", folder / "doc.txt", "-o", folder / "doc.cart", "--model", base_dir, "--page-size", "16")
    assert r.returncode == 0, r.stderr.decode()
    return folder / "doc.cart", r


def test_build_and_inspect_name_the_prompt_format(base_built, built):
    out, r = base_built
    assert f"prompt format: {PLAIN_FORMAT}\n" in r.stdout.decode()
    assert f"prompt        {PLAIN_FORMAT}\n" in run("inspect", out).stdout.decode()
    assert json.loads(run("inspect", out, "--json").stdout)["prompt_mode"] == "plain"
    assert "prompt        the model's chat template\n" in run("inspect", built[0]).stdout.decode()


def test_ask_on_a_base_model_stops_before_the_next_question_line(base_built):
    out, _ = base_built
    r = run("ask", out, Q1, "-m", "64")
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode() == SHOWN + "\n"
    err = r.stderr.decode().splitlines()
    assert err[0] == NOTE and err.count(NOTE) == 1
    assert err[1].startswith("TTFT ") and err[1].endswith(STOPPED)


def test_ask_on_a_model_with_a_chat_template_prints_no_note(built):
    r = run("ask", built[0], Q1, "-m", "4")
    assert r.returncode == 0 and "no chat template" not in r.stderr.decode()


def test_a_saved_base_model_answer_holds_the_answer_not_the_next_turn(base_built, tmp_path):
    out, _ = base_built
    r = run("ask", out, Q1, "-m", "64", "--save-as", tmp_path / "s.cart")
    assert r.returncode == 0, r.stderr.decode()
    prefix = len(cartridge.open_cartridge(out, verify="header")[0].tokens)
    saved = cartridge.open_cartridge(tmp_path / "s.cart", verify="header")[0]
    question = len(cartridge.load(out).question_prompt(Q1))
    assert len(saved.tokens) == prefix + question + 4  # ANSWER's 4 tokens; "\nQuestion:" was trimmed off
    again = run("ask", tmp_path / "s.cart", Q2, "-m", "64")
    assert again.stdout.decode() == SHOWN + "\n" and again.stderr.decode().splitlines()[1].endswith(STOPPED)


def test_chat_on_a_base_model_stops_every_turn(base_built):
    out, _ = base_built
    r = run("chat", out, "-m", "64", stdin=f"{Q1}\n{Q2}\n")
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().splitlines() == [f"> {Q1}", SHOWN, f"> {Q2}", SHOWN]
    assert r.stderr.decode().count(NOTE) == 1
    assert [line.split(", ")[1] for line in r.stderr.decode().splitlines() if line.startswith("TTFT")] == ["7 tokens"] * 2


def test_the_timing_line_starts_a_line_of_its_own(base_built):
    """stdout and stderr in one stream, as a terminal shows them: the answer, then "TTFT ..." on the next line."""
    out, _ = base_built
    r = subprocess.run([sys.executable, "-m", "cartridge.cli.main", "ask", str(out), Q1, "-m", "64"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=300)
    assert r.returncode == 0, r.stdout.decode()
    lines = r.stdout.decode().splitlines()
    assert lines[:3] == [NOTE, SHOWN, lines[2]] and lines[2].startswith("TTFT ") and lines[2].endswith(STOPPED)


def test_a_base_model_by_repo_id_from_the_offline_cache(offline_hub, base_dir, tmp_path):
    hub_snapshot(offline_hub, "test-org/base", "3" * 40, base_dir)
    (tmp_path / "doc.txt").write_text(DOC)
    r = run("build", tmp_path / "doc.txt", "-o", tmp_path / "b.cart", "--model", "test-org/base")
    assert r.returncode == 0 and f"prompt format: {PLAIN_FORMAT}" in r.stdout.decode(), r.stderr.decode()
    r = run("ask", "--prompt", Q1, tmp_path / "b.cart")
    assert (r.returncode, r.stdout.decode()) == (0, SHOWN + "\n"), r.stderr.decode()


def test_prompt_is_the_question(built):
    out, _ = built
    by_flag = run("ask", out, "--prompt", Q1, "-m", "4")
    assert by_flag.returncode == 0 and by_flag.stdout == run("ask", out, Q1, "-m", "4").stdout
    assert run("ask", out, "-p", "-", "-m", "4", stdin=Q1 + "\n").stdout == by_flag.stdout


@pytest.mark.parametrize("flags", [["--temp", "1", "--top-k", "1"], ["--temp", "0.7", "--min-p", "1"]])
def test_sampling_that_keeps_one_token_is_greedy(built, flags):
    out, _ = built
    sampled = run("ask", out, Q1, "-m", "8", *flags, "--seed", "5")
    assert sampled.returncode == 0 and sampled.stdout == run("ask", out, Q1, "-m", "8").stdout


def test_seed_makes_sampling_repeatable(built):
    out, _ = built
    answers = [run("ask", out, Q1, "-m", "8", "--temp", "1", "--seed", seed).stdout for seed in ("3", "3", "4")]
    assert answers[0] == answers[1] != answers[2]


@pytest.mark.parametrize("args, expect", [
    (["--temp", "-1"], "error: Invalid value for '--temp': -1.0 is not in the range x>=0."),
    (["--top-p", "2"], "error: Invalid value for '--top-p': 2.0 is not in the range 0<=x<=1."),
    (["--top-k", "-1"], "error: Invalid value for '--top-k': -1 is not in the range x>=0."),
    (["--prompt", Q2], "error: give a QUESTION or --prompt, not both"),
    (["--prompt", Q2, "--questions", "q.txt"], "error: give --prompt or --questions FILE, not both"),
])
def test_bad_generation_flags_are_one_line(built, args, expect):
    r = run("ask", built[0], Q1, *args)
    assert r.returncode != 0 and r.stderr.decode() == expect + "\n"


def test_system_prompt_is_the_cartridges_or_refused(built, tiny_dir, tmp_path):
    corpus, out = tmp_path / "doc.txt", tmp_path / "s.cart"
    corpus.write_text(DOC * 3)
    assert run("build", corpus, "-o", out, "--model", tiny_dir, "--system-prompt", "Be brief.").returncode == 0
    same = run("ask", out, Q1, "-m", "4", "--system-prompt", "Be brief.")
    assert same.returncode == 0 and same.stdout == run("ask", out, Q1, "-m", "4").stdout
    for command, extra in (("ask", [Q1]), ("chat", [])):
        r = run(command, built[0], *extra, "--system-prompt", "Be brief.", stdin="")
        assert r.stderr.decode() == (f"error: --system-prompt must be the system message {built[0]} was built with "
                                     "(`cartridge build --system-prompt`): it holds the document prefilled after no "
                                     "system message; drop --system-prompt, or build a cartridge with yours\n")
        assert r.returncode == 1
        r = run(command, out, *extra, "--system-prompt", "Be verbose.", stdin="")
        assert r.returncode == 1 and "prefilled after the system message 'Be brief.'; drop --system-prompt or give " \
            "that one" in r.stderr.decode()


def _no_model_load(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cartridge.models.loader, "_load_raw", refuse)  # what every load_model calls


@pytest.mark.parametrize("command, args, expect", [
    ("ask", [Q1, "--system-prompt", "Be brief."], "error: --system-prompt must be the system message"),
    ("chat", ["--system-prompt", "Be brief."], "error: --system-prompt must be the system message"),
    ("ask", [" \n "], "error: the question is empty"),
    ("ask", ["-p", " \n "], "error: the question is empty (or only whitespace)"),
    ("ask", [""], "error: the question is empty"),
    ("chat", ["-p", "  "], "error: the question is empty (or only whitespace)"),
])
def test_what_the_header_rules_out_is_refused_before_the_model_loads(built, base_built, monkeypatch, command, args,
                                                                     expect):
    _no_model_load(monkeypatch)
    r = run(command, built[0], *args, stdin="")
    assert r.returncode == 1 and r.stderr.decode().splitlines()[0] == expect + (
        f" {built[0]} was built with (`cartridge build --system-prompt`): it holds the document prefilled after no "
        "system message; drop --system-prompt, or build a cartridge with yours" if "system" in expect else ""), r.stderr


def test_a_system_prompt_on_a_base_model_is_refused_before_it_loads(base_built, monkeypatch):
    _no_model_load(monkeypatch)
    r = run("ask", base_built[0], Q1, "--system-prompt", "Be brief.")
    assert r.returncode == 1
    assert r.stderr.decode() == f"error: --system-prompt needs a chat template; the model of {base_built[0]} has none\n"


def test_chat_prompt_is_the_first_turn(built):
    out, _ = built
    r = run("chat", out, "-p", Q1, "-m", "4", stdin="")
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode().splitlines() == [f"> {Q1}", run("ask", out, Q1, "-m", "4").stdout.decode().strip()]


def test_serve_on_a_base_model_stops_before_the_next_question_line(base_built, base_dir, tmp_path):
    """`cartridge serve` over the base model's cartridge: the chat answer ends where `ask`'s does."""
    openai = pytest.importorskip("openai")

    out, _ = base_built
    proc, port = start_server([out.parent, "--model", base_dir], tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=out.stem, messages=[{"role": "user", "content": Q1}],
                                           max_tokens=64, temperature=0)
        assert r.choices[0].message.content.strip() == SHOWN
        assert r.choices[0].finish_reason == "stop"
    finally:
        stop(proc)


def test_serve_asks_the_base_model_the_plain_question_and_reuses_the_shelf_cartridge(base_built, base_dir, tmp_path):
    """A request to the base model id (no chat template) with `document + "\\n\\n" + question` is rendered as the
    plain prompt `ask` uses: the answer stops before the next "Question:" line, and the shelf cartridge built of
    that document answers it as a prefix (cached_tokens = its tokens)."""
    openai = pytest.importorskip("openai")

    out, _ = base_built
    tokens = json.loads(run("inspect", out, "--json").stdout)["tokens"]
    proc, port = start_server([out.parent, "--model", base_dir], tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=base_dir.name, messages=[{"role": "user",
                                           "content": DOC * 3 + "\n\n" + Q1}], max_tokens=64, temperature=0)
        assert (r.choices[0].message.content.strip(), r.choices[0].finish_reason) == (SHOWN, "stop")
        assert r.usage.prompt_tokens_details.cached_tokens == tokens
        r = client.chat.completions.create(model=base_dir.name, messages=[{"role": "user", "content": Q1}],
                                           max_tokens=64, temperature=0)
        assert (r.choices[0].message.content.strip(), r.choices[0].finish_reason) == (SHOWN, "stop")
        assert r.usage.prompt_tokens_details.cached_tokens == 0
    finally:
        stop(proc)
