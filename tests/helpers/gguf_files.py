"""Tiny GGUF files written by llama.cpp's `gguf.GGUFWriter` from tiny random mlx-lm models, in the conventions
llama.cpp's `convert_hf_to_gguf.py` writes them: llama's Q/K rows permuted for interleaved RoPE, gemma's
norms stored as 1 + w. Tensor names come from gguf's own `get_tensor_name_map`, not from cartridge's table.

`write_tiny_gguf` also sets the reference model's quantized weights to what the file holds (gguf's
dequantization, with the conventions undone), so a loaded file must compute the reference's logits.
"""

import importlib

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, MODEL_ARCH, get_tensor_name_map
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten, tree_unflatten
from transformers.convert_slow_tokenizer import bytes_to_unicode

CONFIGS = {  # mlx-lm configs; 256-wide inputs so that k-quant rows (256 per block) fit
    "llama": {"model_type": "llama", "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-5,
              "vocab_size": 258, "rope_theta": 10000.0, "max_position_embeddings": 512, "rope_traditional": False,
              "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512,
              "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "vocab_size": 258,
              "rope_theta": 1000000.0, "max_position_embeddings": 512, "tie_word_embeddings": True},  # q/k/v biases
    "qwen3": {"model_type": "qwen3", "hidden_size": 256, "num_hidden_layers": 2, "intermediate_size": 512,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "rms_norm_eps": 1e-6,
              "vocab_size": 258, "rope_theta": 1000000.0, "max_position_embeddings": 512,
              "tie_word_embeddings": True},
    "gemma3": {"model_type": "gemma3_text", "hidden_size": 256, "num_hidden_layers": 6, "intermediate_size": 512,
               "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128, "rms_norm_eps": 1e-6,
               "vocab_size": 266, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
               "query_pre_attn_scalar": 128, "sliding_window": 8, "sliding_window_pattern": 6,
               "max_position_embeddings": 512},
}
ARCHS = {"llama": MODEL_ARCH.LLAMA, "qwen2": MODEL_ARCH.QWEN2, "qwen3": MODEL_ARCH.QWEN3, "gemma3": MODEL_ARCH.GEMMA3}

