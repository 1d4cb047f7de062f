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


class ChecksumError(CorruptCartridgeError):
    """A page's bytes do not match the checksum in the page table."""


class ModelMismatchError(CartridgeError):
    """The cartridge was built with a different model (architecture, weights or tokenizer)."""


class ModelLoadError(CartridgeError):
    """The model reference cannot be loaded (missing path, unsupported GGUF, missing package)."""
