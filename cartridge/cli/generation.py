"""mlx-lm's generation flags for `ask` and `chat` (`mlx_lm.generate` / `mlx_lm.chat`: their names, short forms
and defaults), the sampler they make, and the note about a model without a chat template."""

import functools

import click
import mlx.core as mx

from cartridge.models.prompt import PLAIN

_GENERATION_OPTIONS = (
    click.option("--system-prompt", default=None, metavar="TEXT",
                 help="A system message for the chat template; it must match the system message the cartridge was "
                      "built with (build --system-prompt), which is used without it."),
    click.option("--temp", default=0.0, show_default=True, type=click.FloatRange(0),
                 help="Sampling temperature (0: greedy)."),
    click.option("--top-p", default=1.0, show_default=True, type=click.FloatRange(0, 1), help="Sampling top-p."),
    click.option("--top-k", default=0, show_default=True, type=click.IntRange(0), help="Sampling top-k (0: off)."),
    click.option("--min-p", default=0.0, show_default=True, type=click.FloatRange(0, 1), help="Sampling min-p."),
    click.option("--seed", default=None, type=int, help="PRNG seed (mlx.core.random.seed)."),
)


def generation_options(f):
    """Add --system-prompt, --temp, --top-p, --top-k, --min-p and --seed to a command, as `mlx_lm.generate`
    names them; the command receives them as one `generation` dict."""
    @functools.wraps(f)
    def command(*args, system_prompt, temp, top_p, top_k, min_p, seed, **kwargs):
        generation = {"system_prompt": system_prompt, "temp": temp, "top_p": top_p, "top_k": top_k, "min_p": min_p,
                      "seed": seed}
        return f(*args, generation=generation, **kwargs)

    for option in reversed(_GENERATION_OPTIONS):
        command = option(command)
    return command


def make_sampler(generation):
    """The mlx-lm sampler of the generation flags (`mlx_lm.sample_utils.make_sampler`: greedy at temp 0), after
    seeding MLX's generator where --seed was given, as `mlx_lm.generate` does."""
    from mlx_lm.sample_utils import make_sampler as mlx_lm_sampler  # (seconds to import: not at CLI start)

    if generation["seed"] is not None:
        mx.random.seed(generation["seed"])
    return mlx_lm_sampler(temp=generation["temp"], top_p=generation["top_p"], min_p=generation["min_p"],
                          top_k=generation["top_k"])


def plain_prompt_note(info):
    """The one line `ask` and `chat` print (stderr) for a cartridge of a model without a chat template, else None."""
    if info.prompt_mode != PLAIN:
        return None
    return ("note: the model has no chat template: the prompt is plain text (Question: ... Answer:) and an "
            "answer ends at a new \"Question:\" line")
