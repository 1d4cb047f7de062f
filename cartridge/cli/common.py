"""Helpers shared by the CLI commands: reading a corpus, checking an output file before any work, the tier
options of build and convert, a progress bar."""

import contextlib
import os
import sys
import warnings
from pathlib import Path

import click
import mlx.core as mx
from tqdm import tqdm

from cartridge.errors import InputError, OutputExistsError, WriteError
from cartridge.format.writer import check_output_folder
from cartridge.models.prompt import check_text


def read_corpus(corpus, what="corpus"):
    """Read CORPUS (a path or "-" for stdin) as strict UTF-8 text, the way Python's open() would give it
    to `cartridge.build`: a leading byte-order mark dropped, CRLF and CR line ends read as LF."""
    if corpus == "-":
        raw = sys.stdin.buffer.read()
        name = "stdin"
    else:
        path = Path(corpus)
        if not path.is_file():
            raise InputError(f"{what} {corpus} does not exist or is not a file")
        raw, name = path.read_bytes(), corpus
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{what} {name} is not UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start}") from None
    text = text.removeprefix("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    check_text(text, f"{what} {name}")
    return text


def check_output_file(path, option, force):
    """Refuse, before hours of work, an output file (of `option`, e.g. "--json") that cannot be written:
    its folder does not exist, it is a directory, or it exists and `force` is False.

    Returns:
        Path | None: `path` as a Path (None if not given).
    """
    if path is None:
        return None
    if not str(path).strip():
        raise InputError(f"{option} is empty; give a file name")
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{option} {path} is a directory; give a file name")
    if not path.parent.is_dir():
        problem = f"{path.parent} is not a folder" if path.parent.exists() else f"folder {path.parent} does not exist"
        raise InputError(f"{option} {path}: {problem}")
    if (path.exists() or path.is_symlink()) and not (path.is_file() and not path.is_symlink()):
        raise OutputExistsError(f"{option} {path} exists and is not a regular file; refusing to replace it")
    if path.exists() and not force:
        raise OutputExistsError(f"{option} {path} exists; pass --force to replace it")
    try:
        check_output_folder(path)  # the folder can be written (probed), before any work
    except WriteError as e:
        raise WriteError(f"{option} {path}: {e}") from None
    return path


MODEL_FORMS = '"default" (SmolLM2-135M), "gemma3-270m", a GGUF file, an mlx-lm model folder or a Hugging Face repo id (ORG/NAME)'


def model_ref(model):
    """--model as given, refusing an empty string (which would otherwise mean the current folder)."""
    if model is not None and not model.strip():
        raise InputError(f"--model is empty; give {MODEL_FORMS}")
    return model


@contextlib.contextmanager
def warnings_as_lines():
    """Show the library's warnings as one "warning: ..." line on stderr each, when they happen."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        # transformers' notes about a model's config (e.g. `rope_scaling` renamed) are for its developers
        warnings.filterwarnings("ignore", module=r"transformers(\.|$)")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.filterwarnings("ignore", category=category)  # Python hides these by default: for developers
        warnings.showwarning = lambda message, *_a, **_k: click.echo(f"warning: {message}", err=True)
        yield


PARALLEL_HELP = ("Under mlx.launch: shard the model over the ranks, tensor (KV heads) or pipeline (layers); "
                 "see docs/distributed.md.")


def launched_group(parallel):
    """The mlx.launch group for --parallel (None without it); ranks other than 0 print nothing on stdout."""
    if parallel is None:
        return None
    group = mx.distributed.init()
    if group.rank() != 0:
        sys.stdout = open(os.devnull, "w")  # one answer, from rank 0; errors still reach stderr
    return group


def refuse_beside(what, names):
    """Refuse, in one line naming the flags, the options of `names` (click parameter names) given on the command
    line beside an option that sets them all; `what` says which and why, e.g. "--preset safe sets the tiers"."""
    ctx = click.get_current_context()
    given = [f"--{n.replace('_', '-')}" for n in names
             if ctx.get_parameter_source(n) == click.core.ParameterSource.COMMANDLINE]
    if given:
        raise InputError(f"{what}; it cannot be combined with {', '.join(given)}")


PRESETS = ("exact", "safe", "balanced", "compact")  # cartridge.tiers.presets.PRESETS, listed for --help
_TIER_OPTIONS = (
    click.option("--tier", default="fp16", show_default=True, help="Storage tier of every layer's K and V."),
    click.option("--k-tier", default=None, help="Tier of K (overrides --tier for keys)."),
    click.option("--v-tier", default=None, help="Tier of V (overrides --tier for values)."),
    click.option("--boundary-protect", default=0, show_default=True, metavar="N", type=click.IntRange(0),
                 help="Keep K fp16 on every layer and V fp16 on the first N and last N layers."),
    click.option("--schema", "schema", default=None, metavar="FILE.json",
                 help='Per-layer tiers: a JSON list of {"layer": i, "k": tier, "v": tier}; excludes the tier '
                      'options.'),
    click.option("--protect-first", default=0, show_default=True, metavar="N", type=click.IntRange(0, 1 << 16),
                 help="Also keep the first N prefix tokens of every layer (K and V) in fp16."),
    click.option("--protect-last", default=0, show_default=True, metavar="M", type=click.IntRange(0, 1 << 16),
                 help="Also keep the last M prefix tokens of every layer (K and V) in fp16."),
    click.option("--preset", default=None, type=click.Choice(PRESETS),
                 help="A named outcome (docs/tiers.md): sets the tiers and protection; excludes those options."),
)


def tier_options(command):
    """Click decorator: the tier and protection options of build and convert (--tier, --k-tier, --v-tier,
    --boundary-protect, --schema, --protect-first, --protect-last, --preset), passed as keywords of those names."""
    for option in reversed(_TIER_OPTIONS):
        command = option(command)
    return command


_TARGET_OPTIONS = (
    click.option("--target-ratio", default=None, metavar="3x", help="Measured schema at most 1/R of fp16's bytes/token."),
    click.option("--max-bytes-per-token", default=None, type=click.IntRange(1), metavar="N",
                 help="Measured schema of at most N K+V bytes per token."),
    click.option("--max-kl", default=None, type=click.FloatRange(0), metavar="NATS",
                 help="Smallest measured schema whose predicted KL vs fp16 is at most NATS per token."),
    click.option("--no-calibrate", is_flag=True, help="No measurement: presets are today's fixed recipes (no extra time)."),
)


def target_options(command):
    """Click decorator: build's measured-schema options (--target-ratio, --max-bytes-per-token, --max-kl,
    --no-calibrate), passed as keywords of those names; `read_target` reads them."""
    for option in reversed(_TARGET_OPTIONS):
        command = option(command)
    return command


def read_target(preset, target_ratio, max_bytes_per_token, max_kl, no_calibrate):
    """The CalibrationTarget of the budget options (None when none is given; a budget preset is resolved by build)."""
    from cartridge.calibrate import CalibrationTarget, parse_ratio  # (loads mlx-lm: not at CLI start)

    given = {"--target-ratio": target_ratio, "--max-bytes-per-token": max_bytes_per_token, "--max-kl": max_kl}
    named = [k for k, v in given.items() if v is not None]
    if len(named) > 1 or (named and preset):
        raise InputError(f"give one budget: {', '.join(named + (['--preset'] if preset else []))} were given")
    if not named:
        return None
    if no_calibrate:
        raise InputError(f"{named[0]} needs calibration; drop --no-calibrate")
    ratio = parse_ratio(target_ratio) if target_ratio is not None else None
    return CalibrationTarget(target_ratio=ratio, max_bytes_per_token=max_bytes_per_token, max_kl=max_kl).check()


def refuse_tier_clashes(preset, schema):
    """Refuse, naming the flags, tier options given beside the --preset or --schema that sets them (an option
    given on the command line clashes even at its default value, e.g. --tier fp16)."""
    if preset:
        refuse_beside(f"--preset {preset} sets the tiers and protection",
                      ("tier", "k_tier", "v_tier", "boundary_protect", "schema", "protect_first", "protect_last"))
    if schema:
        refuse_beside("--schema sets the tier of every (layer, side)", ("tier", "k_tier", "v_tier", "boundary_protect"))


@contextlib.contextmanager
def progress_bar(unit, desc, intro=None, **options):
    """A tqdm bar on stderr, made at the first progress call (so an error before the work prints nothing else)
    and closed when done reaches total (its clock stops with the work, not with the command).

    Args:
        unit (str): what is counted ("tok", "layer", "B"). desc (str): the bar's label.
        intro (str | None): a line printed on stderr just before the bar (what the wait is for).
        **options: more tqdm keywords (e.g. unit_scale=True for bytes).

    Yields:
        callable: progress(done, total), the callback the library's long operations take.
    """
    bars = []

    def progress(done, total):
        if not bars:
            if intro:
                click.echo(intro, err=True)
            bars.append(tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, dynamic_ncols=True, **options))
        if not bars[0].disable:  # a closed bar is disabled: calls after the end change nothing
            bars[0].update(done - bars[0].n)
            if done >= total:
                bars[0].close()

    try:
        yield progress
    finally:
        for bar in bars:
            bar.close()
