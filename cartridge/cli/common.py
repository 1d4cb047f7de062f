"""Helpers shared by the CLI commands: reading a corpus, checking an output file before any work."""

import contextlib
import sys
import warnings
from pathlib import Path

import click

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


def model_ref(model):
    """--model as given, refusing an empty string (which would otherwise mean the current folder)."""
    if model is not None and not model.strip():
        raise InputError("--model is empty; give a GGUF file, an mlx-lm model folder or \"default\"")
    return model


@contextlib.contextmanager
def warnings_as_lines():
    """Show the library's warnings as one "warning: ..." line on stderr each, when they happen."""
    import click

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
    import os

    import mlx.core as mx

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
