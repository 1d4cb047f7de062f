"""Which cartridges `cartridge eval` builds: `--tiers` entries, `--schemas` files, and the build cache.

A `--tiers` entry is colon-separated fields, its label is the entry as written:

    TIER            every layer's K and V in TIER                    fp16, mlx4g32, turbo4
    TIER:bpN        ... with boundary_protect=N (K fp16 everywhere,  mlx4g32:bp2
                    V fp16 on the first and last N layers)
    k=TIER:v=TIER   K and V tiers apart (build's k_tier / v_tier)     k=fp16:v=fp8, k=fp16:v=fp8:bp2
    TIER:pfN:plM    ... with protect_first=N / protect_last=M         mlx4g32+rot:pf16:pl64
    preset=NAME     a preset (build's preset)                         preset=balanced
    kenc=NAME       ... with K's codes chosen by NAME (build's            preset=balanced:kenc=score
                    k_encoder: nearest, score)
    kscale, nokscale  ... with K scaled per channel or not (build's   preset=balanced:kenc=nearest:nokscale
                    k_scale; a preset's default otherwise)
    venc=NAME       ... with V's codes chosen by NAME (build's            preset=compact:venc=output
                    v_encoder: nearest, output)

A `--schemas` file is a JSON object mapping a label to either a schema (a list of
{"layer", "k", "v"}) or a dict of build keywords (tier, k_tier, v_tier, boundary_protect, schema;
a schema given as a string is a path relative to the schemas file).

Cartridges are cached in a work folder under a name that holds the digest of everything that decides
their bytes: document text, model fingerprint, build keywords, page size, cartridge version and the
codec versions of the tiers used.
"""

import hashlib
import inspect
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from ..write.build import build
from ..write.options import check_encoders, resolve_encoders
from ..errors import CartridgeError, InputError
from ..format.container import read_manifest
from ..calibrate import CALIBRATION_VERSION, PRESET_RATIOS
from ..tiers import TIERS, get_tier, presets
from ..tiers.schema import check_layer_count

BUILD_KEYWORDS = ("tier", "k_tier", "v_tier", "boundary_protect", "schema", "protect_first", "protect_last", "preset",
                  "k_encoder", "k_scale", "v_encoder")
REFERENCE_OPTIONS = {"tier": "fp16"}


@dataclass(frozen=True)
class Spec:
    """One cartridge configuration to evaluate.

    Attributes:
        label (str): how it is shown (the `--tiers` entry or the `--schemas` key).
        options (dict): `cartridge.build` keywords, only those given (schema expanded to a list).
    """

    label: str
    options: dict = field(default_factory=dict)


REFERENCE = Spec("fp16", dict(REFERENCE_OPTIONS))


def _tier_name(name, where):
    if not name:
        raise InputError(f"{where}: empty tier name")
    try:
        get_tier(name)
    except InputError as e:  # "unknown tier 'x'; known tiers: ..." prefixed with where it was found
        raise InputError(f"{where}: {e}") from None
    return name


def _field(options, part, entry):
    """Fold one colon-separated field of a `--tiers` entry into `options`."""
    where = f"--tiers entry {entry!r}"
    if re.fullmatch(r"bp\d+", part):
        key, value = "boundary_protect", int(part[2:])
    elif part.startswith("bp"):
        raise InputError(f"{where}: field {part!r} must be bp followed by a whole number of layers, as bp2")
    elif part.startswith(("k=", "v=")):
        key, value = f"{part[0]}_tier", _tier_name(part[2:], where)
    elif re.fullmatch(r"(pf|pl)\d+", part):  # protect_first / protect_last tokens
        key, value = {"pf": "protect_first", "pl": "protect_last"}[part[:2]], int(part[2:])
    elif part.startswith("preset="):
        key, value = "preset", part[7:]
        presets.resolve(value)  # an unknown name is refused before any build
    elif part.startswith(("kenc=", "venc=")):
        key, value = ("k_encoder" if part[0] == "k" else "v_encoder"), part[5:]
        try:
            check_encoders(**{key: value})
        except InputError as e:
            raise InputError(f"{where}: {e}") from None
    elif part in ("kscale", "nokscale"):
        key, value = "k_scale", part == "kscale"
    elif re.fullmatch(r"[A-Za-z0-9_]+(\+rot)?", part):
        key, value = "tier", _tier_name(part, where)
    else:
        raise InputError(f"{where}: field {part!r} is not TIER, k=TIER, v=TIER, bpN, pfN, plN, preset=NAME, "
                         f"kenc=NAME, kscale, nokscale or venc=NAME (known tiers: {', '.join(TIERS)})")
    if key in options:
        raise InputError(f"{where}: {key} given twice")
    options[key] = value


