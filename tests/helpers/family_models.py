"""The family matrix (issue 17): a tiny random-weight model of every text family in the installed
mlx-lm, made from that family's own `ModelArgs`, checked against a fresh mlx-lm prefill.

`check_family(name, tokenizer, folder)` returns one result row:
    {"family", "status": "pass" | "refused" | "no tiny model" | "FAIL", "detail", "kinds"}
"pass" means: fp16 greedy tokens identical to mlx-lm's and teacher-forced logits of question +
answer within `TOLERANCE`, with attention "portable" and "dequantize-once", and an mlx4g32 build that
answers. `scripts/family_table.py` writes docs/models.md from these rows.
"""

import dataclasses
import importlib
import pkgutil

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import mlx_lm.models as M
from mlx_lm.models.cache import make_prompt_cache
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes

from cartridge.errors import InputError
from cartridge.models.families import leaves
from cartridge.models.loader import LoadedModel, fingerprint

WINDOW = 16  # sliding windows shorter than the document and than question + answer
PAGE = 32
ANSWER = 12  # greedy tokens: question + answer pushes a window past the prefix end
TOLERANCE = 1e-3
MAX_PARAMETERS = 30_000_000  # a config that leaves a real model's size in place is not tiny
POLICIES = ("portable", "dequantize-once")
DOC = ("The lease runs from March 1, 2024 to February 28, 2026. The tenant pays 1,450 euros each month, due "
       "on the fifth day. Pets are allowed with a deposit of 300 euros. The landlord repairs the heating; "
       "the tenant repairs damage they cause. Either party may end the lease with three months' notice in "
       "writing. The apartment has two bedrooms, a balcony facing south, and a cellar storage room. ") * 2
QUESTION = "When is the rent due, and how much is the pet deposit?"

NOT_MODELS = {"base", "cache", "rope_utils", "switch_layers", "activations", "pipeline", "ssm", "gated_delta",
              "mla", "bitlinear_layers"}

COMMON = {  # field name -> tiny value, for any family's ModelArgs
    "hidden_size": 128, "d_model": 128, "n_embd": 128, "hidden_dim": 128, "dim": 128,
    "num_hidden_layers": 4, "n_layers": 4, "n_layer": 4, "num_layers": 4,
    "intermediate_size": 256, "n_inner": 256, "ffn_hidden_size": 256, "intermediate_size_mlp": 256,
    "num_attention_heads": 4, "n_heads": 4, "n_head": 4, "num_heads": 4,
    "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2, "multi_query_group_num": 2,
    "head_dim": 32, "kv_channels": 32,
    "rope_theta": 10000.0, "rotary_emb_base": 10000.0, "rope_scaling": None,
    "max_position_embeddings": 4096, "n_positions": 4096, "n_ctx": 4096, "block_size": 4096,
    "model_max_length": 4096, "seq_length": 4096,
    "tie_word_embeddings": True, "rotary_pct": 1.0, "partial_rotary_factor": 0.5,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_intermediate_size": 64, "expert_ffn_hidden_size": 64,
    "shared_intermediate_size": 64, "n_shared_experts": 1, "num_shared_experts": 1, "num_shared_expert": 1,
    "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "decoder_sparse_step": 1, "norm_topk_prob": True, "moe_layer_freq": 1,
    "sliding_window": WINDOW, "sliding_window_size": WINDOW, "attention_window_size": WINDOW,
    "window_size": WINDOW, "loop_window_size": WINDOW, "sliding_window_pattern": 2,
    "kv_lora_rank": 32, "q_lora_rank": 32, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32, "v_head_dim": 32,
    "attention_bias": False, "mlp_bias": False, "use_bias": False, "use_qk_norm": False, "qk_norm": False,
    "logits_scaling": 1.0, "attention_multiplier": 0.17, "embedding_multiplier": 1.0,
    "residual_multiplier": 1.0, "scale_depth": 1.0, "scale_emb": 1.0, "dim_model_base": 128,
    "state_size": 16, "ssm_state_size": 16, "conv_kernel": 4, "conv_L_cache": 3, "time_step_rank": 8,
    "n_groups": 1, "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_expand": 2, "mamba_num_heads": 4,
    "mamba_head_dim": 32, "use_conv_bias": True, "conv_bias": False, "mamba_proj_bias": False,
    "time_step_limit": (0.0, float("inf")),
    "mlp_only_layers": [], "shared_expert_intermediate_size": 64, "num_dense_layers": 1,
    "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_n_groups": 1, "mamba_conv_bias": True,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}

