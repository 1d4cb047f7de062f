"""Prompt split: prefix + question tokens equal the tokens of the full rendered prompt."""

import pytest

from cartridge.errors import InputError
from cartridge.models.prompt import (CHAT, PLAIN, conversation_tokens, find_stop, full_prompt_tokens, prefix_tokens,
                                     question_tokens, stop_strings)

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


def test_a_base_model_answer_stops_at_the_plain_prompts_next_turn():
    assert stop_strings(PLAIN) == ("\nQuestion:",) and stop_strings(CHAT) == ()
    stops = stop_strings(PLAIN)
    assert find_stop(" 900 euros.\n\nQuestion: Who?", stops) == (12, True)  # the answer is text[:12] (+ "\n")
    assert find_stop(" 900 euros.\nQuest", stops) == (11, False)  # "\nQuest" may begin a stop: not shown yet
    assert find_stop(" 900 euros.\nQuestions remain", stops) == (28, False)  # ... and then it is, whole
    assert find_stop(" 900 euros. Questions: none", stops) == (27, False)  # a "Question" not on a new line
    assert find_stop("a STOP b", ["zz", " b", "STOP"]) == (2, True)  # the stop string first in the text wins
    assert find_stop("abc", ()) == (3, False)


def test_a_plain_conversation_renders_answers_as_the_model_writes_them(smol_tokenizer):
    """An answer's own leading space (" Nine ...", as generated after "Answer:") is not doubled."""
    turns = [{"role": "user", "content": "Rent?"}, {"role": "assistant", "content": " Nine hundred euros.\n"},
             {"role": "user", "content": "Notice?"}]
    text = smol_tokenizer.decode(conversation_tokens(smol_tokenizer, turns, PLAIN))
    assert text == "\n\nQuestion: Rent?\nAnswer: Nine hundred euros.\n\nQuestion: Notice?\nAnswer:"
