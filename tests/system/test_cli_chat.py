"""`cartridge chat` and Ctrl-C (issue 31): Ctrl-C during an answer stops it and the conversation goes on
with the part shown as the answer; Ctrl-C or Ctrl-D at the prompt leaves with status 0. stdin is a pty
(so chat prompts as for a person); the answers are slowed by tests/helpers/interrupt_worker.py so SIGINT lands
during one. Also: a turn refused for want of room leaves the cache as it was."""

import os
import pty
import re
import select
import signal
import time

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx_lm
import numpy as np
import pytest
from helpers.interrupts import start, wait_for

from cartridge.cli.chat import Turn

Q1, Q2 = "How much is the rent?", "And the notice?"


@pytest.fixture
def terminal():
    """(master, slave) file descriptors of a fresh pty; the slave is the chat's stdin."""
    master, slave = pty.openpty()
    yield master, slave
    os.close(master)
    os.close(slave)


def read_until(fd, text, timeout=120):
    """What `fd` gives until it holds `text` (a pipe read without blocking the test forever)."""
    got, end = b"", time.monotonic() + timeout
    while text.encode() not in got:
        assert time.monotonic() < end, got.decode()
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready:
            chunk = os.read(fd, 4096)
            assert chunk, got.decode()  # the process ended first
            got += chunk
    return got.decode()


def type_in(master, text):
    os.write(master, text.encode())


def test_ctrl_c_stops_the_answer_and_the_conversation_goes_on(built, terminal, tmp_path):
    out, _ = built
    master, slave = terminal
    flag, saved = tmp_path / "flag", tmp_path / "talk.cart"
    proc = start("answer", "chat", out, "--max-tokens", 200, flag=flag, stdin=slave)
    type_in(master, Q1 + "\n")
    for question in (Q2, f"/save {saved}"):  # stop each answer after a few tokens of 200
        wait_for(flag, proc)
        proc.send_signal(signal.SIGINT)
        type_in(master, question + "\n")
    type_in(master, "\x04")  # Ctrl-D at the prompt
    stdout, stderr = (s.decode() for s in proc.communicate(timeout=120))
    assert proc.returncode == 0, stderr
    assert "error" not in stderr and "Traceback" not in stderr, stderr
    stops = re.findall(r"TTFT [\d.]+ s, (\d+) tokens?; stopped, the answer so far stays in the conversation", stderr)
    assert len(stops) == 2 and all(3 <= int(n) < 200 for n in stops), stderr
    assert f"saved {saved}" in stderr and stderr.endswith("> \n")
    # the first answer as shown: the first n tokens mlx-lm streams for Q1 (greedy), with the CLI's tokenizer
    cart = cartridge.load(out)
    stream = mlx_lm.stream_generate(cart.model, cart.tokenizer, cart.question_prompt(Q1), max_tokens=200,
                                    prompt_cache=cart.prompt_cache())
    shown = "".join(r.text for r, _ in zip(stream, range(int(stops[0]))))
    assert stdout.startswith(shown + "\n")
    # the saved conversation is Q1, that partial answer, Q2 and the second partial answer
    turns = [{"role": "user", "content": Q1}, {"role": "assistant", "content": shown}, {"role": "user", "content": Q2}]
    after = cartridge.open_cartridge(saved)[0].tokens.tolist()[len(cart.tokens):]
    conversation = cart.chat_prompt(turns)
    assert after[:len(conversation)] == conversation and len(after) == len(conversation) + int(stops[1])


def test_ctrl_c_before_the_first_token_shows_nothing_of_it(built, terminal, tmp_path):
    """Ctrl-C while the first token is computed: no text of that answer, the question dropped, and the next
    question answered as the conversation's first."""
    from helpers.clirun import run_inprocess as run

    out, _ = built
    master, slave = terminal
    flag = tmp_path / "flag"
    proc = start("first", "chat", out, "--max-tokens", 4, flag=flag, stdin=slave)
    type_in(master, Q1 + "\n")
    wait_for(flag, proc)
    proc.send_signal(signal.SIGINT)
    type_in(master, Q2 + "\n")
    wait_for(flag, proc)
    type_in(master, "\x04")
    stdout, stderr = (s.decode() for s in proc.communicate(timeout=120))
    assert proc.returncode == 0, stderr
    assert stderr.count("(stopped before the answer began; the question is dropped)") == 1, stderr
    assert stdout == run("ask", out, Q2, "--max-tokens", "4").stdout.decode()


@pytest.mark.parametrize("key", ["ctrl-c", "ctrl-d"])
def test_ctrl_c_or_ctrl_d_at_the_prompt_leaves_quietly(built, terminal, tmp_path, key):
    out, _ = built
    master, slave = terminal
    proc = start("none", "chat", out, flag=tmp_path / "flag", stdin=slave)
    err = read_until(proc.stderr.fileno(), "\n> ")
    if key == "ctrl-c":
        proc.send_signal(signal.SIGINT)
    else:
        type_in(master, "\x04")
    stdout, rest = proc.communicate(timeout=120)
    assert proc.returncode == 0 and stdout == b"" and rest == b"\n", err + rest.decode()


def test_ctrl_c_at_the_prompt_after_an_answer_leaves_and_ctrl_d_after_it_is_harmless(built, terminal, tmp_path):
    """The new-user trial's keys (issue 31): a turn answered, then Ctrl-C at the empty prompt, then Ctrl-D."""
    out, _ = built
    master, slave = terminal
    proc = start("none", "chat", out, "--max-tokens", 3, flag=tmp_path / "flag", stdin=slave)
    read_until(proc.stderr.fileno(), "\n> ")
    type_in(master, Q1 + "\n")
    err = read_until(proc.stderr.fileno(), "tokens\n> ")  # the answer's TTFT line, then the next prompt
    proc.send_signal(signal.SIGINT)
    type_in(master, "\x04")
    stdout, rest = proc.communicate(timeout=120)
    assert proc.returncode == 0 and rest == b"\n", err + rest.decode()
    assert stdout.count(b"\n") == 1 and stdout.strip(), stdout  # the one answer, nothing after it


def test_piped_chat_echoes_each_question(built):
    from helpers.clirun import run_process
    from helpers.clirun import run_inprocess as run

    out, _ = built
    r = run_process("chat", out, "--max-tokens", "4", stdin=f"{Q1}\n\n{Q2}\n".encode())
    assert r.returncode == 0, r.stderr.decode()
    lines = r.stdout.decode().splitlines()
    assert len(lines) == 4 and lines[0] == f"> {Q1}" and lines[2] == f"> {Q2}"
    assert lines[1] == run("ask", out, Q1, "--max-tokens", "4").stdout.decode().strip()


def test_a_turn_without_room_leaves_the_cache_as_it_was(built, tiny):
    out, _ = built
    cart = cartridge.load(out, model=tiny)
    refused, done = cart.prompt_cache(), cart.prompt_cache()
    for cache, questions in ((refused, [Q1, "Who may terminate the lease? " * 100, Q2]), (done, [Q1, Q2])):
        messages, saved, turn = [], [], Turn(cart, 4, None, None)
        for q in questions:
            turn(cache, messages, saved, q)
        assert [m["content"] for m in messages[::2]] == [Q1, Q2]
    assert refused.tokens == done.tokens and refused[0].offset == done[0].offset
    for a, b in zip(refused, done):  # the same K/V: the refused turn's trim was undone
        for x, y in zip(a.tail_kv(), b.tail_kv()):
            np.testing.assert_array_equal(np.array(x), np.array(y))