OVERRIDES = {  # family -> extra or different fields (what COMMON's guesses cannot give)
    "gemma3_text": {"sliding_window_pattern": 2, "query_pre_attn_scalar": 32},
    "gpt_oss": {"num_local_experts": 4, "layer_types": ["sliding_attention", "full_attention"] * 2},
    "cohere2": {"sliding_window_pattern": 2, "layer_norm_eps": 1e-5},
    "qwen3_next": {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
                   "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "full_attention_interval": 2},
    "qwen3_5": {"linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
                "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4, "full_attention_interval": 2},
    "lfm2": {"block_dim": 128, "block_ff_dim": 256, "block_multiple_of": 32, "block_ffn_dim_multiplier": 1.0,
             "block_auto_adjust_ff_dim": False, "full_attn_idxs": [1, 3], "norm_eps": 1e-5},
    "mamba2": {"num_heads": 8, "head_dim": 32, "intermediate_size": 256, "tie_word_embeddings": True},
    "deepseek_v3": {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    "Klear": {"mlp_only_layers": []},
    "baichuan_m1": {"sliding_window_layers": [0, 2], "conv_window": 2, "tie_word_embeddings": False},
    "dbrx": {"ffn_config": {"ffn_hidden_size": 256, "moe_num_experts": 4, "moe_top_k": 2},
             "attn_config": {"kv_n_heads": 2, "clip_qkv": 8.0, "rope_theta": 10000.0}},
    "deepseek_v2": {"rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
                                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.0}},
    "exaone4": {"sliding_window_pattern": "LG"},
    "exaone_moe": {"layer_types": ["sliding_attention", "full_attention"] * 2, "is_moe_layer": [False, True] * 2},
    "glm_moe_dsa": {"rope_parameters": {"rope_theta": 10000.0}, "index_head_dim": 32, "index_n_heads": 2,
                    "index_topk": 16, "topk_method": "noaux_tc", "scoring_func": "sigmoid"},
    "granitemoehybrid": {"layer_types": ["mamba", "attention"] * 2},
    "hunyuan": {"rope_scaling": {"alpha": 1.0, "factor": 1.0, "type": "dynamic"}},
    "jamba": {"attn_layer_offset": 1, "attn_layer_period": 2, "expert_layer_offset": 1, "expert_layer_period": 2},
    "gptj": {"rotary_dim": 16},
    "lfm2_moe": {"full_attn_idxs": [1, 3], "conv_L_cache": 3},
    "falcon_h1": {"mamba_d_ssm": 128},  # mamba_n_heads x mamba_d_head
    "longcat_flash": {"mla_scale_q_lora": True, "mla_scale_kv_lora": True, "zero_expert_type": "identity",
                      "zero_expert_num": 1, "attention_method": "MLA"},
    "mellum": {"rope_parameters": {t: {"rope_theta": 10000.0} for t in ("sliding_attention", "full_attention")}},
    "ministral3": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "llama_4_scaling_beta": 0.1,
                                       "original_max_position_embeddings": 4096},
                   "layer_types": ["sliding_attention", "full_attention"] * 2},
    "mistral4": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "llama_4_scaling_beta": 0.1,
                                     "original_max_position_embeddings": 4096}},
    "plamo": {"n_shared_head": 2},
    "step3p5": {"num_attention_groups": 2, "moe_top_k": 2, "share_expert_dim": 64,
                "layer_types": ["sliding_attention", "full_attention"] * 2},
    "minicpm3": {"rope_scaling": {"original_max_position_embeddings": 4096}},
    "openelm": {"num_transformer_layers": 4, "model_dim": 128, "ffn_dim_divisor": 32, "num_query_heads": [4] * 4,
                "num_kv_heads": [2] * 4, "ffn_multipliers": [2.0] * 4},
    "phixtral": {"model_dim": 128, "num_heads": 4, "num_layers": 4, "rotary_dim": 16},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "conv1d_width": 4, "logits_soft_cap": 30.0,
                        "rope_theta": 10000.0},
    "gemma3n": {"num_kv_shared_layers": 2, "rope_local_base_freq": 10000.0, "final_logit_softcapping": 30.0,
                "activation_sparsity_pattern": [0.0] * 4, "hidden_size_per_layer_input": 16,
                "layer_types": ["sliding_attention", "full_attention"] * 2, "altup_num_inputs": 2,
                "altup_coef_clip": 120.0, "altup_correct_scale": True, "altup_active_idx": 0, "laurel_rank": 8},
    "gemma4_text": {"num_kv_shared_layers": 2, "global_head_dim": 64, "hidden_size_per_layer_input": 16,
                    "rope_parameters": None},  # None: its own per-layer-type RoPE
    "kimi_linear": {"linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 4,
                                           "head_dim": 32, "short_conv_kernel_size": 4},
                    "num_experts_per_token": 2},
    "llama4_text": {"no_rope_layers": [1, 1, 1, 0], "intermediate_size_mlp": 256},
    "llama4": {"attention_chunk_size": WINDOW, "interleave_moe_layer_step": 2, "num_experts_per_tok": 1,
               "intermediate_size_mlp": 256},
    "kimi_k3": {"linear_attn_config": {"kda_layers": [1, 3], "full_attn_layers": [2, 4], "num_heads": 4,
                                       "head_dim": 32, "short_conv_kernel_size": 4},
                "num_experts_per_token": 2},
    "longcat_flash_ngram": {"zero_expert_num": 1, "mla_scale_q_lora": True, "mla_scale_kv_lora": True,
                            "ngram_vocab_size_ratio": 1, "emb_neighbor_num": 2, "emb_split_num": 2},
    "mimo_v2_flash": {"hybrid_layer_pattern": [1, 0, 1, 0], "moe_layer_freq": [0, 1, 1, 1],
                      "add_swa_attention_sink_bias": True, "add_full_attention_sink_bias": False,
                      "topk_method": "noaux_tc", "scoring_func": "sigmoid", "layernorm_epsilon": 1e-5,
                      "swa_rope_theta": 10000.0, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
                      "v_head_dim": 32, "swa_head_dim": 32, "swa_v_head_dim": 32, "partial_rotary_factor": 0.5},
    "minimax_m3_vl": {"moe_layer_freq": [0, 1, 1, 1], "dense_intermediate_size": 256, "rotary_dim": 16},
    "muse_spark": {"post_norm_eps": 1e-5, "layer_rope_theta": [10000.0, 10000.0, 10000.0, 0.0],
                   "final_logit_softcapping": 30.0, "output_multiplier": 1.0, "moe_hidden_size": 64,
                   "num_shared_experts": 0, "layer_types": ["sliding_attention", "full_attention"] * 2},
    "nemotron-nas": {"block_configs": [{"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}}] * 2 + [
        {"attention": {"no_op": True}, "ffn": {"ffn_mult": 1.0}},
        {"attention": {"n_heads_in_group": 4}, "ffn": {"replace_with_linear": True}}]},
    "nemotron_h": {"hybrid_override_pattern": ["M", "*", "M", "-"], "head_dim": 32},
    "spark2_5": {"rope_parameters": {t: {"rope_theta": 10000.0, "rope_type": "default"}
                                     for t in ("sliding_attention", "full_attention")}},
    "phi3small": {"vocab_size": 100352, "ff_intermediate_size": 256},  # its logits write -inf at ids up to 100351
    "prism_hadamard_qwen35": {"schema_version": 1, "tensor_namespace": "mlx-lm-text",  # one 2-bit packed layer
                              "quantization": {"bits": 2, "group_size": 128, "mode": "affine"},
                              "modules": [{"path": "model.layers.0.mlp.shared_expert.up_proj", "embedding": False,
                                           "dtype": "float16", "block": 0}]},
}
for _qwen in ("qwen3_5", "qwen3_5_moe"):
    OVERRIDES[_qwen] = {**OVERRIDES["qwen3_next"], "head_dim": 32}


