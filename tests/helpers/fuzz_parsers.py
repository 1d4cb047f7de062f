"""Fuzz the parsers of hostile input: MANIFEST, the LMDB index walker, the header records and page
tables, the .cartz reader, and the whole open path with forged digests.

Every generated input must either parse or raise a `CartridgeError`: any other exception, a crash or
an input taking over `HANG_SECONDS` is a failure. Seeded, so a failure is replayed by its
(target, seed, iteration).

    python tests/helpers/fuzz_parsers.py --iterations 2000          # 5 targets x 2000 = 10,000 inputs
    python -m pytest tests/format/test_fuzz.py --fuzz-iterations 2000   # the same through pytest
"""

import argparse
import hashlib
import json
import math
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import zstandard  # noqa: E402
from helpers.cartfiles import forge_index_bytes, redigest_manifest, write  # noqa: E402

from cartridge.errors import CartridgeError  # noqa: E402
from cartridge.format.container import parse_manifest, read_index, read_manifest  # noqa: E402
from cartridge.format.header import parse_header  # noqa: E402
from cartridge.format.layout import DATA_NAME, INDEX_NAME, MANIFEST_NAME  # noqa: E402
from cartridge.format.lmdbfile import read_records  # noqa: E402

HANG_SECONDS = 5.0
BOUNDARY_INTS = [0, 1, -1, 2, 7, 255, 256, 4096, 16384, 65535, 65536, 2 ** 31 - 1, 2 ** 31, 2 ** 32,
                 2 ** 63 - 1, 2 ** 64 - 1, 10 ** 30, -(2 ** 63)]
WORDS = ["fp16", "bf16", "post", "pre", "plain", "chat_template", "float32", "values", "int3", "", "\x00",
         "\ud7ff\u0301", "a" * 300]


class Hang(Exception):
    """An input took longer than HANG_SECONDS (not a CartridgeError: the run fails)."""


@dataclass
class Stats:
    target: str
    inputs: int = 0
    accepted: int = 0
    refused: int = 0
    max_seconds: float = 0.0


# ---------------------------------------------------------------------------------------- mutations


def mutate_bytes(rng, data):
    """A few random edits: bit flips, boundary bytes, random runs, integer fields, truncation, growth."""
    b = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 3, 8])):
        if not b:
            break
        at, op = rng.randrange(len(b)), rng.random()
        if op < 0.35:
            b[at] ^= 1 << rng.randrange(8)
        elif op < 0.55:
            b[at] = rng.choice([0, 1, 0x7F, 0x80, 0xFF])
        elif op < 0.75:
            fmt = rng.choice(["<H", "<I", "<Q"])
            if at + struct.calcsize(fmt) <= len(b):
                struct.pack_into(fmt, b, at, rng.choice(BOUNDARY_INTS) % (1 << (8 * struct.calcsize(fmt))))
        elif op < 0.9:
            b[at:at + 8] = bytes(rng.randrange(256) for _ in range(8))
        elif op < 0.95:
            del b[at:]
        else:
            b[at:at] = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
    return bytes(b)


def random_json(rng, depth=0):
    """A random JSON value biased to what breaks parsers: boundary ints, NaN, deep nesting, odd strings."""
    r = rng.random()
    if r < 0.3:
        return rng.choice(BOUNDARY_INTS + [True, False, None])
    if r < 0.4:
        return rng.choice([math.nan, math.inf, -0.0, 0.5, 1e308])
    if r < 0.6:
        return rng.choice(WORDS)
    if depth > 3 or r < 0.7:
        return [random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(["id", "name", "dtype", "width", "weights", "x"]): random_json(rng, depth + 1)
            for _ in range(rng.randrange(5))}


def mutate_records(rng, records, manifest):
    """Replace, drop or corrupt a few records; sometimes lie about the data size."""
    records = dict(records)
    for _ in range(rng.choice([1, 1, 2, 4])):
        key = rng.choice(sorted(records))
        op = rng.random()
        if op < 0.45:
            records[key] = json.dumps(random_json(rng)).encode()
        elif op < 0.55:
            records[key] = ("[" * rng.choice([10, 1000, 100000])).encode()
        elif op < 0.65:
            del records[key]
        else:
            records[key] = mutate_bytes(rng, records[key])
    if rng.random() < 0.1:
        manifest = dict(manifest, data_size=rng.choice(BOUNDARY_INTS[:12]))
    return records, manifest


# ---------------------------------------------------------------------------------------- targets


