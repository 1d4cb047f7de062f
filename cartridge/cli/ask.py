"""`cartridge ask`: one question, a question from stdin, or a file of questions after one load (`chat`,
the conversation, is in chat.py). Thin: parse, call the library, print."""

import json
import sys
import time
from pathlib import Path

import click
import mlx.core as mx

import cartridge
from cartridge.errors import InputError
from cartridge.eval.dataset import load_questions
from cartridge.format.header import require_attention_layers
from cartridge.format.reader import open_cartridge
from cartridge.format.writer import check_output_path
from cartridge.models.prompt import PLAIN, check_text, find_stop, stop_strings

from .common import (MODEL_FORMS, PARALLEL_HELP, check_output_file, launched_group, model_ref, read_corpus,
                     warnings_as_lines)
from .generation import generation_options, make_sampler, plain_prompt_note
from .serve import MAX_MEMORY_HELP, parse_bytes

MODEL_HELP = f"Model to answer with: {MODEL_FORMS} (default: the one the cartridge records)."
ATTENTION_HELP = "Attention path: auto, fused (CUDA), portable or dequantize-once."
DEFAULT_MAX_TOKENS = 256
MAX_TOKENS_HELP = (f"Most tokens to generate per answer (default: {DEFAULT_MAX_TOKENS}, or what the model's context "
                   "leaves after the document and the question, if less).")


def load_cartridge(path, model, attention, parallel=None, recompute=16, max_memory=None, recompute_ratio=None):
    """Load a cartridge (or compose several) for `ask` and `chat`, as the CLI options say.

    Args:
        path (str | list[str]): one cartridge, or several to compose. model (str | None): a model reference,
            None for the one the cartridge records. attention (str): the policy (`ATTENTION_HELP`).
        parallel (str | None): `--parallel`: load a sharded cartridge over the launched group.
        recompute (int): seam tokens recomputed when composing. max_memory (str | None): "--max-memory".
        recompute_ratio (float | None): "--recompute-ratio" when composing; None: `compose`'s default.

    Returns:
        tuple: (Cartridge, seconds the load took).

    Raises:
        InputError: a bad --max-memory, or --parallel with several cartridges; what `cartridge.load` raises.
    """
    max_memory = None if max_memory is None else parse_bytes(max_memory, "--max-memory")
    t0 = time.perf_counter()
    group = launched_group(parallel)
    if group is not None:
        from cartridge.distributed import load_sharded_model, recorded_model  # (loads mlx-lm: not at CLI start)

        if isinstance(path, list):
            raise InputError("--parallel takes one cartridge")
        ref = model_ref(model) if model is not None else recorded_model(path)
        lm = load_sharded_model(ref, group, parallel)
        cart = cartridge.load(path, model=lm, attention=attention, group=group)
    else:
        lm = cartridge.load_model(model_ref(model)) if model is not None else None
        with warnings_as_lines():  # a budget below the stored pages, a dequantize-once it changed
            ratio = {} if recompute_ratio is None else {"recompute_ratio": recompute_ratio}
            cart = cartridge.load(path, model=lm, attention=attention, recompute=recompute, max_memory=max_memory,
                                  **ratio)
    return cart, time.perf_counter() - t0


def memory_lines(cart):
    """The attention policy and why, and the prefix's bytes as held and planned, for each cartridge
    (named when several are composed); then the bytes MLX measured (active, peak)."""
    parts, mb = getattr(cart, "carts", None) or [cart], 1e6
    lines = []
    for part in parts:
        name = f"{Path(part.path).name}: " if len(parts) > 1 else ""
        lines += [name + line for line in _prefix_lines(part)]
    measured = (f"MLX active {mx.get_active_memory() / mb:,.1f} MB (model included), peak "
                f"{mx.get_peak_memory() / mb:,.1f} MB since the process started (model loading included)")
    if len(parts) == 1 and len(lines) == 2:
        lines[1] += f"; {measured}"
    else:
        lines.append(measured)
    return lines


