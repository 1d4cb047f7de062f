"""Issue 31 item 0 harness (not collected by pytest): ONE cache of a real cartridge, 12 turns of N-token questions
(default 45) and 12 greedy tokens through mlx_lm.generate.generate_step, each turn against a fresh mlx-lm prefill of
the token stream the cache has seen (one prefill after the last turn: a position's logits do not depend on later
tokens). Usage: python tests/helpers/generate_turns_real.py CART [N] (9-13 minutes on the shared 2-core CPU, load 13-25)."""
import importlib.metadata
import sys

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
cart = cartridge.load(sys.argv[1])
model, tok = cart.model, cart.tokenizer
doc = cart.tokens
QUESTIONS = ["Who may terminate the agreement, and under which conditions does the license say that rights end?",
 "What does the license say about combined works and the object code that must be provided to users?",
 "Explain the difference between the Library and an Application that uses it, in the license terms.",
 "Which version of the GNU General Public License does this license supplement, and how is it numbered?",
 "What are the obligations when conveying modified versions of the library to other people here?",
 "What does section 4 require about the Combined Work and the notice of the Library used in it?",
 "Can I distribute a library that uses the Library with header files only, and under what terms?",
 "Who publishes revised versions of the GNU Lesser General Public License, and what does that mean?",
 "What happens if the library is a Corresponding Application Code of a combined work distribution?",
 "Summarize the additional definitions in section 0 of this license and what each of them means here.",
 "What is the Minimal Corresponding Source and when must you give it together with the combined work?",
 "Does the license allow proxies to decide which future versions apply, and how is that acceptance?"]
QUESTIONS = [QUESTIONS[i % 12] + " " + QUESTIONS[(i + 5) % 12] + " " + QUESTIONS[(i + 7) % 12] for i in range(14)]


def fresh_logprobs(tokens):
    """Log-probabilities after each of `tokens` from a fresh chunked mlx-lm prefill (KVCache), (len, vocab)."""
    cache, outs = make_prompt_cache(model), []
    for a in range(0, len(tokens), 512):
        o = model(mx.array(tokens[a:a + 512])[None], cache=cache)[0]
        mx.eval(o)
        outs.append(o)
    logits = mx.concatenate(outs, axis=0)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


n_prompt = int(sys.argv[2]) if len(sys.argv) > 2 else 45
print("mlx", importlib.metadata.version("mlx"), "mlx-lm", importlib.metadata.version("mlx-lm"), flush=True)
cache, stream, turns = cart.prompt_cache(), [], []
for question in QUESTIONS[:12]:
    prompt = tok.encode(question, add_special_tokens=False)[:n_prompt]
    start = cache[0].offset
    # range first: zip(generate_step(...), range(12)) would pull a 13th step, which the cache also feeds
    steps = [(int(y), lp) for _, (y, lp) in zip(range(12), generate_step(mx.array(prompt), model, prompt_cache=cache))]
    mx.eval([lp for _, lp in steps])
    stream += prompt + [y for y, _ in steps]
    assert len(doc) + len(stream) == cache[0].offset
    turns.append((start, len(prompt), steps))
want = fresh_logprobs(doc + stream)
for turn, (start, n, steps) in enumerate(turns):
    first = start + n - 1  # the position whose logits give the first generated token
    diff = max(float(mx.abs(lp - want[first + i]).max()) for i, (_, lp) in enumerate(steps))
    same = all(y == int(mx.argmax(want[first + i])) for i, (y, _) in enumerate(steps))
    print(f"turn {turn}: tail {start - len(doc)} -> {start - len(doc) + n + len(steps)}  max |logprob diff| "
          f"{diff:.4f}  {'identical' if same else 'DIFFERENT'}", flush=True)
