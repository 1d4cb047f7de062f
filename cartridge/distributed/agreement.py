"""The ranks' agreement: one all_gather of every rank's two digests and local error, so that all ranks refuse with
the same one-line `RankMismatchError` or none does (load: cartridge and model; build: model and document)."""

import struct

import mlx.core as mx
import numpy as np

from ..errors import RankMismatchError

RECORD_BYTES = 1024  # one rank's agreement record: 2 x 32-byte digests, status, message
_HEAD = struct.Struct("<32s32sBH")


def _encode(digests, error):
    msg = (error or "").encode()[: RECORD_BYTES - _HEAD.size]
    raw = _HEAD.pack(digests[0], digests[1], 0 if error else 1, len(msg)) + msg
    return np.frombuffer(raw.ljust(RECORD_BYTES, b"\0"), dtype=np.uint8)


def _decode(row):
    a, b, ok, n = _HEAD.unpack_from(row)
    return (a, b), (None if ok else row[_HEAD.size:_HEAD.size + n].decode(errors="replace"))


def refusal(rows, names):
    """The one message every rank raises, from the gathered records (None when all agree)."""
    decoded = [_decode(bytes(r)) for r in rows]
    failed = [(rank, err) for rank, (_, err) in enumerate(decoded) if err is not None]
    if failed:
        others = f" (ranks {', '.join(str(r) for r, _ in failed[1:])} failed too)" if len(failed) > 1 else ""
        return f"rank {failed[0][0]} of {len(rows)} refused: {failed[0][1]}{others}"
    differ = []
    for i, name in enumerate(names):
        values = [d[i].hex()[:16] for d, _ in decoded]
        if len(set(values)) > 1:
            differ.append(f"{name} differs ({', '.join(f'rank {r} {v}' for r, v in enumerate(values))})")
    return f"ranks disagree: {'; '.join(differ)}" if differ else None


def agree(group, names, digests, error=None):
    """One all_gather: every rank's two digests and local error; all ranks raise the same error or none.

    Args:
        group (mx.distributed.Group): the ranks.
        names (tuple[str, str]): what the digests are, for the message (e.g. ("cartridge", "model")).
        digests (tuple[bytes, bytes]): 32 bytes each (zeros where unknown after a local failure).
        error (str | None): this rank's local failure, one line. Default: None.

    Raises:
        RankMismatchError: on every rank, with one identical message, if any rank failed or any digest
            differs between ranks.
    """
    mine = mx.array(_encode(digests, error))
    rows = np.array(mx.distributed.all_gather(mine, group=group)).reshape(group.size(), RECORD_BYTES)
    message = refusal(rows, names)
    if message:
        raise RankMismatchError(message)


def digest_bytes(hex_or_none):
    """32 bytes of a hex digest, or 32 zero bytes for None (a rank that failed before it had one)."""
    return bytes.fromhex(hex_or_none) if hex_or_none else bytes(32)