def composed_line(cart, paths):
    """`composed 2 cartridges: 1,629 + 879 tokens, recomputed 171 of b's tokens (20%)` for a composition of
    `paths` (the counts of `ComposedCache.blended`: boundary and selected tokens prefilled again); None for one."""
    blended = getattr(cart, "blended", None)
    if not blended:
        return None
    sizes = [len(cart.carts[0].tokens)] + [b["fresh"] + b["read"] for b in blended]
    redone = [f"{b['fresh'] + b['selected']:,} of {Path(p).stem}'s tokens "
              f"({100 * (b['fresh'] + b['selected']) / max(1, n):.0f}%)" for b, p, n in zip(blended, paths[1:], sizes[1:])]
    return (f"composed {len(sizes)} cartridges: {' + '.join(f'{n:,}' for n in sizes)} tokens, "
            f"recomputed {', '.join(redone)}")


def _prefix_lines(cart):
    """attention POLICY (why); memory: prefix resident, stored, budget, planned peak (one cartridge)."""
    plan, mb = cart.plan, 1e6
    m = plan.get("memory") or {}
    budget = f"{m['budget_bytes'] / mb:,.1f} MB" if m.get("budget_bytes") else "none"
    lines = [f"attention {cart.attention} ({plan.get('reason', '-')})"]
    if m:
        lines.append(f"memory: prefix resident {m['resident_bytes'] / mb:,.1f} MB (stored {m['stored_bytes'] / mb:,.1f} "
                     f"MB, budget {budget}, planned peak while loading or decoding {m['planned_peak_bytes'] / mb:,.1f} "
                     f"MB)")
    return lines


def check_room(cart, cache, prompt, max_tokens, what):
    """The answer's token budget: refuse a prompt (`what`, e.g. "the question") + answer that cannot fit the
    model's context after what `cache` holds.

    Args:
        cart (Cartridge): the loaded cartridge. cache (list): the conversation's caches.
        prompt (list[int]): the tokens to feed. max_tokens (int | None): the answer's budget as the user gave it;
            None: DEFAULT_MAX_TOKENS, cut to what the context leaves. what (str): named in the error.

    Returns:
        int: the budget.

    Raises:
        InputError: the prompt does not fit, or prefix + cache tail + prompt + a given max_tokens exceed the
            model's context length.
    """
    from cartridge.write.options import context_length  # (loads mlx-lm: not at CLI start)

    from cartridge.attention.layers import cache_offset  # (loads mlx-lm: not at CLI start)

    limit, held = context_length(cart.model), cache_offset(cache) or len(cart.tokens)
    if limit is None:
        return max_tokens or DEFAULT_MAX_TOKENS
    room = limit - held - len(prompt)
    if room < 1:
        raise InputError(f"{what} ({len(prompt):,} tokens) does not fit the model's context of {limit:,} tokens "
                         f"after the {held:,} cached")
    if max_tokens is None:
        return min(DEFAULT_MAX_TOKENS, room)
    if max_tokens <= room:
        return max_tokens
    raise InputError(f"--max-tokens {max_tokens} does not fit the model's context of {limit:,} tokens: "
                     f"{held:,} cached + {len(prompt)} prompt tokens leave {room:,}")


