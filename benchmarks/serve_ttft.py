"""Time to first streamed token through `cartridge serve` against `cartridge ask`'s in-process TTFT and a
cold prefill of the document in the prompt; then 8 concurrent clients x 20 requests against the
sequential answers. With --vs-mlx-lm: `cartridge serve` as a persistent prompt cache against
mlx_lm.server, both running side by side on 127.0.0.1.

    python benchmarks/serve_ttft.py [--copies 1] [--cart DOC.cart] [--questions 5] [--json out/serve_ttft.json]
    python benchmarks/serve_ttft.py --vs-mlx-lm [--doc-tokens 1500] [--questions 4] [--json OUT.json]

The document is samples/lgpl-3.0.txt repeated --copies times (--vs-mlx-lm: its first paragraphs, up to
--doc-tokens). The cold-prefill comparison is mlx-lm's `stream_generate` in this process with document +
question as the prompt and no cache (what mlx_lm.server does for a new document). For --vs-mlx-lm the
default model (a GGUF file, which mlx_lm.server cannot read) is written as an mlx-lm folder of float32
weights, the weights both servers then compute with on CPU.
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
import urllib.request
from pathlib import Path

import cartridge  # noqa: I001  (first: it loads OpenBLAS before mlx, or matmul runs on the reference BLAS)
import mlx.core as mx
import mlx_lm
import openai
from mlx.utils import tree_flatten

from cartridge.models.loader import architecture_config
from cartridge.models.prompt import full_prompt_tokens, prefix_tokens
from cartridge.serve.pool import find_cartridges

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


def start_server(cart, port, model):
    proc = subprocess.Popen([sys.executable, "-m", "cartridge.cli.main", "serve", str(cart), "--port", str(port),
                             "--model", model], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
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


def save(out, path):
    """Write what is measured so far (a run cut short on a busy machine still leaves its numbers)."""
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=2))


def time_first_tokens(cart, client, name, questions, repeats):
    """Per question and repeat, `cartridge ask`'s TTFT in this process, then the served one (alternated,
    so that load from other users of the machine hits both alike)."""
    served_first_token_s(client, name, questions[0])  # loads the cartridge (first use)
    in_process(cart, questions[0])  # warm-up
    rows = []
    for _ in range(repeats):
        for q in questions:
            rows.append({"question": q, "ask_in_process_ttft_s": in_process(cart, q),
                         "served_ttft_s": served_first_token_s(client, name, q)})
    return rows


def run(args, lm, doc, questions, path, out):
    cart = cartridge.load(path, model=lm)
    name = next(iter(find_cartridges([path])))  # its model id
    out["tokens"] = len(cart.tokens)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, client = start_server(path, port, args.model)
    try:
        if not args.skip_ttft:
            ttft(args, cart, client, name, questions, out)
        if not args.skip_concurrent:
            log("8 concurrent clients")
            concurrency(args, cart, client, name, port, questions, out)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if args.cold:
        cold_prefill(args, lm, doc, questions, out)


def ttft(args, cart, client, name, questions, out):
    """Served and in-process first-token times (see time_first_tokens)."""
    log("timing first tokens")
    rows = time_first_tokens(cart, client, name, questions, args.repeats)
    keys = ("ask_in_process_ttft_s", "served_ttft_s")
    local, served = (statistics.median(r[k] for r in rows) for k in keys)
    low_local, low_served = (min(r[k] for r in rows) for k in keys)
    out.update(median_ask_in_process_ttft_s=local, median_served_ttft_s=served,
               served_over_in_process=served / local, min_ask_in_process_ttft_s=low_local,
               min_served_ttft_s=low_served, min_served_over_min_in_process=low_served / low_local,
               questions=rows)
    save(out, args.json)
    log(f"TTFT median: in-process {local * 1000:.1f} ms, served (streamed) {served * 1000:.1f} ms "
        f"({served / local:.2f}x); min {low_local * 1000:.1f} ms and {low_served * 1000:.1f} ms "
        f"({low_served / low_local:.2f}x)")


def cold_prefill(args, lm, doc, questions, out):
    """mlx-lm with the document in the prompt and no cache: what a server without the cartridge pays."""
    log("cold prefill")
    cold = [first_token_s(lm.model, lm.tokenizer, full_prompt_tokens(lm.tokenizer, doc, q))
            for q in questions[: args.cold]]
    out.update(cold_prefill_ttft_s=cold, median_cold_prefill_ttft_s=statistics.median(cold))
    if "median_served_ttft_s" in out:
        out["cold_prefill_over_served"] = out["median_cold_prefill_ttft_s"] / out["median_served_ttft_s"]
    save(out, args.json)
    log(f"cold prefill of the document in the prompt: {out['median_cold_prefill_ttft_s']:.2f} s "
        f"({out.get('cold_prefill_over_served', float('nan')):.0f}x the served TTFT)")


def concurrency(args, cart, client, name, port, questions, out):
    """Sequential answers from the server, then 8 clients x 20 requests compared with them."""
    expected = {q: ask(client, name, q, args.max_tokens, stream=False) for q in questions}
    same = sum(expected[q] == mlx_lm.generate(cart.model, cart.tokenizer, cart.question_prompt(q),
                                              max_tokens=args.max_tokens, prompt_cache=cart.prompt_cache())
               for q in questions)
    errors, differ, secs = concurrent(f"http://127.0.0.1:{port}/v1", name, questions, expected,
                                      max_tokens=args.max_tokens)
    out.update(sequential_equal_in_process=same, concurrent={
        "clients": 8, "requests_each": 20, "max_tokens": args.max_tokens, "errors": len(errors),
        "differing_from_sequential": len(differ), "seconds": secs, "error_samples": errors[:3]})
    save(out, args.json)
    log(f"8 clients x 20 requests: {len(errors)} errors, {len(differ)} answers differing from sequential, "
        f"{secs:.1f} s; sequential = in-process for {same}/{len(questions)}")


def mlx_lm_folder(lm, folder):
    """`lm` written as an mlx-lm model folder (config.json, float32 safetensors, tokenizer files)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(architecture_config(lm.model)))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    lm.tokenizer._tokenizer.save_pretrained(str(folder))  # the Hugging Face tokenizer the wrapper holds
    return folder


