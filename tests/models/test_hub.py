"""Models by Hugging Face repo id (`cartridge.models.hub`; format 1.10's model.repo_id and model.revision), from
a Hugging Face cache laid out in a temporary HF_HOME with HF_HUB_OFFLINE=1 (`offline_hub`): nothing reaches a
network. A cartridge built from a repo id finds its model by that id after the cache moved on and on another
machine; other weights under the id are refused by the fingerprint; every model that cannot be found is one
line that says how to pass --model."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import cartridge  # noqa: F401, I001  (first: loads OpenBLAS before mlx)
import pytest
from helpers.cartfiles import forge_records, redigest_manifest
from helpers.clirun import run_inprocess as run
from helpers.clirun import run_process
from helpers.tiny_models import hub_snapshot, make_tiny, save_model_dir
from huggingface_hub import constants

from cartridge.errors import FieldError, ModelLoadError, ModelMismatchError
from cartridge.format import keys as K
from cartridge.format.reader import open_cartridge
from cartridge.models.hub import HubModel, is_repo_id, snapshot_of
from cartridge.models.loader import load_model
from cartridge.read.stored import load_recorded_model

REPO, REV1, REV2 = "test-org/tiny", "1" * 40, "2" * 40
DOC = "The tenant may terminate this lease with 60 days of notice. Rent is 900 euros a month.\n"
WAYS = 'pass --model (Python: model=) a GGUF file, an mlx-lm model folder, a Hugging Face repo id (ORG/NAME), "gemma3-270m" or "default"'


@pytest.fixture
def cached(offline_hub, tiny_dir):
    """The tiny model in the offline cache as REPO at commit REV1 (refs/main): its snapshot folder."""
    return hub_snapshot(offline_hub, REPO, REV1, tiny_dir)


@pytest.fixture(scope="session")
def other_dir(smol_tokenizer, tmp_path_factory):
    """A model of the tiny model's shape and tokenizer with other weights (seed 1)."""
    return save_model_dir(make_tiny(smol_tokenizer, seed=1), tmp_path_factory.mktemp("other-model"))


def build_by_id(tmp_path, name="d.cart", model=REPO):
    return cartridge.build(DOC * 3, tmp_path / name, model=model, page_size=16).path


def test_a_repo_id_loads_from_the_offline_cache(cached, tiny):
    lm = load_model(REPO)
    assert (lm.ref, lm.hub, lm.label) == (REPO, HubModel(REPO, REV1), f"{REPO} at revision {REV1[:12]}")
    assert lm.fingerprint == tiny.fingerprint


def test_build_records_the_repo_id_and_revision_and_inspect_shows_both(cached, tmp_path):
    path = build_by_id(tmp_path)
    info = open_cartridge(path, verify="header")[0]
    assert (info.format_version, info.model_ref, info.model_repo_id, info.model_revision) == ("1.11", REPO, REPO, REV1)
    assert f"hub repo      {REPO}, revision {REV1}" in run("inspect", path).stdout.decode()
    model = json.loads(run("inspect", path, "--json").stdout)["model"]
    assert (model["ref"], model["repo_id"], model["revision"]) == (REPO, REPO, REV1)


def test_a_local_model_records_no_repo(built):
    info = open_cartridge(built[0], verify="header")[0]
    assert (info.model_repo_id, info.model_revision) == (None, None)
    assert "hub repo      -, revision -" in run("inspect", built[0]).stdout.decode()


def test_the_cartridge_finds_its_model_by_id_after_the_cache_moves_on(cached, offline_hub, tiny_dir, tmp_path):
    path = build_by_id(tmp_path)
    shutil.rmtree(cached)  # the cache updated the repo: the old snapshot is gone, refs/main names a new one
    hub_snapshot(offline_hub, REPO, REV2, tiny_dir)
    cart = cartridge.load(path)
    assert cart.info.model_ref == REPO and len(cart.tokens) > 0
    assert load_recorded_model(cart.info).hub == HubModel(REPO, REV2)


def test_the_cartridge_finds_its_model_by_id_on_another_machine(cached, tiny_dir, tmp_path, monkeypatch):
    path = build_by_id(tmp_path)
    other = tmp_path / "other-machine" / "hub"
    hub_snapshot(other, REPO, REV2, tiny_dir)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(other))
    shutil.rmtree(cached.parent.parent)  # nothing of this machine's cache is left
    cart = cartridge.load(path)
    assert cart.info.model_revision == REV1 and load_recorded_model(cart.info).hub == HubModel(REPO, REV2)


