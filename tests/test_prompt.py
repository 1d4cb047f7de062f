"""Prompt split: prefix + question tokens equal the tokens of the full rendered prompt."""

import pytest

from cartridge.errors import InputError
from cartridge.models.prompt import CHAT, PLAIN, full_prompt_tokens, prefix_tokens, question_tokens

DOCS = [
    "A short document.",
    "Ends with digits 2024",
    "Trailing whitespace is dropped.   \n\n",
    "Unicode: naïve café — 東京\nsecond line!",
    "Ends with a quote's",
]
QUESTIONS = ["Who?", "What is 2+2?", " leading space", "multi\nline question?"]


@pytest.mark.parametrize("mode", [CHAT, PLAIN])
def test_prefix_plus_question_equals_full_prompt(smol_tokenizer, mode):
    for doc in DOCS:
        prefix = prefix_tokens(smol_tokenizer, doc, mode)
        for q in QUESTIONS:
            with_cartridge = prefix + question_tokens(smol_tokenizer, q, mode)
            assert with_cartridge == full_prompt_tokens(smol_tokenizer, doc, q, mode), (doc, q)


def test_chat_prefix_is_template_opening_through_document(smol_tokenizer):
    prefix = prefix_tokens(smol_tokenizer, "Hello world.", CHAT)
    text = smol_tokenizer.decode(prefix)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHello world.")
    suffix = smol_tokenizer.decode(question_tokens(smol_tokenizer, "Why?", CHAT))
    assert suffix == "\n\nWhy?<|im_end|>\n<|im_start|>assistant\n"


def test_empty_document_and_question_are_refused(smol_tokenizer):
    with pytest.raises(InputError, match="empty"):
        prefix_tokens(smol_tokenizer, "  \n ", CHAT)
    with pytest.raises(InputError, match="question is empty"):
        question_tokens(smol_tokenizer, "   ", CHAT)