def first_paragraphs(tokenizer, text, limit):
    """The longest run of the text's first paragraphs whose cartridge prefix is at most `limit` tokens."""
    paragraphs, doc = text.split("\n\n"), ""
    for i in range(1, len(paragraphs) + 1):
        longer = "\n\n".join(paragraphs[:i])
        if len(prefix_tokens(tokenizer, longer)) > limit:
            break
        doc = longer
    return doc


def first_text_s(client, model, content, max_tokens=4):
    """(seconds to the first chunk carrying answer text, usage, the answer's text) of a streamed greedy chat
    request."""
    t0, first, usage, text = time.perf_counter(), None, None, ""
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                                max_tokens=max_tokens, temperature=0, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        usage = chunk.usage or usage
    return first, usage, text


def openblas_preload():
    """The environment of a process that does not import cartridge (mlx_lm.server) with the OpenBLAS this one
    loaded ahead of MLX in LD_PRELOAD: without it MLX's Linux wheel multiplies with the reference BLAS, about
    13x slower here, and the comparison would be of BLAS libraries."""
    maps = Path("/proc/self/maps")
    libs = sorted({line.split()[-1] for line in maps.read_text().splitlines() if "openblas" in line}) \
        if maps.exists() else []
    return {**os.environ, "LD_PRELOAD": libs[0]} if libs else dict(os.environ)


