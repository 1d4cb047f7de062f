"""GGUF architectures as mlx-lm models: the config from `{arch}.*` metadata, the tensor names, and the
conventions in which a GGUF file differs from the Hugging Face checkpoint mlx-lm's model classes follow.

Conventions, each from llama.cpp's `convert_hf_to_gguf.py` and model loader (`src/llama-model.cpp`):
- llama: the Q and K projection rows are permuted to the interleaved ("traditional") RoPE order. The
  rows are kept as stored and the model is built with `rope_traditional=True`, which computes the same
  attention (the Q.K dot products are over the same pairs of dimensions).
- gemma3: every `*norm.weight` is stored as 1 + w (`Gemma3Model.norm_shift`), while mlx-lm's
  `gemma3_text.RMSNorm` computes with 1 + w itself: 1 is subtracted on load (`Arch.norm_offset`). The
  sliding-window pattern (6), the local RoPE base (10,000) and the attention scale (1/sqrt(head_dim), or
  1/sqrt(hidden / heads) for the 62-layer 27B) are not in the file; llama.cpp fixes them in code, as here.
- qwen2, qwen3, gemma3: RoPE in the "NEOX" (non-interleaved) order, rows as in the Hugging Face model.
"""

from dataclasses import dataclass, field

import mlx.core as mx

from ..errors import ModelLoadError

# GGUF tensor name -> mlx-lm parameter path (ggml `gguf-py/gguf/tensor_mapping.py`).
_LLAMA_LAYER = {
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
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GEMMA3_LAYER = {
    **{k: v for k, v in _LLAMA_LAYER.items() if k not in ("attn_norm", "ffn_norm")},
    **_QK_NORMS,
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

GEMMA3_SLIDING_WINDOW_PATTERN = 6  # llama.cpp `hparams.set_swa_pattern(6)` for LLM_ARCH_GEMMA3
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp `rope_freq_base_train_swa` for LLM_ARCH_GEMMA3
GEMMA3_27B_LAYERS = 62  # the one size whose attention scale is 1/sqrt(hidden / heads)


def _value(meta, key, default=None):
    value = meta.get(key, default)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks required key {key!r}")
    return value


def _common(meta, arch):
    """The config keys every supported architecture shares, from `{arch}.*` metadata."""
    heads = int(_value(meta, f"{arch}.attention.head_count"))
    hidden = int(_value(meta, f"{arch}.embedding_length"))
    head_dim = meta.get(f"{arch}.attention.key_length", meta.get(f"{arch}.rope.dimension_count", hidden // heads))
    return {
        "hidden_size": hidden,
        "num_hidden_layers": int(_value(meta, f"{arch}.block_count")),
        "intermediate_size": int(_value(meta, f"{arch}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_value(meta, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(_value(meta, f"{arch}.attention.layer_norm_rms_epsilon")),
        "vocab_size": len(_value(meta, "tokenizer.ggml.tokens")),
        "rope_theta": float(_value(meta, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_value(meta, f"{arch}.context_length")),
        "rope_scaling": _rope_scaling(meta, arch),
    }


def _rope_scaling(meta, arch):
    """mlx-lm's `rope_scaling` from `{arch}.rope.scaling.*`: None, or linear; other kinds are refused."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(_value(meta, f"{arch}.rope.scaling.factor"))}
    raise ModelLoadError(f"GGUF {arch}.rope.scaling.type is {kind!r}; cartridge reads 'none' and 'linear'")


def _llama(meta):
    return {**_common(meta, "llama"), "model_type": "llama", "rope_traditional": True}


def _qwen2(meta):
    args = {**_common(meta, "qwen2"), "model_type": "qwen2", "rope_traditional": False}
    del args["head_dim"]  # qwen2 computes hidden / heads itself
    return args


def _qwen3(meta):
    return {**_common(meta, "qwen3"), "model_type": "qwen3"}


def _gemma3(meta):
    args = {**_common(meta, "gemma3"), "model_type": "gemma3_text"}
    big = args["num_hidden_layers"] == GEMMA3_27B_LAYERS
    return {
        **args,
        "sliding_window": int(_value(meta, "gemma3.attention.sliding_window")),
        "sliding_window_pattern": GEMMA3_SLIDING_WINDOW_PATTERN,
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": args["hidden_size"] // args["num_attention_heads"] if big else args["head_dim"],
    }


@dataclass(frozen=True)
class Arch:
    """One GGUF architecture.

    Attributes:
        name (str): `general.architecture`.
        config (callable): metadata dict -> mlx-lm `ModelArgs` dict (with "model_type": the mlx-lm module).
        layer_names (dict): GGUF block tensor stem ("attn_q") -> mlx-lm path inside a layer.
        norm_offset (float): subtracted from every `*norm.weight` on load (gemma's 1 + w).
    """

    name: str
    config: object
    layer_names: dict = field(default_factory=dict)
    norm_offset: float = 0.0

    def mlx_name(self, gguf_name):
        """The mlx-lm parameter path of a GGUF tensor ("blk.3.attn_q.weight" -> "model.layers.3.self_attn.
        q_proj.weight").

        Raises:
            ModelLoadError: the tensor has no place in the mlx-lm model (loading without it would compute
                another model; llama 3.1's `rope_freqs`, for one, is not read).
        """
        parts = gguf_name.split(".")
        if parts[0] == "blk" and len(parts) == 4 and parts[2] in self.layer_names:
            return f"model.layers.{parts[1]}.{self.layer_names[parts[2]]}.{parts[3]}"
        if len(parts) == 2 and parts[0] in _TOP:
            return f"{_TOP[parts[0]]}.{parts[1]}"
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no counterpart in mlx-lm's {self.name} model")

    def is_offset_norm(self, gguf_name):
        """True for a tensor stored as 1 + w (`norm_offset`)."""
        return self.norm_offset != 0.0 and gguf_name.endswith("norm.weight")


ARCHITECTURES = {
    "llama": Arch("llama", _llama, _LLAMA_LAYER),
    "qwen2": Arch("qwen2", _qwen2, _LLAMA_LAYER),
    "qwen3": Arch("qwen3", _qwen3, {**_LLAMA_LAYER, **_QK_NORMS}),
    "gemma3": Arch("gemma3", _gemma3, _GEMMA3_LAYER, norm_offset=1.0),
}


def architecture(meta):
    """The `Arch` of a GGUF file's `general.architecture`.

    Raises:
        ModelLoadError: an architecture not in `ARCHITECTURES`.
    """
    name = meta.get("general.architecture")
    if name not in ARCHITECTURES:
        raise ModelLoadError(f"GGUF architecture is {name!r}; cartridge reads {', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[name]


def model_args(meta):
    """The mlx-lm `ModelArgs` dictionary of a GGUF file's metadata.

    Args:
        meta (dict): GGUF metadata (`GGUFHeader.metadata`, or `mx.load(..., return_metadata=True)`'s).

    Returns:
        dict: for `ModelArgs.from_dict` of the mlx-lm module named by "model_type"; "tie_word_embeddings"
        is True (the loader sets it False when the file has an `output.weight`).

    Raises:
        ModelLoadError: an unsupported architecture or RoPE scaling, or a required key missing.
    """
    return {**architecture(meta).config(plain_metadata(meta)), "tie_word_embeddings": True}


def plain_metadata(meta):
    """`meta` with MLX scalar arrays (`mx.load`'s metadata) as Python numbers and MLX arrays as lists."""
    def plain(v):
        if isinstance(v, mx.array):
            return v.item() if v.ndim == 0 else v.tolist()
        return v

    return {k: plain(v) for k, v in meta.items()}
