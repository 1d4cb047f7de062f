"""`cartridge serve` as a persistent prompt cache and as a drop-in for mlx_lm.server: a base-model prompt that
starts with a shelf cartridge's tokens is answered from it; an unmatched prompt's prefix is saved after its
answer (write-behind, bounded by bytes, least recently used first) and still there after a restart; the
request fields and endpoints mlx_lm.server takes. Servers run as real processes on 127.0.0.1 (`servers`)."""

import json
import os
import resource
import time

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from helpers.clirun import run_inprocess
from helpers.servers import raw, start_server, stop

openai = pytest.importorskip("openai")

DOC = "The tenant may terminate this lease with 60 days of notice. Rent is 900 euros a month.\n" * 3
OTHER = "Section 2. The landlord repairs the roof; the tenant waters the garden every week.\n" * 4
QUESTION = "How much is the rent?"
MAX = 10


@pytest.fixture(scope="module")
def lm(tiny_dir):
    return cartridge.load_model(str(tiny_dir))


@pytest.fixture(scope="module")
def shelf(lm, tmp_path_factory):
    """A shelf holding lease.cart (DOC), built with the server's model."""
    folder = tmp_path_factory.mktemp("shelf")
    cartridge.build(DOC, folder / "lease.cart", model=lm, page_size=16)
    return folder


@pytest.fixture(scope="module")
def server(shelf, tiny_dir, tmp_path_factory):
    """The server over the shelf, saving prefixes of more than 20 tokens (at most 1 MiB of them)."""
    log = tmp_path_factory.mktemp("log") / "serve.log"
    proc, port = start_server([shelf, "--model", tiny_dir, "--save-prefixes-over", 20, "--shelf-bytes", "1M"], log)
    yield port
    stop(proc)


def _client(port):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)


def _chat(port, model, content, **kw):
    r = _client(port).chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], max_tokens=kw.pop("max_tokens", MAX),
        temperature=kw.pop("temperature", 0), extra_body={"return_token_ids": True, **kw.pop("extra", {})}, **kw)
    return r, r.choices[0].model_extra["token_ids"]


def _saved(port, timeout=60):
    """The ids of the saved prefixes /v1/models lists, once there is one (the write runs behind the answer)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        rows = json.loads(raw(port, "GET", "/v1/models")[1])["data"]
        saved = [r["id"] for r in rows if r.get("saved_prefix")]
        if saved:
            return saved
        time.sleep(0.2)
    return []


def _in_process(cart, question, sampler=None, processors=None, n=MAX):
    rows = list(mlx_lm.stream_generate(cart.model, cart.tokenizer, cart.question_prompt(question), max_tokens=n,
                                       prompt_cache=cart.prompt_cache(), sampler=sampler,
                                       logits_processors=processors))
    return rows


def test_a_prompt_that_starts_with_a_cartridge_is_answered_from_it(server, shelf, lm, tiny_dir):
    """The document pasted before the question, to the base model: the cartridge's tokens come from disk
    (cached_tokens), and the answer is the one naming the cartridge gives."""
    cart = cartridge.load(shelf / "lease.cart", model=lm)
    named, named_ids = _chat(server, "lease", QUESTION)
    pasted, ids = _chat(server, tiny_dir.name, DOC + "\n\n" + QUESTION)
    assert ids == named_ids == [r.token for r in _in_process(cart, QUESTION)]
    assert pasted.usage.prompt_tokens_details.cached_tokens == len(cart.tokens)
    assert pasted.usage.prompt_tokens == named.usage.prompt_tokens
    stream = _client(server).chat.completions.create(
        model=tiny_dir.name, messages=[{"role": "user", "content": DOC + "\n\n" + QUESTION}], max_tokens=MAX,
        temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(cart.tokens)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == named.choices[0].message.content


def test_the_same_chat_twice_across_a_restart(tiny_dir, lm, tmp_path):
    """An empty shelf: the first answer prefills everything and saves the document's prefix behind it; after a
    restart the same request takes the document's tokens from disk and gets the same (greedy) answer."""
    from cartridge.models.prompt import prefix_tokens
    from cartridge.serve.shelf import prefix_name

    folder, log = tmp_path / "shelf", tmp_path / "serve.log"
    args = [folder, "--model", tiny_dir, "--save-prefixes-over", 20, "--shelf-bytes", "1M"]
    doc_tokens = prefix_tokens(lm.tokenizer, OTHER)
    proc, port = start_server(args, log)
    try:
        first, first_ids = _chat(port, "default_model", OTHER + "\n\n" + QUESTION)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        saved = _saved(port)
    finally:
        stop(proc)
    assert saved == [prefix_name(lm.fingerprint["id"], doc_tokens)]
    assert run_inprocess("verify", folder / f"{saved[0]}.cart").returncode == 0
    proc, port = start_server(args, log)
    try:
        again, again_ids = _chat(port, "default_model", OTHER + "\n\n" + QUESTION)
        other, _ = _chat(port, "default_model", OTHER + "\n\nWho waters the garden?")
        stats = json.loads(raw(port, "GET", "/stats")[1])
    finally:
        stop(proc)
    assert again.usage.prompt_tokens_details.cached_tokens == len(doc_tokens)
    assert again_ids == first_ids
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert other.usage.prompt_tokens_details.cached_tokens == len(doc_tokens)  # another question, same document
    assert (stats["prefix_hits"], stats["cached_tokens"]) == (2, 2 * len(doc_tokens))
    assert sorted(p.name for p in folder.iterdir()) == [f"{saved[0]}.cart"]  # nothing saved twice, no leftovers
    assert "INFO:     saved prefix " in log.read_text()