def answer(cart, prompt, cache, max_tokens, what="the question", echo=True, stop=None, sampler=None):
    """Stream the model's answer to `prompt` (fed into `cache`); returns a dict of text and timings.

    `stop` (a callable) is asked as each token arrives, before it is shown; True ends the answer there
    ("stopped": True) without showing that token. The answer also ends before the prompt mode's stop
    string (`prompt.stop_strings`: a base model's new "Question:" line; "stop_string" names it), text that
    may begin one is held back until it is known not to. The cache then holds the prompt and every token
    of "token_ids" (mlx-lm feeds a token before yielding it; those not kept are trimmed back off).
    `sampler`: mlx-lm's (`generation.make_sampler`); None: greedy.
    """
    import mlx_lm  # (seconds to import: not at CLI start)


    max_tokens = check_room(cart, cache, prompt, max_tokens, what)
    stops = stop_strings(cart.info.prompt_mode)
    t0 = time.perf_counter()
    ttft, n, text, shown, ids, stopped, hit = None, 0, "", 0, [], False, None
    stream = mlx_lm.stream_generate(cart.model, cart.tokenizer, prompt, max_tokens=max_tokens, prompt_cache=cache,
                                    sampler=sampler)
    try:
        for r in stream:
            if stop is not None and stop():  # Ctrl-C came while this token was computed: nothing more is shown
                stopped = True
                _unfeed(cache, 1)
                break
            ttft = time.perf_counter() - t0 if ttft is None else ttft
            n = r.generation_tokens
            text += r.text
            ids.append(r.token)
            end, found = find_stop(text, stops)
            shown = _show(text, shown, min(end, len(text.rstrip())), echo)  # spaces before a stop string are not shown
            if found:
                hit, text = next(s for s in stops if text.find(s) == end), text[:end].rstrip()
                break
    except KeyboardInterrupt:  # `ask` ends (exit 130): its "error: interrupted" goes on a line of its own
        if echo and shown:
            click.echo()
        raise
    shown = _show(text, shown, len(text), echo)  # what was held back for a stop string that did not come
    if hit is not None:  # the cache and the ids keep the tokens of the answer only, not those of the stop string
        kept = _tokens_within(cart.tokenizer, ids, text)
        _unfeed(cache, len(ids) - kept)
        ids = ids[:kept]
    if echo and (shown or not stopped):
        click.echo()  # the timing line that follows on stderr starts a line of its own
        sys.stdout.flush()
    decode_s = time.perf_counter() - t0 - (ttft or 0)
    rate = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    return {"answer": text, "ttft_s": ttft or 0.0, "tokens": n, "decode_tokens_per_s": rate,
            "prompt_tokens": len(prompt), "max_tokens": max_tokens, "token_ids": ids, "stopped": stopped,
            "stop_string": hit}


def _tokens_within(tokenizer, ids, answer):
    """How many leading `ids` make up no more than `answer` (the text streamed before a stop string, which may
    lack the space the first token's text starts with: mlx-lm's streaming detokenizer trims it)."""
    kept = len(ids)
    while kept and len(tokenizer.decode(ids[:kept]).lstrip()) > len(answer.lstrip()):
        kept -= 1
    return kept


def _show(text, shown, end, echo):
    """Print text[shown:end] (stdout, flushed) where `echo`; returns the new count of characters shown."""
    if echo and end > shown:
        click.echo(text[shown:end], nl=False)
        sys.stdout.flush()
    return max(shown, end)


def _unfeed(cache, n):
    """Take the last `n` fed tokens back off `cache` where every layer can trim (a chat that cannot, a window or
    recurrent state, starts its next turn afresh anyway)."""
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache  # (seconds to import: not at CLI start)

    if n and can_trim_prompt_cache(cache):
        trim_prompt_cache(cache, n)


def _questions(question, questions_file):
    if questions_file is not None:
        if question is not None:
            raise InputError("give a QUESTION or --questions FILE, not both")
        path = Path(questions_file)
        if path.suffix == ".jsonl":
            return [q["question"] for q in load_questions(path)]
        rows = [line.strip() for line in read_corpus(str(path), "--questions").splitlines() if line.strip()]
        if not rows:
            raise InputError(f"--questions {path} holds no question")
        return rows
    if question is None:
        raise InputError("give a QUESTION (or - to read it from stdin) or --questions FILE")
    return [sys.stdin.read().strip() if question == "-" else question]


