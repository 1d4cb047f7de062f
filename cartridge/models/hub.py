"""Models named by a Hugging Face repo id ("ORG/NAME"), resolved exactly as mlx-lm resolves them.

`mlx_lm.utils._download`, what `mlx_lm.load` and `mlx_lm.generate --model ORG/NAME` call, hands the id to
`huggingface_hub.snapshot_download`: a cached snapshot is used without the network when the hub cannot be
reached or HF_HUB_OFFLINE=1, otherwise the snapshot is fetched. Here each of its failures becomes one line,
and the snapshot folder (`hub/models--ORG--NAME/snapshots/COMMIT`) gives the revision a cartridge records
(`model.repo_id`, `model.revision`: spec/FORMAT.md 4.5, format 1.10).

    path, hub = resolve("mlx-community/SmolLM2-135M-Instruct")  # .../snapshots/<commit>, HubModel(id, commit)
"""

import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import constants, errors
from huggingface_hub.utils import HFValidationError, validate_repo_id
from mlx_lm.utils import _download  # mlx-lm's own resolution: its allow-patterns, HF_HUB_OFFLINE, ModelScope

from ..errors import ModelLoadError

CACHE_FOLDER_PREFIX = "models--"  # huggingface_hub's repo_folder_name for repo_type "model"
SNAPSHOTS = "snapshots"
COMMIT = re.compile("[0-9a-f]{40}")  # a snapshot folder's name: the commit hash (huggingface_hub REGEX_COMMIT_HASH)
WAYS = ("pass --model (Python: model=) a GGUF file, an mlx-lm model folder, a Hugging Face repo id (ORG/NAME), "
        "\"gemma3-270m\" or \"default\"")  # the names of `loader.PACKAGED_MODELS`


@dataclass(frozen=True)
class HubModel:
    """A model of the Hugging Face hub, as resolved.

    Attributes:
        repo_id (str): "ORG/NAME".
        revision (str | None): the commit hash of the snapshot it resolved to (None where the folder is not
            in Hugging Face's cache layout, e.g. a ModelScope download).
    """

    repo_id: str
    revision: str | None = None

    def __str__(self):
        return self.repo_id if self.revision is None else f"{self.repo_id} at revision {self.revision[:12]}"


def is_repo_id(ref):
    """True if `ref` reads as a hub repo id "ORG/NAME" (huggingface_hub's `validate_repo_id`, with the
    ORG part required; a name without one is a file name here). Call it for a path that does not exist.

    Args:
        ref (str): a model reference.

    Returns:
        bool
    """
    if ref.count("/") != 1 or ref.startswith((".", "~")) or ref.lower().endswith(".gguf"):
        return False
    try:
        validate_repo_id(ref)
    except HFValidationError:
        return False
    return True


def snapshot_of(path):
    """The repo id and revision of a snapshot folder of the Hugging Face cache, or None for any other path.

    Args:
        path (str | Path): a model folder, e.g. ~/.cache/huggingface/hub/models--ORG--NAME/snapshots/COMMIT.

    Returns:
        HubModel | None
    """
    path = Path(path).expanduser().absolute()
    repo = path.parent.parent.name
    if path.parent.name != SNAPSHOTS or not repo.startswith(CACHE_FOLDER_PREFIX) or not path.name:
        return None
    repo_id = repo[len(CACHE_FOLDER_PREFIX):].replace("--", "/")  # a repo id has no "--" of its own
    if repo_id.count("/") != 1:
        return None
    return HubModel(repo_id, path.name if COMMIT.fullmatch(path.name) else None)


def recorded_ref(model_ref, repo_id=None):
    """The reference to load a cartridge's model by: its repo id where it records one (format 1.10); a
    snapshot path of the Hugging Face cache that is gone (a cartridge from before 1.10, after the cache moved
    on) by its repo id; else `model.ref` as recorded.

    Args:
        model_ref (str): the cartridge's `model.ref`. repo_id (str | None): its `model.repo_id`. Default: None.

    Returns:
        str
    """
    if repo_id:
        return repo_id
    snapshot = snapshot_of(model_ref) if model_ref not in ("", "default") else None
    if snapshot is not None and not Path(model_ref).exists():
        return snapshot.repo_id
    return model_ref


def cached_snapshot(repo_id, revision):
    """The folder of a commit's snapshot of a hub model in the local Hugging Face cache (HF_HUB_CACHE), if it
    is there with its config.json; nothing reaches the network.

    Args:
        repo_id (str): "ORG/NAME". revision (str | None): a commit hash (a cartridge's `model.revision`).

    Returns:
        Path | None: hub/models--ORG--NAME/snapshots/REVISION, or None when it is not cached (or no revision).
    """
    if not revision or not COMMIT.fullmatch(revision):
        return None
    folder = Path(constants.HF_HUB_CACHE) / (CACHE_FOLDER_PREFIX + repo_id.replace("/", "--")) / SNAPSHOTS / revision
    return folder if (folder / "config.json").is_file() else None


def download_command(repo_id, revision):
    """The shell command that prints the local folder of a revision of a hub model, downloading it where
    needed: `hf download ... -q` prints the bare path (huggingface_hub 1.x's quiet format), which
    `--model "$(...)"` takes."""
    return f"hf download {repo_id} --revision {revision} -q"


def resolve(repo_id, revision=None):
    """The local folder of a hub model, found or fetched as mlx-lm does.

    Args:
        repo_id (str): "ORG/NAME". revision (str | None): a branch, tag or commit hash, as `mlx_lm.load`
            takes it. Default: None (the repo's main branch).

    Returns:
        tuple[Path, HubModel]: the snapshot folder and what it is.

    Raises:
        ModelLoadError: one line naming the repo id and what to do: not cached where the hub cannot be
            reached (offline), an incomplete snapshot, an unknown repo or revision, a hub error.
    """
    at = "" if revision is None else f" --revision {revision}"
    fetch = f"fetch it with `hf download {repo_id}{at}`"
    try:
        path = Path(_download(repo_id, revision=revision))
    except errors.IncompleteSnapshotError:
        raise ModelLoadError(f"the cached snapshot of {repo_id} misses files and the hub cannot be reached: "
                             f"{fetch} where it can") from None
    except errors.LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub cannot be reached"
        what = f"revision {revision} of {repo_id}" if revision else f"model {repo_id}"
        raise ModelLoadError(f"{what} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}: "
                             f"{fetch} where the network is up, or {WAYS}") from None
    except errors.RevisionNotFoundError:
        raise ModelLoadError(f"the hub has no revision {revision} of {repo_id}") from None
    except errors.RepositoryNotFoundError:  # also gated and private repos without a token
        raise ModelLoadError(f"the hub has no model {repo_id} (or it is gated or private: log in with "
                             f"`hf auth login`); {WAYS}") from None
    except (errors.HfHubHTTPError, errors.HFValidationError, OSError) as e:
        raise ModelLoadError(f"cannot fetch {repo_id}: {' '.join(str(e).split())}") from None
    return path, snapshot_of(path) or HubModel(repo_id)
