"""The sample document and its questions (samples/), which the real-model tests ask."""

import json

from helpers import ROOT

SAMPLE = ROOT / "samples" / "lgpl-3.0.txt"
QUESTIONS = ROOT / "samples" / "lgpl-3.0.questions.jsonl"


def sample_questions(n=None):
    """The sample's questions (dicts of samples/lgpl-3.0.questions.jsonl), the first `n` if given."""
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    return rows[:n] if n else rows
