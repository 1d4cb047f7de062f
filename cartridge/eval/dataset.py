"""What `cartridge eval` asks: question and needle files, needle planting, and the held-out split.

Questions (JSONL, one object a line): {"question": str, "id": any (default: line number),
"answer": str (optional reference answer; kept in the report, not scored)}. Questions about several
documents (`cartridge.eval.composed`) also say which document answers them: "source": the
document's letter ("a", "b", ...) or "both" (it takes more than one).

Needles (JSONL): {"id": any, "depth": float in [0, 1], "fact": str, "question": str,
"answer": str}. `plant_needles` inserts each fact as its own paragraph at the paragraph break
nearest to `depth` x the document's length in characters; `answer` is the exact string that must
appear in the generated answer (`cartridge.eval.metrics.needle_found`).
"""

import json
from pathlib import Path

from ..errors import InputError
from ..models.prompt import check_text

NEEDLE_FIELDS = ("depth", "fact", "question", "answer")


def _read_jsonl(path, what):
    """[(line_number, object)] of a JSONL file; blank lines are skipped.

    Raises:
        InputError: missing file, not UTF-8, a line that is not a JSON object, or no rows at all.
    """
    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} file {path} does not exist or is not a file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise InputError(f"{what} file {path} is not UTF-8: byte at offset {e.start}") from None
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{what} file {path} line {n}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise InputError(f"{what} file {path} line {n}: expected a JSON object, found {type(obj).__name__}")
        rows.append((n, obj))
    if not rows:
        raise InputError(f"{what} file {path} has no rows")
    return rows


def _text_field(obj, key, where):
    value = obj.get(key)
    if not isinstance(value, str) or not value.strip():
        raise InputError(f"{where}: field {key!r} must be a non-empty string, found {value!r}")
    check_text(value, f"{where}: field {key!r}")
    return value


def load_questions(path, sources=None):
    """Read a questions file.

    Args:
        path (str | Path): JSONL, see the module docstring.
        sources (Sequence[str] | None): if given, every row must have a "source" among these
            (e.g. ("a", "b", "both")), kept in the row. Default: None (no "source" read).

    Returns:
        list[dict]: {"id", "question", "answer" (str | None)} (+ "source") in file order.

    Raises:
        InputError: unreadable file, bad JSON, a row without a non-empty "question", or (with
            `sources`) a missing or unknown "source".
    """
    out = []
    for n, obj in _read_jsonl(path, "questions"):
        where = f"questions file {path} line {n}"
        row = {"id": obj.get("id", n), "question": _text_field(obj, "question", where), "answer": obj.get("answer")}
        if sources is not None:
            if obj.get("source") not in sources:
                raise InputError(f"{where}: field 'source' must be one of {', '.join(map(repr, sources))}, "
                                 f"found {obj.get('source')!r}")
            row["source"] = obj["source"]
        out.append(row)
    return out


def load_needles(path):
    """Read a needle set.

    Args:
        path (str | Path): JSONL, see the module docstring.

    Returns:
        list[dict]: {"id", "depth" (float), "fact", "question", "answer"} in file order.

    Raises:
        InputError: unreadable file, bad JSON, a missing field, or a depth outside [0, 1].
    """
    out = []
    for n, obj in _read_jsonl(path, "needles"):
        where = f"needles file {path} line {n}"
        row = {"id": obj.get("id", n)}
        for key in NEEDLE_FIELDS[1:]:
            row[key] = _text_field(obj, key, where)
        depth = obj.get("depth")
        if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not 0 <= depth <= 1:
            raise InputError(f"{where}: field 'depth' must be a number in [0, 1], found {depth!r}")
        row["depth"] = float(depth)
        out.append(row)
    return out


def paragraph_starts(text):
    """Character offsets where a paragraph may be inserted: after each blank line, else after each
    line break, else after each space; always 0 and len(text).

    Returns:
        list[int]: sorted, unique.
    """
    for sep in ("\n\n", "\n", " "):
        starts, at = [], text.find(sep)
        while at >= 0:
            end = at + len(sep)
            while text.startswith(sep[-1], end) and sep != " ":  # run of newlines: start after all of them
                end += 1
            starts.append(end)
            at = text.find(sep, end)
        if starts:
            return sorted({0, *starts, len(text)})
    return [0, len(text)]


def _nearest(starts, target):
    return min(starts, key=lambda s: (abs(s - target), s))


def plant_needles(document, needles):
    """Insert each needle's fact as a paragraph at the break nearest to its depth.

    Args:
        document (str): the text to plant into (not modified).
        needles (list[dict]): rows from `load_needles`.

    Returns:
        str: the document with every fact inserted; facts at the same break keep file order.

    Example:
        >>> plant_needles("A.\\n\\nB.\\n\\nC.", [{"depth": 0.5, "fact": "X is 7."}])
        'A.\\n\\nX is 7.\\n\\nB.\\n\\nC.'
    """
    starts = paragraph_starts(document)
    at = [_nearest(starts, round(n["depth"] * len(document))) for n in needles]
    pieces, prev = [], 0
    for pos, needle in sorted(zip(at, needles), key=lambda x: x[0]):
        pieces.append(document[prev:pos])
        before = document[:pos]
        sep_before = "" if pos == 0 or before.endswith("\n\n") else "\n" if before.endswith("\n") else "\n\n"
        pieces.append(sep_before + needle["fact"].strip() + "\n\n")
        prev = pos
    pieces.append(document[prev:])
    return "".join(pieces)


def split_heldout(document, fraction):
    """Cut off the document's tail as held-out text, at the paragraph break nearest to the cut.

    Args:
        document (str): the corpus. fraction (float): share of characters to hold out, in (0, 1).

    Returns:
        tuple[str, str]: (head, tail), both non-empty after stripping, head + tail == document.

    Raises:
        InputError: if the fraction is out of range or no break leaves both parts non-empty.
    """
    if not 0 < fraction < 1:
        raise InputError(f"held-out fraction {fraction} must be in (0, 1)")
    target = round((1 - fraction) * len(document))
    usable = [s for s in paragraph_starts(document) if document[:s].strip() and document[s:].strip()]
    if not usable:
        raise InputError("the corpus has no paragraph, line or word break to split held-out text at")
    cut = _nearest(usable, target)
    return document[:cut], document[cut:]
