"""`cartridge serve` as a real process on a free 127.0.0.1 port, asked through the official `openai` client:
answers token-identical to in-process greedy generation (and to `cartridge ask`), streaming and not;
the LRU under --max-bytes; refused cartridges; 8 concurrent clients; bad requests get 4xx JSON errors."""

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.sample_utils import make_sampler

from helpers.clirun import run_inprocess, run_process
from helpers.tiny_models import TINY_CONFIG, make_tiny
from helpers.servers import free_port as _free_port, raw as _raw, wait_ready as _wait_ready

from cartridge.format.reader import open_cartridge

openai = pytest.importorskip("openai")

DOC = "The tenant may terminate this lease with 60 days of notice. Rent is 900 euros a month.\n" * 3
OTHER = "Section 2. The landlord repairs the roof; the tenant waters the garden every week.\n" * 4
QUESTION = "How much is the rent?"
SYSTEM = "Answer briefly."
MAX = 12


@pytest.fixture(scope="module")
def shelf(tiny_dir, smol_tokenizer, tmp_path_factory):
    """lease and other (the server's model), brief (lease built with a system message), wrong (another
    model's weights), broken (a flipped page byte)."""
    folder = tmp_path_factory.mktemp("shelf")
    lm = cartridge.load_model(str(tiny_dir))
    for name, text in (("lease", DOC), ("other", OTHER)):
        cartridge.build(text, folder / f"{name}.cart", model=lm, page_size=16)
    cartridge.build(DOC, folder / "brief.cart", model=lm, page_size=16, system=SYSTEM)
    wrong_dir = tmp_path_factory.mktemp("wrong-model")
    shutil.copytree(tiny_dir, wrong_dir, dirs_exist_ok=True)
    other_weights = make_tiny(smol_tokenizer, seed=1)
    from mlx.utils import tree_flatten
    mx.save_safetensors(str(wrong_dir / "model.safetensors"), dict(tree_flatten(other_weights.model.parameters())))
    cartridge.build(DOC, folder / "wrong.cart", model=cartridge.load_model(str(wrong_dir)), page_size=16)
    shutil.copytree(folder / "lease.cart", folder / "broken.cart")
    with open(folder / "broken.cart" / "pages.bin", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    return folder, lm


@pytest.fixture(scope="module")
def server(shelf, tiny_dir, tmp_path_factory):
    """The server on a free port, with room (--max-bytes) for one of the tiny cartridges at a time."""
    folder, lm = shelf
    one = cartridge.load(folder / "lease.cart", model=lm).info.data_size
    log = tmp_path_factory.mktemp("log") / "serve.log"
    for _ in range(3):  # another process may take the free port between the probe and the bind
        port = _free_port()
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "cartridge.cli.main", "serve", folder, "--model", tiny_dir,
                                     "--port", str(port), "--max-bytes", str(one + one // 2)], stdout=out, stderr=out)
        url = f"http://127.0.0.1:{port}"
        if _wait_ready(proc, port):
            break
    else:
        pytest.fail(f"the server did not start:\n{log.read_text()}")
    yield url, one
    proc.terminate()
    proc.wait(timeout=30)


def _port(url):
    return int(url.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def carts(shelf):
    folder, lm = shelf
    return {name: cartridge.load(folder / f"{name}.cart", model=lm) for name in ("lease", "other", "brief")}


def _greedy(model, tokenizer, prompt, cache=None, max_tokens=MAX, sampler=None):
    out = mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, prompt_cache=cache,
                                 sampler=sampler)
    rows = [(r.token, r.text) for r in out]
    return [t for t, _ in rows], "".join(x for _, x in rows)


def _chat(client, model, messages, **kw):
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=kw.pop("max_tokens", MAX),
                                       temperature=kw.pop("temperature", 0), extra_body={"return_token_ids": True},
                                       **kw)
    return r, r.choices[0].model_extra["token_ids"]


def _user(q=QUESTION):
    return [{"role": "user", "content": q}]


def test_models_lists_cartridges_and_base(client, server, carts, tiny_dir):
    rows = {m.id: m.model_extra for m in client.models.list().data}
    assert set(rows) == {"lease", "other", "brief", "broken", tiny_dir.name}  # wrong: another model, left out
    lease = rows["lease"]
    assert lease["tokens"] == len(carts["lease"].tokens)
    assert lease["bytes"] == carts["lease"].info.data_size == server[1]
    assert (lease["tier"], lease["base_model"], lease["cartridge"]) == ("fp16", str(tiny_dir.resolve()), True)
    assert rows[tiny_dir.name]["cartridge"] is False


def test_chat_is_token_identical_to_in_process_greedy(client, carts):
    cart = carts["lease"]
    prompt = cart.question_prompt(QUESTION)
    tokens, text = _greedy(cart.model, cart.tokenizer, prompt, cart.prompt_cache())
    r, ids = _chat(client, "lease", _user())
    assert ids == tokens
    assert r.choices[0].message.content == text
    assert r.usage.prompt_tokens_details.cached_tokens == len(cart.tokens)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(cart.tokens) + len(prompt), len(tokens))


