"""A Hugging Face tokenizer from GGUF `tokenizer.ggml.*` metadata (ggml `docs/gguf.md`), wrapped as mlx-lm's
`TokenizerWrapper`.

- "gpt2" (byte-level BPE: llama 3, qwen2/3, SmolLM2): vocabulary, merges and the pre-tokenizer regex of
  `tokenizer.ggml.pre`, as llama.cpp's `src/llama-vocab.cpp` splits text.
- "llama" (SentencePiece: gemma, llama 1/2, mistral): transformers' GGUF converter
  (`transformers.integrations.gguf.gguf_tokenizer_mapping.convert_gguf_tokenizer`, no torch), which rebuilds
  the merges from the vocabulary and its scores, with gemma's fixes for space tokens and merge order.

BOS is prepended when `tokenizer.ggml.add_bos_token` says so; a SentencePiece vocabulary without the flag
gets it, as llama.cpp and transformers do (gemma expects `<bos>` first).
"""

from mlx_lm.tokenizer_utils import TokenizerWrapper
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from ..errors import ModelLoadError
from .gguf_arch import plain_metadata

# Pre-tokenizer regexes by `tokenizer.ggml.pre`, as in llama.cpp `src/llama-vocab.cpp`.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (  # digits one by one; the same as transformers' `tokenization_qwen2.PRETOKENIZE_REGEX`
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {  # name -> (split digits one by one first, regex)
    "gpt2": (False, _GPT2_REGEX),
    "default": (False, _GPT2_REGEX),
    "smollm": (True, _GPT2_REGEX),
    "starcoder": (True, _GPT2_REGEX),
    "llama-bpe": (False, _LLAMA3_REGEX),
    "llama3": (False, _LLAMA3_REGEX),
    "qwen2": (False, _QWEN2_REGEX),
}
_CONTROL_TOKEN_TYPES = (3, 4)  # CONTROL, USER_DEFINED (GGUF TokenType)


def tokenizer_from_metadata(meta):
    """Build the tokenizer (with its chat template, if any) a GGUF file describes.

    Args:
        meta (dict): GGUF metadata (`GGUFHeader.metadata`, or `mx.load(..., return_metadata=True)`'s).

    Returns:
        mlx_lm.tokenizer_utils.TokenizerWrapper: wraps a `transformers.PreTrainedTokenizerFast`.

    Raises:
        ModelLoadError: a tokenizer model other than "gpt2" and "llama", or an unknown BPE pre-tokenizer.
    """
    meta = plain_metadata(meta)
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        backend, add_bos = _byte_level_bpe(meta), bool(meta.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        backend, add_bos = _sentencepiece(meta), bool(meta.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported; cartridge reads 'gpt2' (BPE) and "
                             "'llama' (SentencePiece)")
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key):
        i = meta.get(key)
        return tokens[i] if i is not None else None

    bos = token("tokenizer.ggml.bos_token_id")
    if add_bos and bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=bos,
        eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    return TokenizerWrapper(hf)


def _byte_level_bpe(meta):
    """A `tokenizers.Tokenizer` for a "gpt2" vocabulary: BPE over bytes, its pre-tokenizer, control tokens
    (and user-defined ones) kept whole."""
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} is not supported; known: {sorted(PRE_TOKENIZERS)}")
    split_digits, regex = PRE_TOKENIZERS[pre]
    tokens = list(meta["tokenizer.ggml.tokens"])
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    bpe = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    steps = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    steps += [
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
    bpe.pre_tokenizer = pre_tokenizers.Sequence(steps)
    bpe.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type")
    types = list(types) if types is not None else [1] * len(tokens)
    specials = [tokens[i] for i, t in enumerate(types) if t in _CONTROL_TOKEN_TYPES]
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return bpe


def _sentencepiece(meta):
    """A `tokenizers.Tokenizer` for a "llama" (SentencePiece) vocabulary, by transformers' GGUF converter."""
    # here, not at import: the converter's names move between transformers releases (GGUF_TOKENIZER_MAPPING is
    # not in every one), and a release without them must still load every other model
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (GGUF_TOKENIZER_MAPPING,
                                                                           convert_gguf_tokenizer)
    except ImportError as e:
        raise ModelLoadError(f"this transformers release cannot convert a GGUF SentencePiece tokenizer ({e}); "
                             f"the one tested is transformers 5.25") from e
    fields = {}
    for group in GGUF_TOKENIZER_MAPPING.values():
        for key, name in group.items():
            value = meta.get(f"tokenizer.{key}")
            if value is not None:
                fields[name] = value.tolist() if hasattr(value, "tolist") else value  # numpy arrays as lists
    try:
        backend, _ = convert_gguf_tokenizer(meta.get("general.architecture"), fields)
    except (ValueError, KeyError, TypeError) as e:  # what the converter raises for a vocabulary it cannot use
        raise ModelLoadError(f"cannot build the GGUF SentencePiece tokenizer: {e}") from e
    return backend
