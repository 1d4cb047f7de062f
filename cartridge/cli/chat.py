"""`cartridge chat`: an interactive conversation about a cartridge's document on one cache. Thin: read a
line, call the library, print."""

import contextlib
import signal
import sys
from pathlib import Path

import click

from cartridge.errors import CartridgeError, InputError
from cartridge.format.reader import open_cartridge
from cartridge.models.prompt import check_text

from .ask import (ATTENTION_HELP, MAX_TOKENS_HELP, MODEL_HELP, answer, check_room, check_system_prompt, load_cartridge,
                  memory_lines)
from .generation import generation_options, make_sampler, plain_prompt_note
from .serve import MAX_MEMORY_HELP

COMMANDS = "/reset, /save FILE, /quit"


@click.command()
@click.argument("path")
@click.option("--prompt", "-p", "prompt", default=None, metavar="TEXT", help="The first turn, answered before any "
              "line is read.")
@click.option("--max-tokens", "-m", type=int, default=None, help=MAX_TOKENS_HELP)
@generation_options
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--attention", default="auto", show_default=True, help=ATTENTION_HELP)
@click.option("--max-memory", default=None, help=MAX_MEMORY_HELP)
def chat(path, prompt, max_tokens, generation, model, attention, max_memory):
    """Talk about the document in the cartridge at PATH: one line a turn, answers streamed.

    /reset starts over from the bare document; /save FILE writes the document and the conversation so far
    as a new cartridge (continue it with `cartridge ask FILE QUESTION`); /quit, end of input (Ctrl-D) or
    Ctrl-C at the prompt leaves. Ctrl-C during an answer stops it and returns to the prompt: the part
    shown stays in the conversation as the answer (an answer stopped before any text is dropped with its
    question). With piped input each question is echoed ("> QUESTION") before its answer."""
    if max_tokens is not None and max_tokens < 1:
        raise InputError(f"--max-tokens is {max_tokens}; it must be at least 1")
    _refuse_saved_conversation(path)  # before the model is loaded
    check_system_prompt(path, generation["system_prompt"])
    if prompt is not None:
        check_text(prompt, "the question")
    cart, load_s = load_cartridge(path, model, attention, max_memory=max_memory)
    check_room(cart, cart.prompt_cache(), [], max_tokens, "the first turn")
    turn = Turn(cart, max_tokens, make_sampler(generation), generation["system_prompt"])
    if turn.system is not None:  # a system message the cartridge cannot take is refused now, not at every turn
        cart.chat_prompt([*turn.opening(), {"role": "user", "content": "?"}])
    tty = sys.stdin.isatty()
    click.echo(f"{Path(path).name}: {len(cart.tokens):,} tokens loaded in {load_s:.1f} s; {COMMANDS}", err=True)
    for line in [*memory_lines(cart), plain_prompt_note(cart.info)]:
        if line is not None:
            click.echo(line, err=True)
    cache, messages, saved = cart.prompt_cache(), turn.opening(), []  # saved: the tokens after the document so far
    if prompt is not None:
        click.echo(f"> {prompt}")
        turn(cache, messages, saved, prompt)
    while (line := _read_line(tty)) is not None and line != "/quit":
        if line.startswith("/"):
            messages = _command(cart, cache, line, messages, saved, turn)
        elif line:
            if not tty:
                click.echo(f"> {line}")  # the transcript on stdout reads as a conversation
            turn(cache, messages, saved, line)


def _refuse_saved_conversation(path):
    """Chat renders conversations from the bare document: a saved one is continued with `ask`."""
    info, data = open_cartridge(path, "header")
    data.close()
    if info.document_tokens < len(info.tokens):
        raise InputError(f"{path} holds a saved conversation; continue it with `cartridge ask {path} QUESTION`")


def _read_line(tty):
    """The next line, stripped; None at the end of input or on Ctrl-C at the prompt (the chat ends)."""
    try:
        if tty:
            click.echo("> ", nl=False, err=True)
        line = sys.stdin.readline()
    except KeyboardInterrupt:
        line = ""
    if not line:
        if tty:
            click.echo(err=True)  # the shell's prompt on a line of its own
        return None
    return line.strip()