# GGUF tensor stem -> ggml type; the rest F32. "k-quants" needs `mx.load`-unreadable types, "mlx" only readable ones.
RECIPES = {
    "k-quants": {"token_embd": Q.Q8_0, "attn_q": Q.Q5_0, "attn_k": Q.Q4_K, "attn_v": Q.Q8_0,
                 "attn_output": Q.Q6_K, "ffn_gate": Q.Q5_K, "ffn_up": Q.Q4_0, "ffn_down": Q.Q4_K, "output": Q.Q6_K},
    "mlx": {"token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0, "ffn_down": Q.Q4_0},
}
# Byte offsets of the float16 scales (d, and dmin where there is one) in a k-quant block (ggml-common.h).
_K_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def sentencepiece_vocab():
    """A gemma-style SentencePiece vocabulary: (tokens, scores, token types) with 4 control tokens, 256 byte
    tokens and the pieces "▁", "a", "b", "ab", "▁a", "c"."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += ["▁", "a", "b", "ab", "▁a", "c"]
    types = [3, 3, 3, 2] + [6] * 256 + [1] * 6  # CONTROL, UNKNOWN, BYTE, NORMAL (gguf TokenType)
    return tokens, [-float(i) for i in range(len(tokens))], types


def byte_level_vocab():
    """A gpt2-style vocabulary: the 256 byte characters, "ab" (merge "a b") and "<|endoftext|>"; (tokens, types,
    merges)."""
    tokens = [bytes_to_unicode()[b] for b in range(256)] + ["ab", "<|endoftext|>"]
    return tokens, [1] * 257 + [3], ["a b"]


def random_model(arch, seed=0):
    """A float32 mlx-lm model of CONFIGS[arch] with every parameter random (norms about 1 + N(0, 0.3), the rest
    N(0, 0.08)), so that a convention left undone changes the logits."""
    config = CONFIGS[arch]
    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(config))
    if arch == "gemma3":
        model.tie_word_embeddings = True
        model.pop("lm_head")
    mx.random.seed(seed)
    one = 0.0 if arch == "gemma3" else 1.0  # norms about 1 (gemma computes with 1 + w): attention far from uniform
    params = [(k, ((one if k.endswith("norm.weight") else 0.0) + (0.3 if k.endswith("norm.weight") else 0.08)
                   * mx.random.normal(v.shape)).astype(mx.float32)) for k, v in tree_flatten(model.parameters())]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def _permute(w, n_head):
    """llama.cpp `LlamaModel.permute`: HF rotate-half rows -> interleaved rows, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w, n_head):
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _random_k_blocks(shape, qtype, rng):
    """Random bytes of a k-quant tensor of float `shape`, with sane float16 scales (gguf cannot quantize to
    k-quants: the blocks are the weights)."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    for at in _K_SCALES[qtype]:
        raw[..., at:at + 2] = np.frombuffer(np.float16(rng.uniform(0.0001, 0.0003)).tobytes(), np.uint8)
    return raw.reshape(*shape[:-1], -1)


def write_tiny_gguf(path, arch, model, recipe, seed=0, extra=None):
    """Write `model` (from `random_model(arch)`) as a GGUF file, quantized by RECIPES[recipe]; set the model's
    quantized weights to the file's (dequantized, conventions undone). `extra(writer)`, if given, adds to the
    file before it is written. Returns `model`."""
    config, rng = CONFIGS[arch], np.random.default_rng(seed)
    names = get_tensor_name_map(ARCHS[arch], config["num_hidden_layers"])
    writer = GGUFWriter(str(path), arch)
    _write_config(writer, arch, config)
    params = dict(tree_flatten(model.parameters()))
    for name, value in params.items():
        w = np.array(value, dtype=np.float32)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        stem = gguf_name.split(".")[-2] if gguf_name.startswith("blk.") else gguf_name.split(".")[0]
        w = _to_gguf(arch, stem, gguf_name, w, config)
        qtype = RECIPES[recipe].get(stem, Q.F32) if w.ndim == 2 else Q.F32
        if qtype in _K_SCALES:
            data = _random_k_blocks(w.shape, qtype, rng)
        elif qtype == Q.F32:
            data = w
        else:
            data = quantize(w, qtype)
        writer.add_tensor(gguf_name, data, raw_dtype=None if qtype == Q.F32 else qtype)
        params[name] = mx.array(_from_gguf(arch, stem, gguf_name, dequantize(data, qtype), config))
    if extra is not None:
        extra(writer)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


def _to_gguf(arch, stem, gguf_name, w, config):
    if arch == "gemma3" and gguf_name.endswith("norm.weight"):
        return w + 1.0
    if arch == "llama" and stem in ("attn_q", "attn_k"):
        heads = config["num_attention_heads"] if stem == "attn_q" else config["num_key_value_heads"]
        return _permute(w, heads)
    return w


def _from_gguf(arch, stem, gguf_name, w, config):
    w = np.asarray(w, dtype=np.float32)
    if arch == "gemma3" and gguf_name.endswith("norm.weight"):
        return w - 1.0
    if arch == "llama" and stem in ("attn_q", "attn_k"):
        heads = config["num_attention_heads"] if stem == "attn_q" else config["num_key_value_heads"]
        return _unpermute(w, heads)
    return w


def _write_config(writer, arch, c):
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(c["rope_theta"])
    head_dim = c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(c["sliding_window"])
        tokens, scores, types = sentencepiece_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_add_bos_token(True)
        writer.add_add_space_prefix(False)
    else:
        tokens, types, merges = byte_level_vocab()
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_eos_token_id(257)
        writer.add_bos_token_id(257)
        writer.add_add_bos_token(False)