def test_sampling_fields_are_honoured(server, shelf, lm):
    """top_k=1 and min_p=1 leave the most likely token even at temperature 1.5; the penalties and logit_bias
    are mlx-lm's logits processors."""
    cart = cartridge.load(shelf / "lease.cart", model=lm)
    greedy = [r.token for r in _in_process(cart, QUESTION)]
    assert _chat(server, "lease", QUESTION, temperature=1.5, seed=3, extra={"top_k": 1})[1] == greedy
    assert _chat(server, "lease", QUESTION, temperature=1.5, seed=3, extra={"min_p": 1.0})[1] == greedy
    processors = make_logits_processors(None, repetition_penalty=1.5, repetition_context_size=8, presence_penalty=0.5)
    penalized = [r.token for r in _in_process(cart, QUESTION, processors=processors)]
    got = _chat(server, "lease", QUESTION, presence_penalty=0.5,
                extra={"repetition_penalty": 1.5, "repetition_context_size": 8})[1]
    assert got == penalized != greedy
    assert _chat(server, "lease", QUESTION, logit_bias={"1234": 100})[1] == [1234] * MAX
    mx.random.seed(5)
    sampled = [r.token for r in _in_process(cart, QUESTION, sampler=make_sampler(1.0, top_k=5))]
    assert _chat(server, "lease", QUESTION, temperature=1.0, seed=5, extra={"top_k": 5})[1] == sampled