def _paths_and_question(args, questions_file, prompt=None):
    """PATH... [QUESTION]: with --questions or --prompt (or one argument) every argument is a cartridge, else
    the last is the question."""
    given = "--prompt" if prompt is not None else "--questions FILE"
    if prompt is not None and questions_file is not None:
        raise InputError("give --prompt or --questions FILE, not both")
    if (questions_file is not None or prompt is not None) and len(args) > 1 and not Path(args[-1]).exists():
        raise InputError(f"give a QUESTION or {given}, not both")
    if prompt is not None:
        return list(args), prompt
    if questions_file is not None or len(args) == 1:
        return list(args), None  # no question: _questions says what is missing
    last = args[-1]
    if not last.strip():
        raise InputError("the question is empty")
    if not any(c.isspace() for c in last) and (last.endswith((".cart", ".cartz")) or Path(last).is_dir()):
        raise InputError(f"no QUESTION: the last argument {last} names a cartridge; give the question after the "
                         "cartridges (or --questions FILE)")
    return list(args[:-1]), last


def check_system_prompt(path, system):
    """Refuse, from the cartridge's header before any model loads, a --system-prompt other than the system
    message it was built with (`build --system-prompt`): the template renders it before the document, whose
    prefill the cartridge holds; and any on a model without a chat template.

    Raises:
        InputError: as described. CartridgeError: the header cannot be read.
    """

    if system is None:
        return
    info, data = open_cartridge(path, "header")
    data.close()
    if info.prompt_mode == PLAIN:
        raise InputError(f"--system-prompt needs a chat template; the model of {path} has none")
    if system != info.system:
        built = "no system message" if info.system is None else f"the system message {info.system[:60]!r}"
        raise InputError(f"--system-prompt must be the system message {path} was built with (`cartridge build "
                         f"--system-prompt`): it holds the document prefilled after {built}; drop --system-prompt"
                         + ("" if info.system is None else " or give that one") + ", or build a cartridge with yours")


def _prompt(cart, question, system):
    """The tokens to feed after the prefix for `question`, under the --system-prompt `system` where given."""
    if system is None:
        return cart.question_prompt(question)
    return cart.chat_prompt([{"role": "system", "content": system}, {"role": "user", "content": question}])


class RecomputeRatioOption(click.Option):
    """--recompute-ratio, whose help shows compose's default; compose (it loads mlx-lm) is imported only for --help."""

    def get_help_record(self, ctx):
        from cartridge.compose.composed import DEFAULT_RECOMPUTE_RATIO  # (loads mlx-lm: not at CLI start)

        self.help = self.help.split("  [default:")[0] + f"  [default: {DEFAULT_RECOMPUTE_RATIO:g}]"
        return super().get_help_record(ctx)


@click.command()
@click.argument("args", nargs=-1, required=True, metavar="PATH... [QUESTION]")
@click.option("--questions", "questions_file", default=None,
              help="Answer every question of a .jsonl ({\"question\": ...} rows) or .txt (one a line) file.")
@click.option("--json", "json_path", default=None, help="With --questions: write one JSON row per answer here.")
@click.option("--force", is_flag=True, help="Replace an existing --json file or --save-as cartridge.")
@click.option("--prompt", "-p", "prompt", default=None, metavar="TEXT",
              help="The question, as mlx_lm.generate's --prompt (- reads it from stdin); every argument is then a "
                   "cartridge.")
@click.option("--max-tokens", "-m", type=int, default=None, help=MAX_TOKENS_HELP)
@generation_options
@click.option("--model", default=None, help=MODEL_HELP)
@click.option("--attention", default="auto", show_default=True, help=ATTENTION_HELP)
@click.option("--parallel", type=click.Choice(["tensor", "pipeline"]), default=None, help=PARALLEL_HELP)
@click.option("--save-as", default=None, metavar="FILE",
              help="Also write the cartridge + this question and answer as a new cartridge (resume: ask FILE ...).")
@click.option("--recompute", default=16, show_default=True, metavar="N",
              help="With several cartridges: tokens of each later document prefilled again over the ones before.")
@click.option("--recompute-ratio", cls=RecomputeRatioOption, default=None, type=float, metavar="R",
              help="With several cartridges: fraction of each later document's tokens recomputed, the boundary's "
              "and those whose K/V deviate most (CacheBlend).")