def _command(cart, cache, line, messages, saved, turn):
    """Run /reset or /save FILE (anything else is refused in one line); returns the conversation after it."""
    if line.startswith("/save"):
        _save(cart, cache, line, saved)
    elif line == "/reset":
        cart.reset(cache)
        saved[:] = []
        click.echo("(conversation reset)", err=True)
        return turn.opening()
    else:
        click.echo(f"unknown command {line.split()[0]}; {COMMANDS}", err=True)
    return messages


class Turn:
    """One turn of the chat: the question after the conversation so far, answered with the command's options.

    Attributes:
        cart (Cartridge), max_tokens (int | None), sampler (callable): what `answer` takes.
        system (str | None): --system-prompt, the conversation's first message where given.
    """

    def __init__(self, cart, max_tokens, sampler, system):
        self.cart, self.max_tokens, self.sampler, self.system = cart, max_tokens, sampler, system

    def opening(self):
        """The messages a conversation starts with: the --system-prompt, if any."""
        return [] if self.system is None else [{"role": "system", "content": self.system}]

    def __call__(self, cache, messages, saved, line):
        """Answer `line` after the conversation so far and add both to `messages`; Ctrl-C stops the answer."""
        cart = self.cart
        messages.append({"role": "user", "content": line})
        try:
            prompt = cart.chat_prompt(messages, cache)
        except InputError as e:
            messages.pop()
            click.echo(f"error: {e} (/reset to start over)", err=True)
            return
        kept = len(cache.tokens) - len(prompt)  # tokens of the turns before that the cache still holds
        try:
            with _ctrl_c_stops() as stop:
                r = answer(cart, prompt, cache, self.max_tokens, "this turn", stop=stop, sampler=self.sampler)
        except InputError as e:  # no room for this turn: the cache was trimmed for it, and claims its tokens
            _drop_turn(cache, messages, kept)
            click.echo(f"error: {e} (/reset to start over)", err=True)
            return
        if r["stopped"] and not r["answer"].strip():
            _drop_turn(cache, messages, kept)
            click.echo("(stopped before the answer began; the question is dropped)", err=True)
            return
        messages.append({"role": "assistant", "content": r["answer"]})
        saved[:] = cache.tokens + r["token_ids"]  # what the cache holds after the document
        stopped = "; stopped, the answer so far stays in the conversation" if r["stopped"] else ""
        click.echo(f"TTFT {r['ttft_s']:.3f} s, {r['tokens']} token{'' if r['tokens'] == 1 else 's'}{stopped}", err=True)


def _drop_turn(cache, messages, kept):
    """Forget the last question: the cache back to the `kept` tokens it shared with the turns before."""
    messages.pop()
    cache.trim_tail(kept)
    cache.tokens = cache.tokens[:kept]


@contextlib.contextmanager
def _ctrl_c_stops():
    """Within it Ctrl-C (SIGINT) only sets a flag, asked between two tokens: the answer stops with the cache
    holding exactly what was fed, not with an exception inside the model's forward pass (some layers fed,
    others not). Yields the callable that says whether Ctrl-C came."""
    came = []
    previous = signal.signal(signal.SIGINT, lambda *_: came.append(True))
    try:
        yield lambda: bool(came)
    finally:
        signal.signal(signal.SIGINT, previous)


def _save(cart, cache, line, saved):
    """/save FILE: the document + the conversation so far as a new cartridge; errors stay one line."""
    target = line[len("/save"):].strip()
    if not target or not saved:
        click.echo("error: /save FILE needs a file name and at least one answered turn", err=True)
        return
    if Path(target).exists():  # chat has no --force: say what to do here instead
        click.echo(f"error: {target} exists; /save to a new name (chat never replaces a file)", err=True)
        return
    try:
        r = cart.save(target, cache, tokens=list(saved))
    except CartridgeError as e:
        click.echo(f"error: {e}", err=True)
        return
    click.echo(f"saved {r.path}: {r.tokens} tokens", err=True)