TEXT_FAMILY = {"gemma3": "gemma3_text", "gemma3n": "gemma3n", "gemma4": "gemma4_text", "llama4": "llama4",
               "mistral3": "ministral3",
               "kimi_vl": "deepseek_v3", "kimi_k25": "deepseek_v3", "kimi_k3": "kimi_k3", "lfm2-vl": "lfm2",
               "muse_spark": "muse_spark", "minimax_m3_vl": "minimax_m3_vl", "qwen2_vl": "qwen2", "qwen3_vl": "qwen3",
               "qwen3_vl_moe": "qwen3_moe", "pixtral": "llama", "qwen3_5_moe": "qwen3_5",
               "prism_hadamard_qwen35": "qwen3_5"}


def families():
    """Every mlx-lm model module that defines `Model` and `ModelArgs`, sorted by name."""
    names = sorted(m.name for m in pkgutil.iter_modules(M.__path__) if m.name not in NOT_MODELS)
    return [n for n in names if _module(n) is not None]


def _module(name):
    try:
        mod = importlib.import_module(f"mlx_lm.models.{name}")
    except (Exception, SystemExit):  # olmo exits when its package (ai2-olmo) is not installed
        return None
    return mod if hasattr(mod, "Model") and hasattr(mod, "ModelArgs") else None