def test_other_weights_under_the_id_load_the_recorded_revision_while_it_is_cached(cached, offline_hub, other_dir,
                                                                                 tiny, tmp_path):
    path = build_by_id(tmp_path)
    hub_snapshot(offline_hub, REPO, REV2, other_dir)  # main moved to other weights; REV1 stays cached
    lm = load_recorded_model(open_cartridge(path, verify="header")[0])
    assert (lm.ref, lm.hub, lm.fingerprint) == (REPO, HubModel(REPO, REV1), tiny.fingerprint)
    cart = cartridge.load(path)
    assert cart.info.model_revision == REV1 and len(cart.tokens) > 0


def test_other_weights_under_the_id_are_refused_naming_both_revisions(cached, offline_hub, other_dir, tmp_path):
    path = build_by_id(tmp_path)
    keep = tmp_path / "rev1"
    shutil.copytree(cached, keep)
    shutil.rmtree(cached)  # the cache moved on to other weights: REV1 is not cached any more
    hub_snapshot(offline_hub, REPO, REV2, other_dir)
    with pytest.raises(ModelMismatchError) as e:
        cartridge.load(path)
    message = str(e.value)
    assert f"was built with model {REPO} at revision {REV1[:12]} (fingerprint " in message
    assert f"this model {REPO} at revision {REV2[:12]} (fingerprint " in message and "differs in weights" in message
    assert f'--model "$(hf download {REPO} --revision {REV1} -q)"' in message and "\n" not in message
    assert f"model=cartridge.load_model('{REPO}', revision='{REV1}')" in message
    hub_snapshot(offline_hub, REPO, REV1, keep, main=False)  # what `hf download --revision REV1` does
    assert cartridge.load(path, model=load_model(REPO, revision=REV1)).info.model_revision == REV1  # the way out
    assert cartridge.load(path).info.model_revision == REV1  # and then found by itself


