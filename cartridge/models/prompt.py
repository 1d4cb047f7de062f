"""Split one rendered prompt into the cartridge prefix and a per-question suffix (spec/FORMAT.md 5.4),
and render a conversation that continues after the document (`conversation_tokens`).

The full prompt is the chat template applied to one user turn whose content is
`document + separator + question`, with the assistant header appended. The prefix is everything
through the end of the document; `question_tokens` renders the rest. The split is checked to be
token-stable: prefix tokens + suffix tokens == tokens of the full rendered prompt.

Models without a chat template use plain text: `document + separator + "Question: " + question +
"\nAnswer:"`; an answer there ends where the model starts the next turn (`stop_strings`).
"""

import unicodedata

from ..errors import InputError


def check_text(text, what):
    """Refuse text a prompt cannot be made of: not a str, not encodable as UTF-8 (a lone surrogate,
    as Python makes of undecodable command-line bytes), or blank: only whitespace and invisible
    format or control characters (a byte-order mark, zero-width spaces).

    Args:
        text: the value to check. what (str): how to name it in the error, e.g. "the corpus".

    Raises:
        InputError: as described.
    """
    if not isinstance(text, str):
        raise InputError(f"{what} must be text (str), got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InputError(f"{what} is not valid UTF-8 (undecodable byte at character {e.start})") from None
    if all(ch.isspace() or unicodedata.category(ch) in ("Cf", "Cc") for ch in text):
        raise InputError(f"{what} is empty (or only whitespace)")

SEPARATOR = "\n\n"
CHAT, PLAIN = "chat_template", "plain"
_DOC, _QUESTION = "\x00CARTRIDGE_DOCUMENT\x00", "\x00CARTRIDGE_QUESTION\x00"
_ANSWER = "\x00CARTRIDGE_ANSWER\x00"


def prompt_mode(tokenizer):
    """CHAT if the tokenizer has a chat template, else PLAIN."""
    return CHAT if getattr(tokenizer, "chat_template", None) else PLAIN


def stop_strings(mode):
    """Text that ends an answer in prompt mode `mode`, besides the tokenizer's end-of-sequence tokens.

    A model without a chat template (PLAIN) has no end-of-turn token: it goes on writing the plain
    prompt's next turn, a new "Question:" line (spec/FORMAT.md 5.4). With a chat template the turn ends
    with the template's end-of-turn token, which mlx-lm counts among the EOS tokens: no text is needed.

    Args:
        mode (str): CHAT or PLAIN.

    Returns:
        tuple[str, ...]: the stop strings; the answer is the text before the first one.
    """
    return ("\nQuestion:",) if mode == PLAIN else ()


def find_stop(text, stops):
    """Where a streamed answer ends, and how much of it can be shown before more text arrives.

    Args:
        text (str): the answer's text so far. stops (Sequence[str]): stop strings (`stop_strings`, a
            request's own).

    Returns:
        tuple[int, bool]: (end, stopped). stopped: the answer is `text[:end]`, cut before the first stop
        string found. Not stopped: `text[:end]` can be shown; the rest may be the start of a stop string.
    """
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    if found:
        return min(found), True
    held = max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    return len(text) - held, False


def _system_turn(system, mode):
    """[the system message] to render before the document's user turn ([] without one)."""
    if system is None:
        return []
    if mode == PLAIN:
        raise InputError("a system message needs a chat template; this model has none")
    check_text(system, "the system message")
    return [{"role": "system", "content": system}]


def prompt_pieces(tokenizer, mode, separator, system=None):
    """The fixed text around the document and the question in the rendered prompt (spec 5.4).

    Args:
        tokenizer: mlx-lm TokenizerWrapper or HF tokenizer (its chat template in chat mode).
        mode (str): the prompt mode (`PLAIN` or chat template). separator (str): between document and
            question. system (str | None): a system message, rendered where the chat template puts it.

    Returns:
        tuple[str, str, str]: (head, middle, tail); the prompt is head + document + middle + question + tail.

    Raises:
        InputError: the chat template does not render the user message verbatim, or a bad system message.
    """
    if mode == PLAIN:
        _system_turn(system, mode)
        return "", separator + "Question: ", "\nAnswer:"
    messages = _system_turn(system, mode) + [{"role": "user", "content": _DOC + separator + _QUESTION}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if text.count(_DOC) != 1 or text.count(_QUESTION) != 1 or text.index(_DOC) > text.index(_QUESTION):
        raise InputError("the chat template does not render the user message verbatim; cannot split the prompt")
    head, rest = text.split(_DOC)
    middle, tail = rest.split(_QUESTION)
    return head, middle, tail


def encode_text(tokenizer, text, first):
    """Token ids of a piece of the rendered prompt, encoded as mlx-lm encodes a prompt.

    Args:
        tokenizer: mlx-lm TokenizerWrapper or HF tokenizer. text (str): the piece.
        first (bool): the piece starts the sequence; only then may special tokens (BOS) be added.

    Returns:
        list[int]: the ids.
    """
    # mlx-lm's rule (generate.stream_generate): add special tokens unless the text already starts with BOS
    bos = getattr(tokenizer, "bos_token", None)
    special = first and (bos is None or not text.startswith(bos))
    return list(tokenizer.encode(text, add_special_tokens=special))


def full_prompt_tokens(tokenizer, document, question, mode=None, separator=SEPARATOR, system=None):
    """Tokens of the whole rendered prompt (document and question), as mlx-lm would encode it.

    Args:
        tokenizer: mlx-lm TokenizerWrapper or HF tokenizer.
        document (str): the corpus text (trailing whitespace is removed, as in the prefix).
        question (str): the question.
        system (str | None): a system message before the document's turn. Default: None.

    Returns:
        list[int]
    """
    mode = mode or prompt_mode(tokenizer)
    head, middle, tail = prompt_pieces(tokenizer, mode, separator, system)
    return encode_text(tokenizer, head + document.rstrip() + middle + question + tail, True)


def prefix_tokens(tokenizer, document, mode=None, separator=SEPARATOR, system=None):
    """Tokens of the cartridge prefix: the template's opening through the end of the document.

    Args:
        tokenizer: mlx-lm TokenizerWrapper or HF tokenizer.
        document (str): non-empty corpus text.
        system (str | None): a system message the template renders before the document. Default: None.

    Returns:
        list[int]

    Raises:
        InputError: if the document is empty, or if the split is not token-stable for this tokenizer.
    """
    check_text(document, "the corpus")
    mode = mode or prompt_mode(tokenizer)
    document = document.rstrip()
    head, _, _ = prompt_pieces(tokenizer, mode, separator, system)
    prefix = encode_text(tokenizer, head + document, True)
    probe = "Is this split stable?"
    if prefix + question_tokens(tokenizer, probe, mode, separator, system) != full_prompt_tokens(
        tokenizer, document, probe, mode, separator, system
    ):
        raise InputError("prefix + question tokens differ from the full prompt's tokens for this tokenizer")
    return prefix


def question_tokens(tokenizer, question, mode, separator=SEPARATOR, system=None):
    """Tokens that follow the prefix: separator, question, end of turn and assistant header.

    Returns:
        list[int]

    Raises:
        InputError: if the question is empty.
    """
    check_text(question, "the question")
    _, middle, tail = prompt_pieces(tokenizer, mode, separator, system)
    return encode_text(tokenizer, middle + question + tail, False)


def followup_tokens(tokenizer, question, mode, separator=SEPARATOR, last_token=None):
    """Tokens of a next question after a conversation (a saved conversation cartridge's tokens):
    the end of the assistant's turn, a new user turn with `question`, the assistant header.

    Args:
        tokenizer: mlx-lm TokenizerWrapper or HF tokenizer. question (str): the question.
        mode (str): "chat_template" or "plain". separator (str): the prompt separator (plain mode).
        last_token (int | None): the conversation's last token; when it is the token the template
            closes an assistant turn with (the answer stopped there), it is not repeated.

    Returns:
        list[int]

    Raises:
        InputError: if the question is empty or the template does not render the turns verbatim.
    """
    check_text(question, "the question")
    if mode == PLAIN:
        return encode_text(tokenizer, separator + "Question: " + question + "\nAnswer:", False)
    messages = [{"role": "user", "content": _DOC}, {"role": "assistant", "content": _ANSWER},
                {"role": "user", "content": _QUESTION}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    if any(text.count(m) != 1 for m in (_DOC, _ANSWER, _QUESTION)) or not text.index(_ANSWER) < text.index(_QUESTION):
        raise InputError("the chat template does not render the conversation verbatim; cannot add a question")
    ids = encode_text(tokenizer, text.split(_ANSWER)[1].replace(_QUESTION, question), False)
    return ids[1:] if ids and last_token is not None and ids[0] == last_token else ids


ROLES = ("system", "user", "assistant")


def check_messages(messages):
    """Refuse a conversation that is not a non-empty list of {"role", "content"} turns ending with a user
    turn, with text content and at least one user turn before any assistant turn.

    Raises:
        InputError: naming the first bad turn.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InputError("messages must be a non-empty list of {\"role\": ..., \"content\": ...} turns")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise InputError(f"message {i} must be a dict whose role is one of {', '.join(ROLES)}; got {m!r:.80}")
        check_text(m.get("content"), f"message {i} ({m['role']}) content")
    turns = [m["role"] for m in messages if m["role"] != "system"]
    if not turns or turns[0] != "user":
        raise InputError("the first message after any system message must be a user turn")
    if turns[-1] != "user":
        raise InputError(f"the last message must be a user turn (the model answers it), not {turns[-1]}")


def conversation_tokens(tokenizer, messages, mode, separator=SEPARATOR, system=None):
    """Tokens that follow the cartridge prefix for a whole conversation about the document.

    The first user turn is joined to the document as `document + separator + content` (as
    `question_tokens` does for one question); the chat template renders the rest, with the assistant
    header at the end. Without a chat template: "Question: ...\nAnswer: ..." turns.

    Args:
        tokenizer: mlx-lm TokenizerWrapper. messages (list[dict]): OpenAI-style role/content turns
            that continue after the document; the last is a user turn.
        mode (str): CHAT or PLAIN (the cartridge's prompt mode). separator (str): the cartridge's.
        system (str | None): the system message the cartridge was built with (`prompt.system`): a
            conversation without a system message is answered as if it had sent this one.

    Returns:
        list[int]: with the prefix tokens before them, the tokens of the whole rendered conversation.

    Raises:
        InputError: bad messages (`check_messages`), or a system message that the template places
            before the document and that differs from the cartridge's (the cartridge holds the prefill
            of its own opening, so it cannot).
    """
    check_messages(messages)
    if system is not None and not any(m["role"] == "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    if mode == PLAIN:
        if any(m["role"] == "system" for m in messages):
            raise InputError("a system message needs a chat template; this cartridge's model has none")
        text = separator
        for m in messages:
            text += (f"Question: {m['content']}\nAnswer:" if m["role"] == "user" else f" {m['content'].strip()}\n\n")
        return encode_text(tokenizer, text, False)
    first_user = next(i for i, m in enumerate(messages) if m["role"] == "user")
    turns = [dict(m) for m in messages]
    turns[first_user]["content"] = _DOC + separator + turns[first_user]["content"]
    text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    head, _, _ = prompt_pieces(tokenizer, mode, separator, system)
    if text.count(_DOC) != 1 or not text.startswith(head) or text.index(_DOC) != len(head):
        built = "no system message" if system is None else f"the system message {system[:60]!r}"
        raise InputError(f"this model's chat template puts the system message before the document, which the "
                         f"cartridge holds already prefilled with {built}; send that one (or none), or build a "
                         f"cartridge with `cartridge build --system`")
    return encode_text(tokenizer, text[len(head) + len(_DOC):], False)