def _guess(field, vocab):
    """A tiny value for a required field COMMON does not name: by its name, then its type."""
    name, kind = field.name, field.type
    if name == "vocab_size":
        return vocab
    if "eps" in name or "epsilon" in name:
        return 1e-5
    if name.endswith("layer_types"):
        return ["sliding_attention", "full_attention"] * 2
    text = str(kind)
    if kind is bool or "bool" in text:
        return False
    if kind is float or "float" in text:
        return 1.0
    if kind is int or "int" in text:
        return 2
    if "dict" in text.lower():
        return {}
    return None


def tiny_config(name, vocab):
    """config.json of a tiny model of family `name` (model_type, COMMON, OVERRIDES, then guesses)."""
    mod = _module(name)
    vocabs = {"vocab_size": vocab, "num_vocab": vocab, "vocab_size_per_layer_input": vocab}  # gemma3n, gemma4
    config = {"model_type": name, **vocabs, "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5,
              "norm_eps": 1e-5, "layer_norm_epsilon": 1e-5}
    fields = {f.name: f for f in dataclasses.fields(mod.ModelArgs)}
    config.update({k: v for k, v in COMMON.items() if k in fields})
    config.update(OVERRIDES.get(name, {}))
    if "text_config" in fields and "text_config" not in config:  # multimodal wrappers of a text family
        text = TEXT_FAMILY.get(name, name)
        config["text_config"] = {**COMMON, **vocabs, "rms_norm_eps": 1e-5, "model_type": text,
                                 **OVERRIDES.get(text, {})}
    for f in fields.values():
        if f.name not in config and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            config[f.name] = _guess(f, vocab)
    return config


def make_model(name, tokenizer, seed=0, **fields):
    """A random-weight float32 model of family `name` as a LoadedModel (raises on any failure);
    `fields` replace those of its tiny config.

    float32, as mlx-lm's CPU kernels (GatherMM of the MoE families) need; the fp16 tier then rounds
    K/V, which the logits tolerance covers."""
    config = {**tiny_config(name, len(tokenizer.vocab) if hasattr(tokenizer, "vocab") else 49152), **fields}
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    size = sum(v.size for _, v in tree_flatten(model.parameters()))  # lazy: nothing allocated yet
    if size > MAX_PARAMETERS:
        raise ValueError(f"the tiny config still makes {size:,} parameters (a default left unset)")
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return LoadedModel(model, tokenizer, f"tiny-{name}", fingerprint(model, tokenizer))


