"""Load a llama-architecture GGUF file as an mlx-lm model and a Hugging Face tokenizer.

Weights come from `mx.load(path, return_metadata=True)`, which returns GGUF's Q4_0/Q4_1/Q8_0 tensors
as MLX affine-quantized triples (weight, scales, biases; group size 32). The tokenizer (gpt2-style
byte-level BPE: vocabulary, merges, special tokens) and the chat template come from the metadata
(ggml `docs/gguf.md`, "tokenizer.ggml.*" keys).

GGUF stores the Q and K projection rows in the interleaved ("traditional") RoPE order, so the model is
built with `rope_traditional=True` instead of un-permuting the rows.
"""

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from ..errors import ModelLoadError
from .gguf_check import check_gguf

# GGUF tensor name -> mlx-lm llama parameter name (ggml `gguf-py/gguf/tensor_mapping.py`).
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

# Pre-tokenizer regexes by `tokenizer.ggml.pre`, as in llama.cpp `src/llama-vocab.cpp`.
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_TOKENIZERS = {
    "gpt2": (False, _GPT2_REGEX),
    "default": (False, _GPT2_REGEX),
    "smollm": (True, _GPT2_REGEX),  # digits split one by one, then the GPT-2 regex
    "starcoder": (True, _GPT2_REGEX),
    "llama-bpe": (False, _LLAMA3_REGEX),
    "llama3": (False, _LLAMA3_REGEX),
}
_CONTROL_TOKEN_TYPES = (3, 4)  # CONTROL, USER_DEFINED (GGUF TokenType)


def _scalar(meta, key, default=None):
    value = meta.get(key, default)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks required key {key!r}")
    return value.item() if isinstance(value, mx.array) else value


def model_args(meta):
    """Build the mlx-lm llama `ModelArgs` dictionary from GGUF metadata.

    Args:
        meta (dict): GGUF metadata as returned by `mx.load(..., return_metadata=True)`.

    Returns:
        dict: config for `mlx_lm.models.llama.ModelArgs.from_dict`.

    Raises:
        ModelLoadError: if the architecture is not llama or a required key is missing.
    """
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ModelLoadError(f"GGUF architecture is {arch!r}; cartridge reads 'llama' GGUF files")
    n_heads = int(_scalar(meta, "llama.attention.head_count"))
    hidden = int(_scalar(meta, "llama.embedding_length"))
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv", n_heads)),
        "head_dim": int(_scalar(meta, "llama.rope.dimension_count", hidden // n_heads)),
        "rms_norm_eps": float(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "rope_theta": float(_scalar(meta, "llama.rope.freq_base", 10000.0)),
        "rope_traditional": True,
        "max_position_embeddings": int(_scalar(meta, "llama.context_length")),
        "tie_word_embeddings": True,  # overridden below when an output.weight exists
    }


def _mlx_name(gguf_name):
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        mapped = _LAYER_NAMES.get(parts[2])
        if mapped is None:
            return None
        return f"model.layers.{parts[1]}.{mapped}.{parts[3]}"
    mapped = _TOP_NAMES.get(parts[0])
    return f"{mapped}.{parts[1]}" if mapped else None


def _quantize_modules(model, weights):
    """Swap Linear/Embedding modules for quantized ones wherever the GGUF tensor is quantized."""
    swaps = []
    for name, module in model.named_modules():
        if f"{name}.scales" not in weights:
            continue
        w, scales = weights[f"{name}.weight"], weights[f"{name}.scales"]
        in_features = scales.shape[-1] * 32
        bits = w.shape[-1] * 32 // in_features
        if isinstance(module, nn.Linear):
            q = nn.QuantizedLinear(in_features, w.shape[0], bias=False, group_size=32, bits=bits)
        elif isinstance(module, nn.Embedding):
            q = nn.QuantizedEmbedding(w.shape[0], in_features, group_size=32, bits=bits)
        else:
            raise ModelLoadError(f"GGUF tensor {name} is quantized but {type(module).__name__} is not")
        swaps.append((name, q))
    model.update_modules(tree_unflatten(swaps))


def load_gguf(path):
    """Load a llama GGUF file.

    Args:
        path (str | Path): the .gguf file.

    Returns:
        tuple: (model, tokenizer) where model is an `mlx_lm.models.llama.Model` whose quantized
        tensors are `nn.QuantizedLinear`/`nn.QuantizedEmbedding` (group 32), and tokenizer is an
        `mlx_lm.tokenizer_utils.TokenizerWrapper`.

    Raises:
        ModelLoadError: if the file cannot be read, fails the structural check of
            `cartridge.models.gguf_check.check_gguf`, or is not a supported llama GGUF.
    """
    from mlx_lm.models import llama

    check_gguf(path)  # MLX's reader trusts the file's lengths and offsets; a damaged file can crash it
    try:
        tensors, meta = mx.load(str(path), return_metadata=True)
    except Exception as e:  # mx.load raises RuntimeError/ValueError for unreadable files
        raise ModelLoadError(f"cannot read GGUF file {path}: {e}") from e
    args = model_args(meta)
    weights = {}
    for gguf_name, array in tensors.items():
        name = _mlx_name(gguf_name)
        if name is not None:
            weights[name] = array
    args["tie_word_embeddings"] = "lm_head.weight" not in weights
    model = llama.Model(llama.ModelArgs.from_dict(args))
    _quantize_modules(model, weights)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise ModelLoadError(f"GGUF tensors do not match a llama model: {e}") from e
    model.eval()
    return model, tokenizer_from_metadata(meta)


def tokenizer_from_metadata(meta):
    """Build a byte-level BPE tokenizer with chat template from GGUF `tokenizer.ggml.*` metadata.

    Args:
        meta (dict): GGUF metadata.

    Returns:
        mlx_lm.tokenizer_utils.TokenizerWrapper: wraps a `transformers.PreTrainedTokenizerFast`.

    Raises:
        ModelLoadError: for a tokenizer model other than "gpt2" or an unknown pre-tokenizer.
    """
    from mlx_lm.tokenizer_utils import TokenizerWrapper
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported; cartridge reads 'gpt2' BPE")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ModelLoadError(f"GGUF pre-tokenizer {pre!r} is not supported; known: {sorted(_PRE_TOKENIZERS)}")
    split_digits, regex = _PRE_TOKENIZERS[pre]

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
    types = types.tolist() if types is not None else [1] * len(tokens)
    specials = [tokens[i] for i, t in enumerate(types) if t in _CONTROL_TOKEN_TYPES]
    bpe.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    def token(key):
        i = meta.get(key)
        return tokens[i.item()] if i is not None else None

    bos = token("tokenizer.ggml.bos_token_id")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is not None and bool(add_bos.item()) and bos is not None:
        bpe.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])]
        )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=bos,
        eos_token=token("tokenizer.ggml.eos_token_id"),
        unk_token=token("tokenizer.ggml.unknown_token_id"),
        pad_token=token("tokenizer.ggml.padding_token_id"),
        chat_template=meta.get("tokenizer.chat_template"),
        clean_up_tokenization_spaces=False,
    )
    return TokenizerWrapper(hf)


def is_gguf(path):
    """True if `path` is a file whose first four bytes are the GGUF magic b"GGUF"."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"