def start_process(cmd, port, log_file, env=None):
    """A server process and its client, once its /health answers (at most 10 minutes); its output appended to
    `log_file`."""
    with open(log_file, "a") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out, env=env)
    for _ in range(1200):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                               max_retries=0, timeout=1200)
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"{' '.join(cmd[2:4])} did not start; see {log_file}")


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vs_mlx_lm(args, lm, out, tmp):
    """mlx_lm.server's cold first request for a document against `cartridge serve` answering it from the shelf."""
    doc = first_paragraphs(lm.tokenizer, (ROOT / "samples" / "lgpl-3.0.txt").read_text(), args.doc_tokens)
    rows = [json.loads(x) for x in (ROOT / "samples" / "lgpl-3.0.questions.jsonl").read_text().splitlines()]
    questions = [r["question"] for r in rows[: args.questions + 1]]
    out["document"] = f"samples/lgpl-3.0.txt, its first paragraphs up to {args.doc_tokens} tokens"
    out["document_tokens"] = len(prefix_tokens(lm.tokenizer, doc))
    log_file, shelf = tmp / "servers.log", tmp / "shelf"
    mlx_port, cart_port = _port(), _port()
    mlx_proc, mlx = start_process([sys.executable, "-m", "mlx_lm", "server", "--model",
                                   str(mlx_lm_folder(lm, tmp / "mlx")), "--port", str(mlx_port)], mlx_port, log_file,
                                  openblas_preload())
    out["mlx_lm_server_ld_preload"] = openblas_preload().get("LD_PRELOAD")
    serve = [sys.executable, "-m", "cartridge.cli.main", "serve", str(shelf), "--model", args.model, "--port",
             str(cart_port), "--save-prefixes-over", "256", "--shelf-bytes", "1G"]
    try:
        first_text_s(mlx, "default_model", "Hello")  # mlx_lm.server loads its model on the first request
        log("mlx_lm.server: cold request")
        def ask(q):  # the document pasted before the question, as a chat UI sends it
            return doc + "\n\n" + q

        out["mlx_lm_cold_ttft_s"], _, mlx_answer = first_text_s(mlx, "default_model", ask(questions[0]))
        out["mlx_lm_in_memory_ttft_s"], _, _ = first_text_s(mlx, "default_model", ask(questions[1]))
        log("cartridge serve: cold request, then a restart")
        proc, ours = start_process(serve, cart_port, log_file)
        out["cartridge_cold_ttft_s"], _, cold_answer = first_text_s(ours, "default_model", ask(questions[0]))
        saved = wait_saved(ours)
        proc.terminate()
        proc.wait(timeout=120)
        proc, ours = start_process(serve, cart_port, log_file)
        out["cartridge_first_after_restart_ttft_s"], usage, answer = first_text_s(ours, "default_model",
                                                                                 ask(questions[0]))
        out["cached_tokens"] = usage.prompt_tokens_details.cached_tokens
        out["first_answers"] = {"mlx_lm_cold": mlx_answer, "cartridge_cold": cold_answer,
                                "cartridge_after_restart": answer}
        rows = []
        for _ in range(args.repeats):
            for q in questions[1:]:
                rows.append({"question": q, "shelf_match_ttft_s": first_text_s(ours, "default_model", ask(q))[0],
                             "named_cartridge_ttft_s": first_text_s(ours, saved, q)[0]})
        proc.terminate()
        proc.wait(timeout=120)
    finally:
        mlx_proc.terminate()
        mlx_proc.wait(timeout=120)
    match, named = (statistics.median(r[k] for r in rows) for k in ("shelf_match_ttft_s", "named_cartridge_ttft_s"))
    out.update(rows=rows, median_shelf_match_ttft_s=match, median_named_cartridge_ttft_s=named,
               shelf_match_over_named=match / named, mlx_lm_cold_over_shelf_match=out["mlx_lm_cold_ttft_s"] / match)
    save(out, args.json)
    log(f"{out['document_tokens']:,}-token document: mlx_lm.server cold {out['mlx_lm_cold_ttft_s']:.2f} s (in memory "
         f"{out['mlx_lm_in_memory_ttft_s']:.2f} s); cartridge serve cold {out['cartridge_cold_ttft_s']:.2f} s, first "
         f"after restart {out['cartridge_first_after_restart_ttft_s']:.2f} s ({out['cached_tokens']:,} cached), shelf "
         f"match {match:.3f} s, named {named:.3f} s ({match / named:.2f}x); mlx_lm cold / shelf match "
         f"{out['mlx_lm_cold_over_shelf_match']:.0f}x")


def wait_saved(client, timeout=600):
    """The id of the prefix the server saved behind its first answer."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        saved = [m.id for m in client.models.list().data if m.model_extra.get("saved_prefix")]
        if saved:
            return saved[0]
        time.sleep(0.5)
    raise SystemExit("no prefix was saved")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=1, help="copies of the sample document")
    ap.add_argument("--cart", default=None, help="a cartridge already built from those copies (skips the build)")
    ap.add_argument("--questions", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="timings of each question, each way")
    ap.add_argument("--skip-concurrent", action="store_true", help="time first tokens and cold prefill only")
    ap.add_argument("--skip-ttft", action="store_true", help="skip the first-token timings")
    ap.add_argument("--model", default="default", help="the model (for --cart: the one it was built with)")
    ap.add_argument("--cold", type=int, default=1, help="questions timed with a cold prefill")
    ap.add_argument("--max-tokens", type=int, default=4, help="answer length in the concurrency run")
    ap.add_argument("--vs-mlx-lm", action="store_true", help="mlx_lm.server against cartridge serve's shelf")
    ap.add_argument("--doc-tokens", type=int, default=1500, help="--vs-mlx-lm: document tokens at most")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    doc = "\n\n".join([(ROOT / "samples" / "lgpl-3.0.txt").read_text()] * args.copies)
    rows = [json.loads(x) for x in (ROOT / "samples" / "lgpl-3.0.questions.jsonl").read_text().splitlines()]
    questions = [r["question"] for r in rows[: args.questions]]
    out = {"machine": f"{platform.machine()} {platform.platform()}, {os.cpu_count()} cores shared with other users",
           "device": str(mx.default_device()), "tier": "fp16",
           "document": str(args.cart) if args.cart else f"samples/lgpl-3.0.txt x {args.copies}"}
    lm = cartridge.load_model(args.model)
    out["model"] = args.model
    if args.vs_mlx_lm:
        with tempfile.TemporaryDirectory() as tmp:
            return vs_mlx_lm(args, lm, out, Path(tmp))
    with tempfile.TemporaryDirectory() as tmp:
        path = args.cart
        if path is None:
            log("building")
            path = cartridge.build(doc, Path(tmp) / "doc.cart", model=lm).path
        run(args, lm, doc, questions, path, out)


if __name__ == "__main__":
    main()