class Corpus:
    """Valid inputs to start from, built once in a temporary folder."""

    def __init__(self, folder):
        from cartridge.format.pack import pack

        self.folder = Path(folder)
        self.cart = write(self.folder / "base.cart")
        self.deep = write(self.folder / "deep.cart", n_layers=3, n_kv=1, head_dim=3, page=1, n_tokens=60)
        self.manifest_raw = (self.cart / MANIFEST_NAME).read_bytes()
        self.indexes = [(p / INDEX_NAME).read_bytes() for p in (self.cart, self.deep)]
        self.manifest = read_manifest(self.cart)
        self.records = read_index(self.cart, self.manifest)
        pack(self.cart, self.folder / "base.cartz")
        self.cartz = (self.folder / "base.cartz").read_bytes()
        self.payload = zstandard.ZstdDecompressor().decompressobj().decompress(self.cartz)


def fuzz_manifest(rng, corpus):
    raw = mutate_bytes(rng, corpus.manifest_raw)
    if rng.random() < 0.5 and len(raw) >= 96:  # valid self-digest: reach the field checks
        raw = raw[:64] + hashlib.sha256(raw[:64]).digest() + raw[96:]
    return parse_manifest(raw)


def fuzz_lmdb(rng, corpus):
    return read_records(mutate_bytes(rng, rng.choice(corpus.indexes)))


def fuzz_header(rng, corpus):
    records, manifest = mutate_records(rng, corpus.records, corpus.manifest)
    return parse_header(records, manifest)


def fuzz_pack(rng, corpus):
    from cartridge.format.pack import unpack

    if rng.random() < 0.5:
        data = mutate_bytes(rng, corpus.cartz)
    else:  # structure-aware: edit the decompressed stream, recompress with a valid zstd checksum
        data = zstandard.ZstdCompressor(write_checksum=True).compress(mutate_bytes(rng, corpus.payload))
    src, dest = corpus.folder / "f.cartz", corpus.folder / "f.cart"
    src.write_bytes(data)
    shutil.rmtree(dest, ignore_errors=True)
    return unpack(src, dest)


def fuzz_open(rng, corpus):
    from cartridge.format.reader import open_cartridge

    folder = corpus.folder / "o.cart"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(corpus.cart, folder)
    name = rng.choice([MANIFEST_NAME, INDEX_NAME, DATA_NAME])
    path = folder / name
    path.write_bytes(mutate_bytes(rng, path.read_bytes()))
    if rng.random() < 0.5:  # forge: make the digests match what is there now
        if name == INDEX_NAME:
            forge_index_bytes(folder, path.read_bytes())
        elif name == MANIFEST_NAME and path.stat().st_size >= 96:
            path.write_bytes(path.read_bytes()[:96])
            redigest_manifest(folder)
    info, data = open_cartridge(folder)
    data.close()
    return info


TARGETS = {"manifest": fuzz_manifest, "lmdb": fuzz_lmdb, "header": fuzz_header, "pack": fuzz_pack,
           "open": fuzz_open}


def _alarm(signum, frame):
    raise Hang(f"an input ran over {HANG_SECONDS} s")


def run(target, iterations, seed, corpus):
    """Feed `iterations` inputs to one target.

    Returns:
        Stats

    Raises:
        AssertionError: naming (target, seed, iteration) and the exception, for anything that is not
        a CartridgeError (including Hang).
    """
    stats = Stats(target)
    old = signal.signal(signal.SIGALRM, _alarm)
    try:
        for i in range(iterations):
            rng = random.Random(f"{seed}:{target}:{i}")
            t0 = time.perf_counter()
            signal.setitimer(signal.ITIMER_REAL, HANG_SECONDS)
            try:
                TARGETS[target](rng, corpus)
                stats.accepted += 1
            except CartridgeError:
                stats.refused += 1
            except BaseException as e:
                raise AssertionError(f"fuzz {target} seed {seed} iteration {i}: {type(e).__name__}: {e}") from e
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
            stats.inputs += 1
            stats.max_seconds = max(stats.max_seconds, time.perf_counter() - t0)
    finally:
        signal.signal(signal.SIGALRM, old)
    return stats


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=2000, help="inputs per target (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Corpus(tmp)
        t0 = time.perf_counter()
        stats = [run(t, args.iterations, args.seed, corpus) for t in args.targets.split(",")]
    summary = {"seed": args.seed, "inputs": sum(s.inputs for s in stats), "seconds": time.perf_counter() - t0,
               "targets": [asdict(s) for s in stats]}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
