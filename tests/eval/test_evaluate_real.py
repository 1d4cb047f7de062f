"""`cartridge eval` on the real default model and the sample, kept small for CI (3 questions x 20
tokens, no needles, a short --heldout text so one cartridge per spec serves both uses): two fp16 cartridges built apart agree exactly, and the fp16
cartridge answers exactly like a fresh prefill of the full prompt. Needle recall on the real model is
measured by the `make eval` run (docs/evaluation.md)."""

import pytest
from helpers.samples import SAMPLE, sample_questions

from cartridge.eval.evaluate import FRESH, EvalConfig, evaluate
from cartridge.eval.spec import Spec

pytestmark = pytest.mark.slow
HELDOUT = ("This license is a set of additional permissions added to the GNU General Public License. "
           "A library released under it may be linked by programs whose own terms differ, provided that the "
           "user can relink the program with a modified version of the library.")


def test_fp16_vs_fp16_and_fresh_prefill_agree_on_the_real_model(real_model, tmp_path):
    n_layers = len(real_model.model.layers)
    again = Spec("fp16 again", {"schema": [{"layer": i, "k": "fp16", "v": "fp16"} for i in range(n_layers)]})
    r = evaluate(SAMPLE.read_text(), sample_questions(3), model=real_model, specs=[again],
                 config=EvalConfig(max_tokens=20, work_dir=tmp_path, heldout=HELDOUT))
    rows = {row["label"]: row for row in r["rows"]}
    assert rows["fp16"]["probe_cartridge"] == rows["fp16"]["qa_cartridge"]
    assert r["documents"]["qa_tokens"] >= 1500
    cmp = rows["fp16 again"]["vs_fp16"]
    assert (cmp["first_token"], cmp["exact"], cmp["bleu"]) == (3, 3, 1.0)
    assert rows["fp16 again"]["perplexity_change"] == 0.0
    fresh = rows[FRESH]["vs_fp16"]
    assert (fresh["first_token"], fresh["exact"], fresh["bleu"]) == (3, 3, 1.0)
    assert abs(rows[FRESH]["perplexity_change"]) < 0.01
    assert 1.0 < rows["fp16"]["perplexity"] < 100.0