@click.option("--max-memory", default=None, help=MAX_MEMORY_HELP)
def ask(args, questions_file, json_path, force, prompt, max_tokens, generation, model, attention, parallel, save_as,
        recompute, recompute_ratio, max_memory):
    """Answer QUESTION about the document in the cartridge at PATH (streams to stdout); several PATHs
    are laid out one after another in one context.

    QUESTION "-" reads the question from stdin; --questions answers a file of questions, each from a
    fresh cache, after one load."""
    paths, question = _paths_and_question(args, questions_file, prompt)
    if save_as is not None:
        if len(paths) > 1 or questions_file is not None:
            raise InputError("--save-as takes one cartridge and one question")
        check_output_path(save_as, force)  # before any work
    if max_tokens is not None and max_tokens < 1:
        raise InputError(f"--max-tokens is {max_tokens}; it must be at least 1")
    if json_path is not None and questions_file is None:
        raise InputError("--json needs --questions FILE (a .jsonl or .txt file of questions): it writes one "
                         "JSON row per answer; to ask one QUESTION, drop --json (the answer prints on stdout)")
    if recompute_ratio is not None:
        from cartridge.compose.blend import check_ratio  # (loads mlx-lm: not at CLI start)

        check_ratio(recompute_ratio, "--recompute-ratio")
    if len(paths) == 1 and (recompute_ratio is not None or recompute != 16):
        raise InputError("--recompute and --recompute-ratio apply when composing several cartridges; one was given")
    json_path = check_output_file(json_path, "--json", force)
    qs = _questions(question, questions_file)
    for q in qs:  # refused before the model loads
        check_text(q, "the question")
    if len(paths) == 1:
        check_system_prompt(paths[0], generation["system_prompt"])
    cart, load_s = load_cartridge(paths[0] if len(paths) == 1 else paths, model, attention, parallel, recompute,
                                  max_memory, recompute_ratio)
    for line in (composed_line(cart, paths), plain_prompt_note(cart.info)):
        if line is not None:
            click.echo(line, err=True)
    if save_as is not None:  # a cartridge that cannot be saved is refused before the answer, not after it
        from cartridge.write.append import require_per_token_tiers  # (loads mlx-lm: not at CLI start)

        require_attention_layers(cart.info, "save")
        require_per_token_tiers(cart.info, "save")
    prompts = [_prompt(cart, q, generation["system_prompt"]) for q in qs]  # every question checked before any answer
    sampler, rows = make_sampler(generation), []
    for i, (q, prompt) in enumerate(zip(qs, prompts)):
        if len(qs) > 1:
            click.echo(f"Q{i + 1}: {q}")
        cache = cart.prompt_cache()
        r = answer(cart, prompt, cache, max_tokens, sampler=sampler)
        ids = r.pop("token_ids")
        del r["stopped"]  # ask has no Ctrl-C stop
        budget, hit = r.pop("max_tokens"), r.pop("stop_string")
        rows.append({"question": q, **r})
        ended = (f", stopped before a new {hit.strip()!r} line" if hit else
                 ", the model ended its answer" if r["tokens"] < budget else "")  # before --max-tokens
        click.echo(f"{'' if len(qs) == 1 else f'Q{i + 1}: '}TTFT {r['ttft_s']:.3f} s ({r['prompt_tokens']} question "
                   f"tokens over {len(cart.tokens)} cached), decode {r['decode_tokens_per_s']:.1f} tokens/s "
                   f"({r['tokens']} tokens{ended})", err=True)
    click.echo(f"load {load_s:.2f} s, {len(qs)} question{'s' * (len(qs) > 1)}, attention {cart.attention}", err=True)
    for line in memory_lines(cart):
        click.echo(line, err=True)
    if json_path is not None and getattr(getattr(cart, "part", None), "rank", 0) == 0:
        json_path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    if save_as is not None:
        saved = cart.save(save_as, cache, tokens=prompts[0] + ids, force=force)
        click.echo(f"saved {saved.path}: {saved.tokens} tokens ({saved.new_tokens} of this conversation)", err=True)