def test_logprobs_are_the_model_s(server, shelf, lm):
    """Chat: OpenAI's {"content": [{token, logprob, bytes, top_logprobs}]} (with mlx_lm.server's "id"), each
    logprob the one mlx-lm gives in-process; completions: OpenAI's legacy format."""
    cart = cartridge.load(shelf / "lease.cart", model=lm)
    rows = _in_process(cart, QUESTION)
    r, ids = _chat(server, "lease", QUESTION, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert [e.model_extra["id"] for e in content] == ids == [row.token for row in rows]
    for e, row in zip(content, rows):
        assert e.logprob == pytest.approx(row.logprobs[row.token].item(), abs=1e-4)
        tops = [t.logprob for t in e.top_logprobs]
        assert tops == sorted(tops, reverse=True) and len(tops) == 3
        assert tops[0] == pytest.approx(row.logprobs.max().item(), abs=1e-4)
        assert e.bytes == list(e.token.encode("utf-8"))
    c = _client(server).completions.create(model="lease", prompt="Question: who pays?", max_tokens=4, temperature=0,
                                            logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == c.choices[0].text and lp.text_offset[0] == 0
    assert all(len(t) <= 2 for t in lp.top_logprobs)


def test_mlx_lm_server_endpoints_and_cors(server, tiny_dir):
    """/health, the paths without /v1 (mlx_lm.server answers /chat/completions), a body without "model" or with
    mlx_lm.server's "default_model" (the base model), and CORS headers for any origin (mlx_lm.server's default)."""
    assert raw(server, "GET", "/health") == (200, b'{"status":"ok"}')
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 2}
    for path, model in (("/chat/completions", None), ("/v1/chat/completions", "default_model")):
        status, out = raw(server, "POST", path, json.dumps({**body, **({"model": model} if model else {})}))
        assert status == 200, out
        assert json.loads(out)["model"] == (model or tiny_dir.name)
    status, out = raw(server, "POST", "/completions", json.dumps({"prompt": "Rent", "max_completion_tokens": 2,
                                                                   "max_tokens": 5}))
    assert (status, json.loads(out)["usage"]["completion_tokens"]) == (200, 2)  # mlx_lm.server's order
    assert raw(server, "GET", "/models")[0] == 200
    import http.client

    c = http.client.HTTPConnection("127.0.0.1", server, timeout=60)
    c.request("OPTIONS", "/v1/chat/completions", headers={"Origin": "http://chat.example",
                                                          "Access-Control-Request-Method": "POST"})
    r = c.getresponse()
    r.read()
    assert (r.status, r.getheader("access-control-allow-origin")) == (200, "*")
    c.close()


# In-process pieces: no server needed.

def test_allowed_origins_limit_cors_headers():
    """--allowed-origins http://a: that origin gets CORS headers, another none (as mlx_lm.server); "" sends none."""
    from types import SimpleNamespace

    from starlette.testclient import TestClient

    from cartridge.serve.app import make_app

    engine = SimpleNamespace(healthy=True, close=lambda: None)
    client = TestClient(make_app(engine, allowed_origins=("http://a",)))
    assert client.get("/health", headers={"Origin": "http://a"}).headers["access-control-allow-origin"] == "http://a"
    assert "access-control-allow-origin" not in client.get("/health", headers={"Origin": "http://b"}).headers
    none = TestClient(make_app(engine, allowed_origins=()))
    assert "access-control-allow-origin" not in none.get("/health", headers={"Origin": "http://a"}).headers
    assert none.get("/health").json() == {"status": "ok"}


def test_prefix_index_finds_the_longest_proper_prefix():
    from cartridge.serve.shelf import PrefixIndex

    index = PrefixIndex()
    index.add("ab", [1, 2])
    index.add("abc", [1, 2, 3])
    index.add("abd", [1, 2, 4])
    index.add("x", [9])
    assert index.candidates([1, 2, 3, 5]) == [("abc", 3), ("ab", 2)]
    assert index.candidates([1, 2, 3]) == [("ab", 2)]  # at least one prompt token after the prefix
    assert index.candidates([1, 9]) == []
    index.remove("abc")
    assert index.candidates([1, 2, 3, 5]) == [("ab", 2)]


def test_the_reusable_prefix_is_the_document(lm):
    """The text before the last blank line of the last user message (chat), or of the prompt (completions): the
    tokens `cartridge build` makes of that document."""
    from cartridge.models.prompt import PLAIN, prefix_tokens
    from cartridge.serve.prompts import base_prompt
    from cartridge.serve.protocol import parse_chat, parse_completion

    chat = parse_chat({"messages": [{"role": "user", "content": DOC + "\n\n" + QUESTION}]})
    assert base_prompt(lm.tokenizer, chat).prefix_length(lm.tokenizer) == len(prefix_tokens(lm.tokenizer, DOC))
    plain = parse_completion({"prompt": DOC + "\n\nQuestion: " + QUESTION + "\nAnswer:"})
    assert base_prompt(lm.tokenizer, plain).prefix_length(lm.tokenizer) == len(
        prefix_tokens(lm.tokenizer, DOC, mode=PLAIN))
    one_line = parse_chat({"messages": [{"role": "system", "content": OTHER}, {"role": "user", "content": QUESTION}]})
    prompt = base_prompt(lm.tokenizer, one_line)
    n = prompt.prefix_length(lm.tokenizer)
    assert lm.tokenizer.decode(prompt.tokens[n:]).startswith(QUESTION)  # everything before the question's text


def test_prompt_cache_size_bounds_the_cartridges_kept_loaded(shelf, lm, tmp_path):
    """--prompt-cache-size (mlx_lm.server's count of caches kept): the least recently used is dropped."""
    import shutil

    from cartridge.serve.pool import Pool

    shutil.copytree(shelf / "lease.cart", tmp_path / "copy.cart")
    pool = Pool({"lease": shelf / "lease.cart", "copy": tmp_path / "copy.cart"}, lm, max_count=1)
    pool.get("lease")
    pool.get("copy")
    assert [m["id"] for m in pool.models() if m.get("loaded") and m["cartridge"]] == ["copy"]


def _capture(shelf, lm, text):
    from cartridge.write.prefill import prefill
    from cartridge.models.prompt import encode_text

    tokens = encode_text(lm.tokenizer, text, True)
    return shelf.capture(tokens, text, prefill(lm.model, tokens + [0, 0]))


def test_shelf_evicts_the_least_recently_used_prefix_by_bytes(lm, tmp_path):
    from cartridge.serve.pool import Pool
    from cartridge.serve.shelf import Shelf, dir_bytes

    probe, folder = Shelf(tmp_path, Pool({}, lm), 5, 1 << 30), tmp_path / "shelf"
    name = _capture(probe, lm, DOC)
    probe.close()
    size = dir_bytes(tmp_path / f"{name}.cart")
    folder.mkdir()
    shelf = Shelf(folder, Pool({}, lm), 5, 2 * size + size // 2)  # room for two
    names = [_capture(shelf, lm, DOC)]
    shelf.wait()
    names.append(_capture(shelf, lm, DOC + " Rent is due on the first day."))
    shelf.wait()
    shelf.touch(names[0])  # the first is now the most recently used
    names.append(_capture(shelf, lm, DOC + " The deposit is two months of rent."))
    shelf.wait()
    assert sorted(p.name for p in folder.iterdir()) == sorted(f"{n}.cart" for n in (names[0], names[2]))
    assert set(shelf.pool.entries) == {names[0], names[2]}
    assert shelf.saved_bytes <= 2 * size + size // 2
    shelf.touch(names[0])  # used again: its directory's mtime keeps the order across a restart
    shelf.close()
    again = Shelf(folder, Pool({}, lm), 5, size + size // 2)  # after a restart, a smaller bound: the older goes
    assert [p.name for p in folder.iterdir()] == [f"{names[0]}.cart"]
    again.close()


def test_a_full_disk_at_write_behind_is_one_line_and_loses_nothing(lm, tmp_path, caplog):
    """The write fails (RLIMIT_FSIZE: the kernel's "File too large", as a full disk's ENOSPC): one warning line,
    no file left behind, and the next prefix is saved."""
    from cartridge.serve.pool import Pool
    from cartridge.serve.shelf import Shelf

    shelf = Shelf(tmp_path, Pool({}, lm), 5, 1 << 30)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
    try:
        with caplog.at_level("INFO", logger="cartridge.serve"):
            name = _capture(shelf, lm, DOC)
            shelf.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    failures = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(failures) == 1 and failures[0].startswith(f"prefix {name} not saved: could not write cartridge")
    assert "File too large; nothing was left behind" in failures[0]
    assert os.listdir(tmp_path) == []
    assert _capture(shelf, lm, DOC) == name
    shelf.wait()
    assert os.listdir(tmp_path) == [f"{name}.cart"] and name in shelf.pool.entries
    shelf.close()


def test_a_model_that_keeps_part_of_the_prompt_cannot_save_prefixes(smol_tokenizer, tmp_path):
    from helpers.family_models import make_model

    from cartridge.errors import InputError
    from cartridge.serve.pool import Pool
    from cartridge.serve.shelf import Shelf

    with pytest.raises(InputError, match="this model has window layers, which keep only part of a prompt"):
        Shelf(tmp_path, Pool({}, make_model("gemma3_text", smol_tokenizer)), 5, 1 << 20)


def test_chat_template_and_its_arguments(tiny_dir, shelf):
    """--chat-template replaces the template (and the fingerprint, so lease.cart is not matched any more);
    --chat-template-args and a request's chat_template_kwargs reach it."""
    from cartridge.serve import with_chat_template
    from cartridge.serve.pool import Pool, Refused, find_cartridges
    from cartridge.serve.prompts import base_prompt
    from cartridge.serve.protocol import parse_chat

    lm = with_chat_template(cartridge.load_model(str(tiny_dir)), "{{ greeting }}{% for m in messages %}"
                                                                   "[{{ m.content }}]{% endfor %}>")
    request = parse_chat({"messages": [{"role": "user", "content": DOC + "\n\n" + QUESTION}],
                          "chat_template_kwargs": {"greeting": "Hi"}})
    prompt = base_prompt(lm.tokenizer, request, {"greeting": "Hello"})
    assert prompt.text == f"Hi[{DOC}\n\n{QUESTION}]>"
    assert base_prompt(lm.tokenizer, parse_chat({"messages": request.messages}), {"greeting": "Yo"}).text.startswith("Yo[")
    pool = Pool(find_cartridges([shelf]), lm)
    matching = base_prompt(lm.tokenizer, parse_chat({"messages": request.messages}), {"greeting": ""})
    assert pool.match(matching.tokens) == []
    with pytest.raises(Refused, match="differs in chat_template"):  # built under the tokenizer's own template
        pool.get("lease")


@pytest.mark.parametrize("args, expect", [
    ([], "no cartridge in {empty}; give --model"),
    (["--model", "default", "--save-prefixes-over", "10"], "--save-prefixes-over needs --shelf-bytes"),
    (["--model", "default", "--shelf-bytes", "1G"], "--shelf-bytes bounds the prefixes --save-prefixes-over saves"),
    (["--model", "default", "--draft-model", "x"], "--draft-model (mlx_lm.server's speculative decoding) is not"),
    (["--model", "default", "--pipeline"], "--pipeline (mlx_lm.server's pipeline parallelism) is not supported"),
    (["--model", "default", "--chat-template-args", "{x"], "--chat-template-args is not JSON"),
    (["--model", "default", "--chat-template-args", "[1]"], "--chat-template-args must be a JSON object"),
])
def test_serve_refuses_in_one_line(tmp_path, args, expect):
    empty = tmp_path / "empty"
    empty.mkdir()
    r = run_inprocess("serve", empty, *args, text=True)
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("error: " + expect.format(empty=empty)) and r.stderr.count("\n") == 1, r.stderr


def test_a_shelf_that_cannot_be_a_folder_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    r = run_inprocess("serve", tmp_path / "file" / "shelf", "--model", "default", "--save-prefixes-over", 10,
                      "--shelf-bytes", "1G", text=True)
    assert (r.returncode, r.stderr.count("\n")) == (1, 1)
    assert r.stderr.startswith(f"error: cannot create the shelf folder {tmp_path / 'file' / 'shelf'}: Not a directory")


def test_of_equal_length_matches_the_most_faithful_answers_then_the_name(lm, tmp_path):
    """Two cartridges of one document: the fp16 one is used before the nvfp4 one (4 bits), whatever their names; two of one
    tier go by name."""
    from cartridge.serve.pool import Pool

    paths = {name: cartridge.build(DOC, tmp_path / f"{name}.cart", model=lm, page_size=16, tier=tier).path
             for name, tier in (("a-nvfp4", "nvfp4"), ("b-fp16", "fp16"), ("c-fp16", "fp16"))}
    prompt = cartridge.open_cartridge(paths["a-nvfp4"])[0].tokens.tolist() + [7, 8]
    for order in (list(paths), list(paths)[::-1]):
        pool = Pool({name: paths[name] for name in order}, lm)
        n = len(prompt) - 2
        assert pool.match(prompt) == [("b-fp16", n), ("c-fp16", n), ("a-nvfp4", n)]