def test_hf_download_quiet_prints_the_bare_path(offline_hub, tiny_dir):
    """The suggested command's output is the snapshot folder alone, as `--model "$(...)"` needs."""
    snapshot = hub_snapshot(offline_hub, REPO, REV1, tiny_dir)
    hf = Path(sys.executable).parent / "hf"
    r = subprocess.run([str(hf), "download", REPO, "--revision", REV1, "-q"], capture_output=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().strip() == str(snapshot)


def test_revision_picks_a_snapshot_as_mlx_lm_load_does(cached, offline_hub, other_dir, tiny):
    hub_snapshot(offline_hub, REPO, REV2, other_dir)
    assert load_model(REPO).hub.revision == REV2
    lm = load_model(REPO, revision=REV1)
    assert lm.hub.revision == REV1 and lm.fingerprint == tiny.fingerprint
    with pytest.raises(ModelLoadError, match="a revision applies to a Hugging Face repo id"):
        load_model(str(cached), revision=REV1)


def test_an_uncached_repo_id_offline_is_one_line_and_writes_nothing(offline_hub, tmp_path):
    expect = (f"model test-org/absent is not in the Hugging Face cache ({offline_hub}) and HF_HUB_OFFLINE is set: "
              f"fetch it with `hf download test-org/absent` where the network is up, or {WAYS}")
    with pytest.raises(ModelLoadError) as e:
        load_model("test-org/absent")
    assert str(e.value) == expect
    with pytest.raises(ModelLoadError, match=r"^revision v2 of test-org/absent is not in .*`hf download test-org/absent "
                       r"--revision v2`"):
        load_model("test-org/absent", revision="v2")
    corpus = tmp_path / "doc.txt"
    corpus.write_text(DOC)
    r = run("build", corpus, "-o", tmp_path / "d.cart", "--model", "test-org/absent")
    assert (r.returncode, r.stderr.decode()) == (1, f"error: {expect}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["doc.txt", "hf-home"]


def test_a_cartridge_whose_model_is_gone_says_how_to_pass_model(cached, tmp_path):
    path = build_by_id(tmp_path)
    shutil.rmtree(cached.parent.parent)
    lead = f"cartridge {path} was built with model {REPO} at revision {REV1[:12]}, which cannot be loaded here: model {REPO}"
    with pytest.raises(ModelLoadError) as e:
        cartridge.load(path)
    assert str(e.value).startswith(lead) and str(e.value).endswith(WAYS)
    r = run("ask", path, "How much is the rent?")
    assert r.returncode == 1 and r.stderr.decode().startswith(f"error: {lead}") and r.stderr.decode().count("\n") == 1


def test_a_missing_path_says_how_to_pass_model(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path / "nope"))
    assert str(e.value) == f"model path does not exist: {tmp_path / 'nope'}; {WAYS}"


@pytest.mark.parametrize("ref, expect", [
    ("google/gemma-3-270m", True), ("mlx-community/SmolLM2-135M-Instruct", True), ("gemma3-270m", False),
    ("./org/name", False), ("a/b/c", False), ("org/model.gguf", False), ("org--x/y", False), ("org/-x", False),
])
def test_what_reads_as_a_repo_id(ref, expect):
    assert is_repo_id(ref) is expect


def test_snapshot_of_names_the_repo_of_a_cache_folder(tmp_path):
    folder = tmp_path / "hub" / "models--google--gemma-3-270m" / "snapshots"
    assert snapshot_of(folder / REV1) == HubModel("google/gemma-3-270m", REV1)
    assert snapshot_of(folder / "main-copy") == HubModel("google/gemma-3-270m", None)  # not a commit: not recorded
    assert snapshot_of(tmp_path / "models" / "tiny") is None


def _as_format_1_9(records):
    """The records a 1.9 writer wrote: no model.repo_id / model.revision."""
    records = {k: v for k, v in records.items() if k not in (K.MODEL_REPO_ID, K.MODEL_REVISION)}
    records[K.FORMAT_MINOR] = b"9"
    return records


def test_a_snapshot_path_recorded_before_1_10_finds_its_model_by_the_repo_in_the_path(cached, offline_hub, tiny_dir,
                                                                                        tmp_path):
    path = build_by_id(tmp_path, model=str(cached))  # the snapshot folder, as before repo ids were taken
    info = open_cartridge(path, verify="header")[0]
    assert (info.model_ref, info.model_repo_id, info.model_revision) == (str(cached.resolve()), REPO, REV1)
    forge_records(path, _as_format_1_9)
    redigest_manifest(path, lambda raw: raw.__setitem__(slice(10, 12), (9).to_bytes(2, "little")))
    shutil.rmtree(cached)
    hub_snapshot(offline_hub, REPO, REV2, tiny_dir)
    cart = cartridge.load(path)
    assert (cart.info.format_version, cart.info.model_repo_id) == ("1.9", None)


@pytest.mark.parametrize("key, value, expect", [
    (K.MODEL_REPO_ID, "no-slash", "expected ORG/NAME, a Hugging Face repo id"),
    (K.MODEL_REPO_ID, "../etc/passwd", "expected ORG/NAME, a Hugging Face repo id"),
    (K.MODEL_REPO_ID, 7, "has type int; expected str"),
    (K.MODEL_REVISION, "main", "expected a commit hash of 40 lowercase hex digits"),
])
def test_a_hub_key_that_breaks_its_constraint_is_refused(cached, tmp_path, key, value, expect):
    path = build_by_id(tmp_path)
    forge_records(path, lambda records: {**records, key: json.dumps(value).encode()})
    with pytest.raises(FieldError, match=f"index key '{key}' .*{expect}"):
        open_cartridge(path, verify="header")


def test_build_and_ask_by_repo_id_in_real_processes(cached, tiny_dir, tmp_path):
    corpus, out = tmp_path / "doc.txt", tmp_path / "d.cart"
    corpus.write_text(DOC * 3)
    r = run_process("build", corpus, "-o", out, "--model", REPO, "--page-size", "16")  # HF_HOME etc. from the env
    assert r.returncode == 0, r.stderr.decode()
    assert "prompt format: the model's chat template\n" in r.stdout.decode()
    r = run_process("ask", out, "How much is the rent?", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout == run("ask", out, "How much is the rent?", "--max-tokens", "4", "--model", tiny_dir).stdout
