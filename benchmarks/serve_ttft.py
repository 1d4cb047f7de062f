"""Time to first streamed token through `cartridge serve` against `cartridge ask`'s in-process TTFT and a
cold prefill of the document in the prompt; then 8 concurrent clients x 20 requests against the
sequential answers.

    python benchmarks/serve_ttft.py [--copies 4] [--questions 5] [--json out/serve_ttft.json]

The document is samples/lgpl-3.0.txt repeated --copies times. The cold-prefill comparison is mlx-lm's
`stream_generate` in this process with document + question as the prompt and no cache (what
mlx_lm.server does for a new document); mlx_lm.server itself cannot load the default model (a GGUF).
"""

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm
import openai

import cartridge  # loads OpenBLAS before mlx
from cartridge.models.prompt import full_prompt_tokens

ROOT = Path(__file__).resolve().parent.parent


def first_token_s(model, tokenizer, prompt, **kw):
    """Seconds from the call to the first generated token (as `cartridge ask` measures it)."""
    t0 = time.perf_counter()
    for _ in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=1, **kw):
        return time.perf_counter() - t0


def in_process(cart, question):
    """`cartridge ask`'s TTFT: the question's tokens fed after the loaded cartridge, to the first token."""
    return first_token_s(cart.model, cart.tokenizer, cart.question_prompt(question), prompt_cache=cart.prompt_cache())


def served_first_token_s(client, name, question):
    """Seconds from sending a streamed chat request to the chunk carrying its first token."""
    t0 = time.perf_counter()
    stream = client.chat.completions.create(model=name, messages=[{"role": "user", "content": question}],
                                            max_tokens=1, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True})
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].model_extra.get("token_ids"):
            first = time.perf_counter() - t0
    return first


def start_server(cart, port):
    proc = subprocess.Popen([sys.executable, "-m", "cartridge.cli.main", "serve", str(cart), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    for _ in range(600):
        try:
            client.models.list()
            return proc, client
        except openai.APIConnectionError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def log(*parts):
    print(time.strftime("%H:%M:%S"), *parts, file=sys.stderr, flush=True)


def ask(client, name, question, max_tokens, stream):
    """The answer's text, streamed or not."""
    r = client.chat.completions.create(model=name, messages=[{"role": "user", "content": question}],
                                       max_tokens=max_tokens, temperature=0, stream=stream)
    return "".join(ch.choices[0].delta.content or "" for ch in r if ch.choices) if stream \
        else r.choices[0].message.content


def concurrent(client_url, name, questions, expected, clients=8, requests=20, max_tokens=4):
    """clients threads x requests each; returns (errors, answers differing from `expected`, seconds)."""
    errors, differ = [], []

    def worker(i):
        c = openai.OpenAI(base_url=client_url, api_key="none", max_retries=0, timeout=600)
        for j in range(requests):
            q = questions[(i + j) % len(questions)]
            try:
                if ask(c, name, q, max_tokens, stream=bool(j % 2)) != expected[q]:
                    differ.append(q)
            except Exception as e:
                errors.append(repr(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors, differ, time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=2, help="copies of the sample document")
    ap.add_argument("--questions", type=int, default=5)
    ap.add_argument("--cold", type=int, default=1, help="questions timed with a cold prefill")
    ap.add_argument("--max-tokens", type=int, default=4, help="answer length in the concurrency run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    doc = "\n\n".join([(ROOT / "samples" / "lgpl-3.0.txt").read_text()] * args.copies)
    rows = [json.loads(x) for x in (ROOT / "samples" / "lgpl-3.0.questions.jsonl").read_text().splitlines()]
    questions = [r["question"] for r in rows[: args.questions]]
    lm = cartridge.load_model()
    with tempfile.TemporaryDirectory() as tmp:
        log("building")
        built = cartridge.build(doc, Path(tmp) / "doc.cart", model=lm)
        log(f"built {built.tokens} tokens in {built.seconds:.0f} s")
        cart = cartridge.load(built.path, model=lm)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc, client = start_server(built.path, port)
        try:
            served_first_token_s(client, "doc", questions[0])  # loads the cartridge (first use)
            in_process(cart, questions[0])  # warm-up
            res = []
            log("timing first tokens")
            for q in questions:  # alternate, so that load from other users of the machine hits both alike
                local = in_process(cart, q)
                served = served_first_token_s(client, "doc", q)
                res.append({"question": q, "ask_in_process_ttft_s": local, "served_ttft_s": served})
            log("cold prefills")
            cold = [first_token_s(lm.model, lm.tokenizer, full_prompt_tokens(lm.tokenizer, doc, q))
                    for q in questions[: args.cold]]
            log("sequential answers")
            expected = {q: ask(client, "doc", q, args.max_tokens, stream=False) for q in questions}
            local = {q: mlx_lm.generate(cart.model, cart.tokenizer, cart.question_prompt(q),
                                        max_tokens=args.max_tokens, prompt_cache=cart.prompt_cache())
                     for q in questions}
            log("8 concurrent clients")
            errors, differ, conc_s = concurrent(f"http://127.0.0.1:{port}/v1", "doc", questions, expected,
                                                max_tokens=args.max_tokens)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    med_local = statistics.median(r["ask_in_process_ttft_s"] for r in res)
    med_served = statistics.median(r["served_ttft_s"] for r in res)
    med_cold = statistics.median(cold)
    out = {
        "machine": f"{platform.machine()} {platform.platform()}, {os.cpu_count()} cores shared with other users",
        "device": str(mx.default_device()), "model": "default (SmolLM2-135M-Instruct)", "tokens": built.tokens,
        "tier": "fp16", "median_ask_in_process_ttft_s": med_local, "median_served_ttft_s": med_served,
        "served_over_in_process": med_served / med_local, "median_cold_prefill_ttft_s": med_cold,
        "cold_prefill_over_served": med_cold / med_served, "questions": res, "cold_prefill_ttft_s": cold,
        "sequential_equal_in_process": sum(expected[q] == local[q] for q in questions),
        "concurrent": {"clients": 8, "requests_each": 20, "max_tokens": args.max_tokens, "errors": len(errors),
                       "differing_from_sequential": len(differ), "seconds": conc_s, "error_samples": errors[:3]},
    }
    print(f"{built.tokens} cached tokens; TTFT median: in-process {med_local * 1000:.1f} ms, served (streamed) "
          f"{med_served * 1000:.1f} ms ({out['served_over_in_process']:.2f}x), cold prefill {med_cold:.2f} s "
          f"({out['cold_prefill_over_served']:.0f}x the served TTFT)")
    print(f"8 clients x 20 requests: {len(errors)} errors, {len(differ)} answers differing from sequential, "
          f"{conc_s:.1f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
