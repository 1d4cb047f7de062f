"""Full verification of a cartridge (`cartridge verify`): every check a reader makes, plus the ones it
can skip or does not need.

    1. MANIFEST: magic, version, its own SHA-256, field ranges, the sizes of the other two files
    2. index.lmdb: SHA-256 against the manifest, then the bounded LMDB walk
    3. header records: required keys, types, bounds, tiers and components, page tables against the
       layout of spec 3.2 and the size of pages.bin
    4. schema against the tiers' bytes/token formulas
    5. every page's SHA-256 (all bad pages are listed; the first is the error)
    6. padding between and after extents is zero (spec 3.2)
    7. token ids below the model's vocab_size (when model.config records it)
"""

import time
from dataclasses import asdict, dataclass, field

from ..errors import CartridgeError, FieldError, LayoutError
from ..tiers import TIERS
from .container import check_index, open_snapshot
from .pagefile import PageData, bad_heads, head_error, page_error
from .header import parse_header
from .layout import ALIGN


@dataclass
class VerifyReport:
    """What `verify_cartridge` checked and found.

    Attributes:
        path (str): the cartridge. ok (bool): every check passed.
        checks (list[str]): the checks that passed, in order.
        pages (int), extents (int), bytes_hashed (int): what the page check covered.
        bytes_per_token (int | None): K+V bytes per token by the tiers' formulas.
        bad_pages (list[dict]): every page whose checksum failed: {layer, side, component, page}.
        error (CartridgeError | None): the first failure. seconds (float): time taken.
    """

    path: str
    ok: bool = False
    checks: list = field(default_factory=list)
    pages: int = 0
    extents: int = 0
    bytes_hashed: int = 0
    bytes_per_token: int = None
    bad_pages: list = field(default_factory=list)
    error: CartridgeError = None
    seconds: float = 0.0

    def raise_for_error(self):
        """Raise the first failure, if any."""
        if self.error is not None:
            raise self.error

    def to_dict(self):
        """JSON-able form (`cartridge verify --json`)."""
        d = asdict(self)
        d["error"] = None if self.error is None else {"type": type(self.error).__name__, "message": str(self.error)}
        if self.bad_pages:
            d["error"].update(self.bad_pages[0])
        return d


def _check_schema(info):
    """Each (layer, side): the component page bytes per token equal the tier's bytes/token formula."""
    units = dict(info.units())
    for (layer, side), extents in info.extents.items():
        if not units[layer].kind_type.tiered:  # a state is stored as produced: no tier formula
            continue
        tier = TIERS[info.unit_tiers[layer][side]]
        stored = sum(e.page_bytes for e in extents)
        formula = tier.bytes_per_token(*units[layer].shape(side)) * info.page_size
        if stored != formula:
            raise FieldError(f"layer {layer} {side}: pages hold {stored} bytes per {info.page_size} tokens; "
                             f"tier {tier.name}'s formula gives {formula}")
    return info.bytes_per_token()


def _check_pages(info, data, report):
    for extents in info.extents.values():
        for extent in extents:
            for page in data.bad_pages(extent):
                report.bad_pages.append({"layer": extent.layer, "side": extent.side,
                                         "component": extent.component, "page": page})
                if report.error is None:
                    report.error = page_error(extent, page)
            if extent.head_checksums is not None and report.error is None:
                wrong = bad_heads(extent, data.slabs(extent))
                if wrong:  # page sums matched, head sums did not: the head table itself is damaged
                    report.error = head_error(extent, *wrong[0])
            report.extents += 1
            report.pages += len(extent.checksums)
            report.bytes_hashed += len(extent.checksums) * extent.page_bytes


def check_padding(info, data):
    """Bytes outside every extent (alignment gaps and the tail of pages.bin) are zero (spec 3.2).

    Reads under 16 KiB per extent, so `open_cartridge(verify="pages")` runs it too: a cartridge that
    `cartridge verify` refuses is never used to answer.

    Args:
        info (CartridgeInfo): the parsed header (its extents). data (PageData): the mapped pages.bin.

    Raises:
        LayoutError: a gap of ALIGN bytes or more, or a padding byte that is not zero.
    """
    ranges = sorted((e.offset, e.offset + e.shape[0] * e.page_bytes) for ex in info.extents.values() for e in ex)
    gaps = [(end, nxt) for (_, end), (nxt, _) in zip(ranges, ranges[1:] + [(data.size, None)])]
    for start, end in gaps:
        if not 0 <= end - start < ALIGN:
            raise LayoutError(f"gap {start}..{end} in pages.bin is not alignment padding")
        chunk = data.read(start, end)  # < 16 KiB
        if chunk.count(0) != len(chunk):
            first = start + len(chunk) - len(chunk.lstrip(b"\0"))
            raise LayoutError(f"pages.bin byte {first} is padding but not zero (spec 3.2)")


def _check_tokens(info):
    vocab = info.model_config.get("vocab_size")
    if isinstance(vocab, int) and not isinstance(vocab, bool) and len(info.tokens):
        top = int(info.tokens.max())
        if top >= vocab:
            raise FieldError(f"tokens.ids holds id {top}; model.config.vocab_size is {vocab}")


def verify_directory(path):
    """Run every check on the cartridge at `path`.

    Args:
        path (str | Path): cartridge directory (a .cartz goes through `reader.verify_cartridge`).

    Returns:
        VerifyReport: `ok` False and `error` set on the first failure (CartridgeError errors are
        reported, not raised; call `raise_for_error()` to raise).

    """
    t0 = time.perf_counter()
    report = VerifyReport(str(path))
    snap = data = None
    try:
        snap = open_snapshot(path)
        data = PageData(snap.data)
        report.checks.append("manifest")
        records = check_index(snap.index, snap.manifest)
        report.checks.append("index")
        info = parse_header(records, snap.manifest)
        report.checks.append("header and page tables")
        report.bytes_per_token = _check_schema(info)
        report.checks.append("schema")
        _check_pages(info, data, report)
        if report.error is None:
            report.checks.append("page checksums")
            check_padding(info, data)
            report.checks.append("padding")
            _check_tokens(info)
            report.checks.append("token ids")
    except CartridgeError as e:
        report.error = e
    finally:
        if data is not None:
            data.close()
        elif snap is not None:
            snap.data.close()
    report.ok = report.error is None
    report.seconds = time.perf_counter() - t0
    return report