def _greedy(model, prompt, cache, n):
    logits = model(mx.array([prompt], dtype=mx.uint32), cache=cache)
    out = []
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([[out[-1]]], dtype=mx.uint32), cache=cache)
    return out


def _fresh(model, prefix, stored=None):
    """mlx-lm's own caches after a fresh prefill of `prefix`; with `stored`, K/V rounded to that dtype."""
    cache = make_prompt_cache(model)
    model(mx.array([prefix], dtype=mx.uint32), cache=cache)
    for c in leaves(cache) if stored else ():  # the caches inside a CacheList too
        if getattr(c, "keys", None) is not None:
            c.keys, c.values = c.keys.astype(stored).astype(c.keys.dtype), c.values.astype(stored).astype(c.values.dtype)
    return cache


def reference(model, prefix, question, n=ANSWER, stored=mx.float16):
    """mlx-lm alone: the greedy answer after a fresh prefill, and the teacher-forced logits of question +
    answer (one forward pass after a fresh prefill of the prefix whose K/V are rounded to `stored`, the
    dtype the fp16 tier keeps: the float32 tiny models' K/V are not fp16 numbers, and that rounding
    alone moves gemma3's logits by 1.5e-2)."""
    answer = _greedy(model, question, _fresh(model, prefix), n)
    logits = model(mx.array([question + answer], dtype=mx.uint32), cache=_fresh(model, prefix, stored))
    return answer, logits[0].astype(mx.float32)


def _against(cart, question, answer, ref_logits):
    got = _greedy(cart.model, question, cart.prompt_cache(), len(answer))
    logits = cart.model(mx.array([question + answer], dtype=mx.uint32), cache=cart.prompt_cache())
    got_logits = logits[0].astype(mx.float32)
    # equal logits count as 0 apart, -inf ones too (phi3small masks its unused ids with -inf)
    diff = mx.where(got_logits == ref_logits, 0.0, mx.abs(got_logits - ref_logits)).max().item()
    return got == answer, diff


def check_family(name, tokenizer, folder):
    """Build, load and answer with one family's tiny model; the result row (see the module docstring)."""
    row = {"family": name, "status": "FAIL", "detail": "", "kinds": ""}
    try:
        lm = make_model(name, tokenizer)
    except (Exception, SystemExit) as e:
        row.update(status="no tiny model", detail=f"{type(e).__name__}: {str(e)[:120]}")
        return row
    try:
        return _check(lm, row, folder)
    except InputError as e:
        row.update(status="refused", detail=str(e))
    except (Exception, SystemExit) as e:
        row.update(detail=f"{type(e).__name__}: {str(e)[:160]}")
    return row


def _check(lm, row, folder):
    path = cartridge.build(DOC, folder / "fp16.cart", model=lm, page_size=PAGE, force=True).path
    carts = {policy: cartridge.load(path, model=lm, attention=policy, verify="header") for policy in POLICIES}
    info = carts["portable"].info
    row["kinds"] = ",".join(sorted({m.kind for m in info.layers} | {u.kind for _, u in info.units()}))
    question = carts["portable"].question_prompt(QUESTION)
    answer, ref = reference(lm.model, info.tokens.tolist(), question)
    worst = 0.0
    for policy, cart in carts.items():
        same, diff = _against(cart, question, answer, ref)
        worst = max(worst, diff)
        if not same or not diff <= TOLERANCE:
            row["detail"] = f"{policy}: tokens {'same' if same else 'differ'}, max logit diff {diff:.2e}"
            return row
    q4 = cartridge.build(DOC, folder / "q4.cart", model=lm, tier="mlx4g32", page_size=PAGE, force=True)
    _greedy(lm.model, question, cartridge.load(q4.path, model=lm, verify="header").prompt_cache(), 4)
    row.update(status="pass", detail=f"max logit diff {worst:.1e}")
    return row
