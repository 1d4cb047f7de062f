"""The one error family of cartridge (spec/FORMAT.md, section "Errors").

Every failure the library detects is a subclass of `CartridgeError`; the CLI turns any of them into a
single line on stderr and a non-zero exit. Messages name the field, the value found and the value
allowed.
"""


class CartridgeError(Exception):
    """Base class of every error cartridge raises on purpose."""


class InputError(CartridgeError):
    """The corpus, question or an option is unusable (empty, not UTF-8, too long, unknown tier)."""


class OutputExistsError(CartridgeError):
    """The output path exists and overwriting it was not asked for (`--force`)."""


class NotACartridgeError(CartridgeError):
    """The path is not a cartridge directory (no manifest, or bad magic)."""


class UnsupportedVersionError(CartridgeError):
    """The cartridge's major format version is newer than this reader supports."""


class CorruptCartridgeError(CartridgeError):
    """A structural check failed: digest, size, offset, alignment, or a header field out of range."""


class DigestError(CorruptCartridgeError):
    """MANIFEST's own SHA-256, or the SHA-256 of index.lmdb it records, does not match the bytes."""


class TruncatedError(CorruptCartridgeError):
    """A file of the cartridge is missing, or its size differs from the size MANIFEST records."""


class IndexFormatError(CorruptCartridgeError):
    """index.lmdb is not a well-formed LMDB file (a page number, offset, length or flag out of bounds)."""


class FieldError(CorruptCartridgeError):
    """A MANIFEST field or index record is missing, not valid JSON, of the wrong type, or outside its
    allowed range (absurd sizes and counts are refused here, before anything is allocated from them)."""


class LayoutError(CorruptCartridgeError):
    """A page table breaks the layout of spec section 3.2: misaligned, overlapping, beyond the data file,
    or non-zero padding."""


class ChecksumError(CorruptCartridgeError):
    """A page's bytes do not match the checksum in the page table.

    Attributes:
        layer (int), side (str), component (str), page (int): the first bad page (None when unknown).
    """

    def __init__(self, message, layer=None, side=None, component=None, page=None):
        super().__init__(message)
        self.layer, self.side, self.component, self.page = layer, side, component, page


class PackError(CorruptCartridgeError):
    """A packed cartridge (.cartz) is malformed: bad magic, truncated stream, member size or checksum."""


class ModelMismatchError(CartridgeError):
    """The cartridge was built with a different model (architecture, weights or tokenizer)."""


class WriteError(CartridgeError):
    """Writing a cartridge failed (disk full, file size limit, permissions); nothing was left behind."""


class ModelLoadError(CartridgeError):
    """The model reference cannot be loaded (missing path, unsupported GGUF, missing package)."""


class RankMismatchError(CartridgeError):
    """Under `mlx.launch`, the ranks did not all open the same cartridge with the same model, or one of
    them failed to open its slice; every rank raises it with the same message."""


class CalibrationUnsupportedError(InputError):
    """Calibration cannot measure this model: a cache other than a KVCache or a sliding-window RotatingKVCache
    (recurrent state, lists of caches), or K/V shapes that differ between layers
    (`cartridge.calibrate.measure.check_plain`)."""


def name_cartridge(error, path):
    """`error` with its message prefixed by "cartridge PATH: " unless it names PATH already (same
    exception object and class, so its attributes, e.g. ChecksumError.page, stay)."""
    if str(path) not in str(error):
        error.args = (f"cartridge {path}: {error}", *error.args[1:])
    return error
