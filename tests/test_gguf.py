"""The default model's GGUF: llama config, tokenizer from metadata, weights loaded quantized."""

import mlx.core as mx
import mlx.nn as nn

from cartridge.gguf import load_gguf, model_args
from cartridge.model import default_gguf_path


def test_smollm2_config():
    _, meta = mx.load(str(default_gguf_path()), return_metadata=True)
    args = model_args(meta)
    assert (args["num_hidden_layers"], args["num_attention_heads"], args["num_key_value_heads"]) == (30, 9, 3)
    assert (args["hidden_size"], args["head_dim"], args["vocab_size"]) == (576, 64, 49152)
    assert args["rope_traditional"] is True and args["rope_theta"] == 100000.0


def test_tokenizer_specials_digits_and_round_trip(smol_tokenizer):
    tok = smol_tokenizer
    assert tok.encode("<|im_start|>user\n", add_special_tokens=False)[0] == 1
    assert tok.eos_token_id == 2
    assert tok.encode(" 2024", add_special_tokens=False) == [216, 34, 32, 34, 36]  # digits one by one
    text = "Hello, naïve wörld — 東京!\n\n  indented\tTab"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_weights_stay_quantized_until_dequantized():
    model, _ = load_gguf(default_gguf_path())
    assert isinstance(model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert model.layers[0].self_attn.q_proj.bits == 4
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert model.model.embed_tokens.bits == 8