def parse_entry(entry):
    """Parse one `--tiers` entry, e.g. "mlx4g32:bp2" or "k=fp16:v=fp8".

    Returns:
        Spec: labelled by the entry as written.

    Raises:
        InputError: for an empty or malformed field, a repeated field or an unknown tier.
    """
    entry = entry.strip()
    if not entry:
        raise InputError("--tiers has an empty entry")
    options = {}
    for part in entry.split(":"):
        _field(options, part.strip(), entry)
    return Spec(entry, options)


def parse_tiers(text):
    """Parse a comma-separated `--tiers` value into specs, in order, without duplicate labels."""
    specs = [parse_entry(e) for e in text.split(",")]
    labels = [s.label for s in specs]
    dupes = sorted({x for x in labels if labels.count(x) > 1})
    if dupes:
        raise InputError(f"--tiers lists {', '.join(dupes)} more than once")
    return specs


def _schema_rows(value, base, where):
    """A schema list (or a path to a JSON file holding one, relative to `base`), checked."""
    if isinstance(value, str):
        path = (base / value) if not Path(value).is_absolute() else Path(value)
        value = _read_json(path, f"{where}: schema file")
    if not isinstance(value, list) or not value:
        raise InputError(f"{where}: schema must be a non-empty list of {{layer, k, v}}, found {type(value).__name__}")
    for i, row in enumerate(value):
        if not isinstance(row, dict) or set(row) != {"layer", "k", "v"} or not isinstance(row["layer"], int):
            raise InputError(f"{where}: schema row {i} must be {{\"layer\": int, \"k\": tier, \"v\": tier}}, found {row!r}")
        _tier_name(row["k"], f"{where} row {i}")
        _tier_name(row["v"], f"{where} row {i}")
    return value


def _read_json(path, what):
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise InputError(f"{what} {path} cannot be read: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{what} {path} is not UTF-8 JSON: {e}") from None


def _schema_options(label, value, base):
    where = f"--schemas label {label!r}"
    if isinstance(value, list):
        return {"schema": _schema_rows(value, base, where)}
    if not isinstance(value, dict) or not value:
        raise InputError(f"{where}: expected a schema list or a dict of build keywords, found {value!r}")
    unknown = sorted(set(value) - set(BUILD_KEYWORDS))
    if unknown:
        raise InputError(f"{where}: unknown build keyword(s) {', '.join(unknown)}; allowed: {', '.join(BUILD_KEYWORDS)}")
    options = dict(value)
    for key in ("tier", "k_tier", "v_tier"):
        if key in options:
            options[key] = _tier_name(options[key], where)
    bp = options.get("boundary_protect")
    if bp is not None and (isinstance(bp, bool) or not isinstance(bp, int) or bp < 0):
        raise InputError(f"{where}: boundary_protect must be an integer >= 0, found {bp!r}")
    if "schema" in options:
        options["schema"] = _schema_rows(options["schema"], base, where)
    try:
        check_encoders(options.get("k_encoder", "nearest"), options.get("k_scale", False),
                       options.get("v_encoder", "nearest"))
    except InputError as e:
        raise InputError(f"{where}: {e}") from None
    return options


