"""The prompt tokens of a request: for the base model (the chat template over every message, as
mlx_lm.server renders it; without a template, the plain Question/Answer prompt `ask` uses) or after a named cartridge's document; and where the reusable prefix of a
base-model prompt ends (what `--save-prefixes-over` saves).

The reusable prefix is the rendered prompt up to the end of the document in the last user message: its
text before the last blank line (`models.prompt.SEPARATOR`), trailing whitespace dropped; with no blank
line, everything before that message's text. A client that sends `document + "\\n\\n" + question` (every
chat UI that pastes a document) thus gets the same prefix as `cartridge build` of that document
(`models.prompt.prefix_tokens`), whatever the question.
"""

from dataclasses import dataclass

from ..models.prompt import PLAIN, SEPARATOR, encode_text, prompt_mode, prompt_pieces, stop_strings
from .protocol import bad


def default_stops(tokenizer, mode):
    """Stop strings a prompt of `mode` (`models.prompt.CHAT` or `PLAIN`) gets besides the request's own `stop`:
    a model without a chat template stops before the plain prompt's next "Question:" turn
    (`models.prompt.stop_strings`), as `ask` and `chat` do.

    Returns:
        list[str]
    """
    return list(stop_strings(mode))


@dataclass
class BasePrompt:
    """A base-model prompt: its tokens, its text and where its reusable prefix ends.

    Attributes:
        tokens (list[int]): the prompt tokens. text (str): the rendered text they encode.
        cut (int): characters of `text` before the reusable prefix ends; 0 when it has none.
        mode (str): the prompt mode (`models.prompt.CHAT` or `PLAIN`).
    """

    tokens: list
    text: str
    cut: int
    mode: str

    def prefix_length(self, tokenizer):
        """Tokens of the reusable prefix: those of `text[:cut]` that the whole prompt's tokens start with
        (a token the cut splits is left out), at most all but the last prompt token.

        Returns:
            int: 0 when there is none.
        """
        if not self.cut:
            return 0
        head = encode_text(tokenizer, self.text[:self.cut], True)
        n = next((i for i, (a, b) in enumerate(zip(head, self.tokens)) if a != b), min(len(head), len(self.tokens)))
        return min(n, len(self.tokens) - 1)


def _document_end(content):
    """Characters of a message's text that are its document: up to the last blank line, trailing
    whitespace dropped (0 with no blank line)."""
    at = content.rfind(SEPARATOR)
    return len(content[:at].rstrip()) if at > 0 else 0


def chat_text(tokenizer, messages, template_args):
    """The base model's rendering of chat turns when the tokenizer has a chat template: the template with
    the generation prompt (and `template_args`)."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_args)


def plain_text(messages):
    """The base model's rendering of chat turns when the tokenizer has no chat template: the plain prompt
    `ask` uses (`models.prompt.prompt_pieces` in PLAIN mode), so the answer ends at the next "Question:"
    line and a cartridge built of the document is a prefix of it. A user turn's text before its last blank
    line is its document (trailing whitespace dropped), the rest its question (no blank line: all of it);
    a turn renders as `document + "\n\n" + "Question: " + question + "\nAnswer:"`, an assistant turn as
    `" " + text + "\n\n"` (as `conversation_tokens` does), a system message as its text and a blank line.

    Returns:
        tuple[str, int]: (text, cut): the rendered prompt and the characters of it through the end of
        the last user turn's document (0 when that turn has none).
    """
    text, cut = "", 0
    for m in messages:
        content = m["content"]
        if m["role"] == "system":
            text += content.strip() + SEPARATOR
        elif m["role"] == "assistant":
            text += f" {content.strip()}" + SEPARATOR
        else:
            end = _document_end(content)
            question = content[content.rfind(SEPARATOR) + len(SEPARATOR):] if end else content
            cut = len(text) + end if end else 0
            head, middle, tail = prompt_pieces(None, PLAIN, SEPARATOR)
            text += head + (content[:end] + middle if end else middle.lstrip()) + question.strip() + tail
    return text, cut


def base_prompt(tokenizer, request, template_args=None):
    """The prompt of a request answered by the base model.

    Args:
        tokenizer: mlx-lm TokenizerWrapper. request (protocol.Request).
        template_args (dict | None): the server's `--chat-template-args`; the request's
            `chat_template_kwargs` are laid over them (as mlx_lm.server does). Default: None.

    Returns:
        BasePrompt

    Raises:
        APIError: 400 for an empty completion prompt.
    """
    mode = prompt_mode(tokenizer)
    if request.kind == "completion":
        tokens = encode_text(tokenizer, request.prompt, True)
        if not tokens:
            raise bad("'prompt' is empty; the base model needs at least one prompt token", "prompt")
        return BasePrompt(tokens, request.prompt, _document_end(request.prompt), mode)
    if mode == PLAIN:
        text, cut = plain_text(request.messages)
        return BasePrompt(encode_text(tokenizer, text, True), text, cut, mode)
    text = chat_text(tokenizer, request.messages, {**(template_args or {}), **(request.chat_template_kwargs or {})})
    last = next(m["content"] for m in reversed(request.messages) if m["role"] == "user")
    at = text.rfind(last) if last else -1
    cut = 0 if at < 0 else at + _document_end(last)  # a template that rewrites the text: no reusable prefix
    return BasePrompt(encode_text(tokenizer, text, True), text, cut, mode)


def cartridge_prompt(cart, request):
    """Prompt tokens that follow a cartridge's document: the chat turns (`Cartridge.chat_prompt`), or the
    completion prompt's text continuing the document.

    Raises:
        APIError: 400 for an empty completion prompt, or `chat_template_kwargs` (a cartridge's turns are
        rendered as it was built).
    """
    if request.chat_template_kwargs:
        raise bad("'chat_template_kwargs' applies to the base model's prompts; a cartridge's turns are rendered as "
                  "it was built", "chat_template_kwargs")
    if request.kind == "chat":
        return cart.chat_prompt(request.messages)
    if not request.prompt:
        raise bad("'prompt' is empty; a cartridge needs at least one token after its document", "prompt")
    return encode_text(cart.tokenizer, request.prompt, False)