def test_chat_stream_is_the_same_answer(client, carts):
    cart = carts["lease"]
    tokens, text = _greedy(cart.model, cart.tokenizer, cart.question_prompt(QUESTION), cart.prompt_cache())
    chunks = list(client.chat.completions.create(model="lease", messages=_user(), max_tokens=MAX, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [t for c in chunks if c.choices for t in c.choices[0].model_extra.get("token_ids") or []] == tokens
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == len(tokens)
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(cart.tokens)


def test_chat_matches_cartridge_ask(client, shelf):
    folder, _ = shelf
    ask = run_inprocess("ask", folder / "lease.cart", QUESTION, "--max-tokens", MAX, text=True)
    assert ask.returncode == 0, ask.stderr
    assert _chat(client, "lease", _user())[0].choices[0].message.content == ask.stdout.removesuffix("\n")


def test_several_turns_follow_the_document(client, carts):
    cart = carts["lease"]
    messages = [*_user(), {"role": "assistant", "content": "900 euros."}, {"role": "user", "content": "And notice?"}]
    tokens, _ = _greedy(cart.model, cart.tokenizer, cart.chat_prompt(messages), cart.prompt_cache())
    r, ids = _chat(client, "lease", messages)
    assert ids == tokens
    assert r.usage.prompt_tokens == len(cart.tokens) + len(cart.chat_prompt(messages))


def test_system_message_where_the_template_cannot_place_it(client, carts, tiny_dir):
    """SmolLM2's template puts the system message first, before the prefilled document: a cartridge built
    without it refuses it (400), one built with it (`build --system`) answers it, token-identical to the
    in-process answer; the base model takes any."""
    messages = [{"role": "system", "content": SYSTEM}, *_user()]
    with pytest.raises(openai.BadRequestError, match="puts the system message before the document"):
        _chat(client, "lease", messages)
    cart = carts["brief"]
    tokens, _ = _greedy(cart.model, cart.tokenizer, cart.chat_prompt(messages), cart.prompt_cache())
    assert _chat(client, "brief", messages)[1] == tokens
    assert _chat(client, "brief", _user())[1] == tokens  # no system message: the cartridge's applies
    with pytest.raises(openai.BadRequestError, match="prefilled with the system message 'Answer briefly.'"):
        _chat(client, "brief", [{"role": "system", "content": "Be verbose."}, *_user()])
    assert _chat(client, tiny_dir.name, messages)[0].choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_completion_continues_the_document(client, carts, stream):
    cart = carts["lease"]
    prompt = list(cart.tokenizer.encode("Question: who pays the rent?", add_special_tokens=False))
    _, text = _greedy(cart.model, cart.tokenizer, prompt, cart.prompt_cache())
    r = client.completions.create(model="lease", prompt="Question: who pays the rent?", max_tokens=MAX,
                                  temperature=0, stream=stream)
    got = "".join(c.choices[0].text for c in r if c.choices) if stream else r.choices[0].text
    assert got == text
    if not stream:
        assert r.usage.prompt_tokens_details.cached_tokens == len(cart.tokens)


def test_base_model_answers_without_a_cartridge(client, shelf, tiny_dir):
    _, lm = shelf
    prompt = lm.tokenizer.apply_chat_template(_user(), add_generation_prompt=True)
    tokens, _ = _greedy(lm.model, lm.tokenizer, prompt)
    r, ids = _chat(client, tiny_dir.name, _user())
    assert ids == tokens
    assert (r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens) == (len(prompt), 0)


def test_seed_and_stop(client, carts):
    cart = carts["lease"]
    mx.random.seed(7)
    tokens, text = _greedy(cart.model, cart.tokenizer, cart.question_prompt(QUESTION), cart.prompt_cache(),
                           sampler=make_sampler(1.0, top_p=0.9))
    for _ in range(2):
        assert _chat(client, "lease", _user(), temperature=1.0, top_p=0.9, seed=7)[1] == tokens
    stop = text[len(text) // 2:][:3]
    r, _ = _chat(client, "lease", _user(), temperature=1.0, top_p=0.9, seed=7, stop=[stop])
    assert r.choices[0].message.content == text[: text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_lru_keeps_what_fits_and_reloads(client, carts):
    for name in ("lease", "other", "lease"):
        cart = carts[name]
        tokens, _ = _greedy(cart.model, cart.tokenizer, cart.question_prompt(QUESTION), cart.prompt_cache())
        assert _chat(client, name, _user())[1] == tokens
        loaded = {m.id for m in client.models.list().data if m.model_extra["loaded"] and m.model_extra["cartridge"]}
        assert loaded == {name}  # --max-bytes holds one of them


@pytest.mark.parametrize("name, kind", [("wrong", "ModelMismatchError"), ("broken", "ChecksumError")])
def test_refused_cartridge_and_the_others_still_served(client, name, kind):
    for _ in range(2):  # the second refusal is the remembered one
        with pytest.raises(openai.UnprocessableEntityError) as e:
            _chat(client, name, _user())
        assert e.value.body["code"] == "cartridge_refused"
        assert e.value.body["message"].startswith(kind)
    assert _chat(client, "lease", _user())[0].choices[0].finish_reason == "length"


def _body(**kw):
    return json.dumps({"model": "lease", "messages": _user(), **kw}).encode()


@pytest.mark.parametrize("body, status, param", [
    (_body(model="nope"), 404, "model"),
    (b'{"model": "lease", "messages": [', 400, None),
    (b"[1, 2]", 400, None),
    (_body(messages=[]), 400, "messages"),
    (_body(messages=[{"role": "tool", "content": "x"}]), 400, "messages[0].role"),
    (_body(messages=[{"role": "user", "content": 5}]), 400, "messages[0].content"),
    (_body(max_tokens=TINY_CONFIG["max_position_embeddings"]), 400, "max_tokens"),
    (_body(max_tokens=0), 400, "max_tokens"),
    (_body(temperature=3), 400, "temperature"),
    (_body(stream="yes"), 400, "stream"),
    (_body(n=2), 400, "n"),
    (_body(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    (_body(messages=_user("word " * 600)), 400, "messages"),
    (_body(messages=["hello"]), 400, "messages[0]"),
    (_body(seed=-1, temperature=1), 400, "seed"),
    (_body(seed=2 ** 64), 400, "seed"),
    (_body(logprobs="yes"), 400, "logprobs"),
    (_body(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    (_body(top_k=-1), 400, "top_k"),
    (_body(min_p=1.5), 400, "min_p"),
    (_body(repetition_penalty=-1), 400, "repetition_penalty"),
    (_body(presence_penalty=3), 400, "presence_penalty"),
    (_body(frequency_context_size=-1), 400, "frequency_context_size"),
    (_body(logit_bias={"x": 1}), 400, "logit_bias"),
    (_body(logit_bias={"49152": 1}), 400, "logit_bias"),
    (_body(response_format={"type": "json_object"}), 400, "response_format"),
    (_body(draft_model="other"), 400, "draft_model"),
    (_body(stream_options={"include_obfuscation": True}), 400, "stream_options"),
    (_body(tools=[{"type": "function", "function": {"name": "f"}}]), 400, "tools"),
])
def test_bad_requests_get_4xx_json(server, body, status, param):
    port = _port(server[0])
    before = json.loads(_raw(port, "GET", "/stats")[1])
    got, raw = _raw(port, "POST", "/v1/chat/completions", body)
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert error["param"] == param and error["message"]
    assert _raw(port, "GET", "/v1/models")[0] == 200  # still serving
    after = json.loads(_raw(port, "GET", "/stats")[1])
    assert [after.get(k, 0) - before.get(k, 0) for k in ("requests", "refused")] == [1, 1]


@pytest.mark.parametrize("model, prompt, status, param", [
    ("lease", "word " * 600, 400, "prompt"),
    ("tiny-model", "", 400, "prompt"),  # the base model with nothing to continue
    ("lease", "x", 200, None),
])
def test_completion_prompt_errors_name_the_prompt(server, tiny_dir, model, prompt, status, param):
    model = tiny_dir.name if model == "tiny-model" else model
    got, raw = _raw(_port(server[0]), "POST", "/v1/completions",
                    json.dumps({"model": model, "prompt": prompt, "max_tokens": 2}).encode())
    assert got == status, raw
    assert json.loads(raw).get("error", {}).get("param") == param


def test_models_retrieve_one(client, server):
    assert client.models.retrieve("lease").id == "lease"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_body_of_100_mb_is_refused(server):
    port = _port(server[0])
    big = b'{"model": "lease", "prompt": "' + b"a" * (100 << 20) + b'"}'
    status, raw = _raw(port, "POST", "/v1/completions", big)
    assert (status, json.loads(raw)["error"]["code"]) == (413, "request_too_large")
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)  # no Content-Length: chunked, counted as read
    c.request("POST", "/v1/completions", body=(b"a" * (1 << 20) for _ in range(100)), encode_chunked=True)
    assert c.getresponse().status == 413
    c.close()
    assert _raw(port, "GET", "/v1/models")[0] == 200


def test_eight_concurrent_clients_get_the_sequential_answers(server, client):
    asks = [("lease", QUESTION), ("other", "Who repairs the roof?"), ("lease", "When can the tenant leave?")]
    expected = {a: _chat(client, a[0], _user(a[1]))[1] for a in asks}
    results, errors = [], []

    def worker(i):
        c = openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0, timeout=300)
        for j in range(3):
            name, q = asks[(i + j) % len(asks)]
            try:
                if (i + j) % 2:
                    chunks = c.chat.completions.create(model=name, messages=_user(q), max_tokens=MAX, temperature=0,
                                                       stream=True, extra_body={"return_token_ids": True})
                    ids = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra.get("token_ids") or []]
                else:
                    ids = _chat(c, name, _user(q))[1]
                results.append(((name, q), ids))
            except Exception as e:  # counted, not raised in the thread
                errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert errors == []
    assert len(results) == 24
    assert [key for key, ids in results if ids != expected[key]] == []


def test_client_gone_mid_stream_frees_its_slot(server, client):
    port = _port(server[0])
    before = json.loads(_raw(port, "GET", "/stats")[1])
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/chat/completions", body=_body(stream=True, max_tokens=380),
              headers={"Content-Type": "application/json"})
    r = c.getresponse()
    assert r.status == 200
    assert r.read(6) == b"data: "
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    assert _chat(client, "lease", _user())[0].choices[0].finish_reason == "length"  # the queue moves on
    after = json.loads(_raw(port, "GET", "/stats")[1])
    assert after.get("cancelled", 0) == before.get("cancelled", 0) + 1
    assert after["generated_tokens"] - before.get("generated_tokens", 0) < 380 + MAX


# In-process pieces: no server needed.

def test_stop_text_holds_back_a_possible_stop_sequence():
    from cartridge.serve.engine import StopText

    s = StopText(["END", "\n\n"])
    assert s.feed("abc E") == ("abc ", False)
    assert s.feed("N") == ("", False)
    assert s.feed("x") == ("ENx", False)
    assert s.feed("y\n") == ("y", False)
    assert s.feed("\nz") == ("", True)
    assert StopText([]).feed("E") == ("E", False)
    t = StopText(["END"])
    t.feed("a EN")
    assert t.flush() == "EN"


def test_pool_finds_cartridges_and_refuses_what_cannot_fit(shelf):
    from cartridge.errors import InputError
    from cartridge.serve.pool import Pool, Refused, find_cartridges

    folder, lm = shelf
    found = find_cartridges([folder])
    assert list(found) == ["brief", "broken", "lease", "other", "wrong"]
    assert find_cartridges([folder / "lease.cart"]) == {"lease": folder / "lease.cart"}
    assert find_cartridges([folder, folder / "lease.cart"]) == found  # the same cartridge twice: once
    twin = folder.parent / f"{folder.name}-twin"
    shutil.copytree(folder / "lease.cart", twin / "lease.cart", dirs_exist_ok=True)
    with pytest.raises(InputError, match="two cartridges are named 'lease'"):
        find_cartridges([folder, twin / "lease.cart"])
    with pytest.raises(InputError, match="neither a cartridge"):
        find_cartridges([folder / "missing"])
    pool = Pool(found, lm, max_bytes=1000)
    size = pool.entries["lease"].info.data_size
    with pytest.raises(Refused, match=f"maps {size:,} page bytes; --max-bytes is 1,000") as e:
        pool.get("lease")
    assert (e.value.status, e.value.code, pool.loaded_bytes) == (422, "cartridge_too_large", 0)


def test_pool_loading_its_nth_cartridge_computes_no_fingerprint(shelf, monkeypatch):
    """The server's model was fingerprinted once, by load_model: loading cartridges through the pool adds none."""
    from cartridge.models import loader
    from cartridge.serve.pool import Pool

    folder, lm = shelf
    calls = []
    compute = loader.fingerprint
    monkeypatch.setattr(loader, "fingerprint", lambda model, tok: calls.append(1) or compute(model, tok))
    pool = Pool({"lease": folder / "lease.cart", "other": folder / "other.cart"}, lm)
    assert pool.get("lease").info.document_tokens > 0 and pool.get("other") is not pool.get("lease")
    assert len(calls) == 0


def test_pool_verifies_again_when_the_files_change(shelf, tmp_path):
    """A refusal is forgotten once any file of the cartridge changes (here: the bad byte mended), and a loaded
    cartridge whose pages change on disk is read and verified again before it answers."""
    from cartridge.serve.pool import Pool, Refused

    folder, lm = shelf
    shutil.copytree(folder / "lease.cart", tmp_path / "lease.cart")
    pages = tmp_path / "lease.cart" / "pages.bin"
    good = pages.read_bytes()
    pool = Pool({"lease": tmp_path / "lease.cart"}, lm)
    assert pool.get("lease") is pool.get("lease")  # loaded once while nothing changes
    def rewrite(data, stamp):  # mtimes set apart: two writes within one clock tick could share one
        pages.write_bytes(data)
        os.utime(pages, ns=(stamp, stamp))

    rewrite(good[:100] + bytes([good[100] ^ 0xFF]) + good[101:], 10 ** 18)
    with pytest.raises(Refused, match="ChecksumError"):
        pool.get("lease")
    with pytest.raises(Refused, match="ChecksumError"):  # remembered while the files stay as they are
        pool.get("lease")
    rewrite(good, 10 ** 18 + 10 ** 9)
    assert pool.get("lease").info.data_size == pool.loaded_bytes == len(good)


@pytest.mark.parametrize("text, value", [("1000", 1000), ("4G", 4 << 30), ("512MiB", 512 << 20), ("1.5k", 1536)])
def test_max_bytes_sizes(text, value):
    from cartridge.cli.serve import parse_bytes

    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "-5", "4X", "lots"])
def test_max_bytes_refuses_non_sizes(text):
    from cartridge.cli.serve import parse_bytes
    from cartridge.errors import InputError

    with pytest.raises(InputError, match="is not a size"):
        parse_bytes(text)


@pytest.mark.parametrize("text", ["0", "0.5", "0K"])
def test_max_bytes_below_one_byte_says_so(text):
    from cartridge.cli.serve import parse_bytes
    from cartridge.errors import InputError

    with pytest.raises(InputError, match="is less than one byte; give at least 1"):
        parse_bytes(text)


def test_max_bytes_refuses_more_than_any_machine_has():
    from cartridge.cli.serve import MAX_SIZE, parse_bytes
    from cartridge.errors import InputError

    assert parse_bytes("1024T") == MAX_SIZE == 1 << 50
    with pytest.raises(InputError, match="is more than 1,024T"):
        parse_bytes("99999999999999999999999T", "--max-memory")


@pytest.mark.parametrize("args, expect", [
    (["/nonexistent/shelf"], "is neither a cartridge"),
    (["--max-bytes", "4X"], "is not a size"),
    (["--attention", "nope"], "attention policy 'nope' is unknown"),
])
def test_serve_refuses_bad_options_in_one_line(shelf, args, expect):
    folder, _ = shelf
    run = run_process if args[0].startswith("/") else run_inprocess  # one real process
    r = run("serve", *([] if args[0].startswith("/") else [folder]), *args, text=True)
    assert r.returncode == 1
    assert r.stderr.startswith("error: ") and expect in r.stderr and r.stderr.count("\n") == 1


def test_sigint_after_a_request_exits_quietly_with_status_0(shelf, tiny_dir, tmp_path):
    """Ctrl-C on `cartridge serve` (issue 31 trial: 1 run in 2 ended in "terminate called without an active
    exception", MLX's C++ threads at interpreter exit): uvicorn's shutdown lines, then exit status 0."""
    folder, _ = shelf
    for attempt in range(2):
        port, log = _free_port(), tmp_path / f"serve{attempt}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "cartridge.cli.main", "serve", folder, "--model", tiny_dir,
                                     "--port", str(port)], stdout=out, stderr=out)
        assert _wait_ready(proc, port), log.read_text()
        body = json.dumps({"model": "lease", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4})
        assert _raw(port, "POST", "/v1/chat/completions", body)[0] == 200  # the generation thread has run MLX
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text()
        text = log.read_text()
        assert "terminate called" not in text and "Traceback" not in text and "error:" not in text, text
        assert text.rstrip().endswith(f"Finished server process [{proc.pid}]"), text


def test_pool_leaves_out_the_cartridges_of_another_model_in_one_warning_line(shelf, caplog):
    """Read from the headers at start: another model's cartridge is not offered (not listed, not indexed); named
    anyway, it is refused saying why."""
    from cartridge.serve.pool import Pool, Refused, find_cartridges

    folder, lm = shelf
    with caplog.at_level("WARNING", logger="cartridge.serve"):
        pool = Pool(find_cartridges([folder]), lm)
    assert list(pool.left_out) == ["wrong"] and "wrong" not in {m["id"] for m in pool.models()}
    wrong = open_cartridge(folder / "wrong.cart", verify="header")[0]
    assert [r.getMessage() for r in caplog.records] == [
        f"1 cartridge left out, built with another model than {lm.label}: wrong ({wrong.model_ref})"]
    with pytest.raises(Refused, match="^ModelMismatchError: cartridge .*wrong.cart was built with model") as e:
        pool.get("wrong")
    assert e.value.status == 422