def load_schemas(path):
    """Read a `--schemas` file into specs, in file order.

    Raises:
        InputError: unreadable file, not a JSON object, a bad schema or build keyword.
    """
    doc = _read_json(path, "schemas file")
    if not isinstance(doc, dict) or not doc:
        raise InputError(f"schemas file {path} must be a non-empty JSON object mapping labels to schemas")
    base = Path(path).resolve().parent
    return [Spec(label, _schema_options(label, value, base)) for label, value in doc.items()]


def check_supported(spec, n_layers):
    """Refuse, before any build, what this `cartridge.build` cannot do for `spec`.

    Raises:
        InputError: a build keyword `cartridge.build` does not take, or a schema of the wrong length.
    """
    accepted = inspect.signature(build).parameters
    missing = [k for k in spec.options if k not in accepted]
    if missing:
        raise InputError(f"{spec.label!r} needs build option(s) {', '.join(missing)}, which this cartridge.build "
                         f"does not take (it takes {', '.join(k for k in BUILD_KEYWORDS if k in accepted)})")
    schema = spec.options.get("schema")
    if schema is not None:
        check_layer_count(schema, n_layers, f"{spec.label!r}: schema")


def _tiers_used(options):
    names = {options.get(k) for k in ("tier", "k_tier", "v_tier")}
    names |= {row[s] for row in options.get("schema") or () for s in ("k", "v")}
    if options.get("boundary_protect"):
        names.add("fp16")
    if options.get("preset"):
        names |= {presets.resolve(options["preset"])[k] for k in ("k_tier", "v_tier")}
    return sorted(n for n in names if n)


def cache_key(document, fingerprint_id, spec, page_size):
    """Hex SHA-256 of everything that decides the cartridge's bytes (see the module docstring)."""
    key = {
        "document": hashlib.sha256(document.encode("utf-8")).hexdigest(),
        "model": fingerprint_id,
        "options": spec.options,
        "page_size": page_size,
        "cartridge": __version__,
        "codecs": {name: get_tier(name).codec_version for name in _tiers_used(spec.options) or ["fp16"]},
    }
    if spec.options.get("preset") in PRESET_RATIOS:  # measured at build since issue 33: not the fixed recipe's bytes
        key["calibration"] = CALIBRATION_VERSION
    o = spec.options  # the encoders a build takes where the entry names none (issue 49: a preset's default)
    encoders = resolve_encoders(o.get("preset") if o.get("calibrate", True) else None, o.get("k_encoder"),
                                o.get("k_scale"), o.get("v_encoder"))
    if encoders != ("nearest", False, "nearest"):  # the keys of cartridges built before issue 49 stay valid
        key["encoders"] = encoders
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def default_work_dir():
    """$XDG_CACHE_HOME/cartridge/eval, or ~/.cache/cartridge/eval."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cartridge" / "eval"


def cartridge_path(work_dir, role, spec, key):
    """work_dir / "<label as a file name>-<role>-<first 16 hex of key>.cart"."""
    slug = re.sub(r"[^A-Za-z0-9_.=-]+", "_", spec.label).strip("._") or "spec"
    return Path(work_dir) / f"{slug}-{role}-{key[:16]}.cart"


def build_or_reuse(document, spec, lm, path, page_size, rebuild=False, progress=None):
    """Build `document` with `spec` at `path`, unless a cartridge already there opens.

    Args:
        document (str): the text. spec (Spec): build keywords. lm (LoadedModel): the model.
        path (Path): from `cartridge_path` (its name holds the cache key). page_size (int): tokens per page.
        rebuild (bool): build even if the cartridge exists. Default: False.
        progress (callable | None): passed to `cartridge.build`.

    Returns:
        tuple[Path, bool]: the cartridge path and whether it was built now (False: reused).
    """
    path = Path(path)
    if path.exists() and not rebuild:
        try:
            read_manifest(path)
            return path, False
        except CartridgeError:
            pass  # not a complete cartridge: build over it
    path.parent.mkdir(parents=True, exist_ok=True)
    build(document, path, model=lm, page_size=page_size, force=path.exists(), progress=progress, **spec.options)
    return path, True
