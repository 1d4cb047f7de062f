"""Tiny random-weight llama models with the default model's tokenizer (the fast tests' models; fixtures in
tests/conftest.py), saved where mlx-lm finds a model: a model folder, or a Hugging Face cache's snapshot."""

import json

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from cartridge.models.loader import LoadedModel, fingerprint

TINY_CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": 49152,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}


def make_tiny(tokenizer, seed=0, **overrides):
    """A random-weight float32 llama of TINY_CONFIG (plus overrides), as a LoadedModel."""
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict({**TINY_CONFIG, **overrides}))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return LoadedModel(model, tokenizer, f"tiny-seed{seed}", fingerprint(model, tokenizer))


def save_model_dir(lm, path, config=None, chat_template=True):
    """Save a LoadedModel as an mlx-lm model directory (config.json, safetensors, tokenizer files) at `path`;
    chat_template False leaves the template out, as a base model's folder has none. Returns `path`."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or TINY_CONFIG))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    lm.tokenizer._tokenizer.save_pretrained(str(path))
    if not chat_template:
        (path / "chat_template.jinja").unlink(missing_ok=True)
        settings = json.loads((path / "tokenizer_config.json").read_text())
        settings.pop("chat_template", None)
        (path / "tokenizer_config.json").write_text(json.dumps(settings))
    return path


def make_scripted(tokenizer, after, text, seed=0):
    """A tiny llama (TINY_CONFIG, untied head) that writes `text` greedily after the token `after`: its
    attention and MLP outputs are zero, so each position's logits depend on its own token only, and the
    head maps each token of `after` + `text` to the next one (a bigram table; a token may come back only
    to go on as before).

    Args:
        tokenizer: the tokenizer `text` is encoded with. after (int): the prompt's last token id.
        text (str): what to write; `tokenizer.encode(text)` has at most 64 distinct tokens.

    Returns:
        LoadedModel
    """
    chain = [after, *tokenizer.encode(text, add_special_tokens=False)]
    following = {}
    for a, b in zip(chain, chain[1:]):
        assert following.setdefault(a, b) == b, f"token {a} is followed by two different tokens in {text!r}"
    lm = make_tiny(tokenizer, seed, tie_word_embeddings=False)
    body = lm.model.model
    for layer in body.layers:
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
        layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
    width = TINY_CONFIG["hidden_size"]
    embed, head = np.array(body.embed_tokens.weight), np.zeros((TINY_CONFIG["vocab_size"], width), np.float32)
    for i, (a, b) in enumerate(following.items()):
        embed[a] = np.eye(width, dtype=np.float32)[i]  # token a is basis vector i; the final norm keeps it one
        head[b, i] = 4.0  # logit 32 for b after a (RMSNorm scales a unit basis vector to sqrt(width) = 8)
    body.embed_tokens.weight, lm.model.lm_head.weight = mx.array(embed), mx.array(head)
    mx.eval(lm.model.parameters())
    return LoadedModel(lm.model, tokenizer, f"scripted-{seed}", fingerprint(lm.model, tokenizer))


def hub_snapshot(hub, repo_id, revision, model_dir, main=True):
    """Put the files of `model_dir` where the Hugging Face cache `hub` holds a snapshot of `repo_id` at commit
    `revision` (hub/models--ORG--NAME/snapshots/REVISION/..., copies where the hub would link blobs), and point
    refs/main at it unless `main` is False. Returns the snapshot folder."""
    import shutil

    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    shutil.copytree(model_dir, snapshot)
    if main:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(revision)
    return snapshot
