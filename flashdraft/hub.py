"""A model reference turned into a local path: an existing folder or file is used as is; an `owner/name`
Hugging Face hub id (or `owner/name/file.gguf`) is found in the hub cache or downloaded into it by
huggingface_hub, which honours HF_HUB_OFFLINE, HF_TOKEN (or the stored login), HF_HOME and HF_HUB_CACHE."""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("flashdraft")

# what models/loader.py reads from a target folder; not .bin/.pth/.h5/.onnx/.msgpack/.gguf copies of the weights
TARGET_FILES = ["config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "*.jinja", "chat_template.json"]
# what speculative/loader.py reads; mask_embedding.pt is fetched so that the loader can refuse it by name
DRAFTER_FILES = ["config.json", "mask_embedding.pt"]
WEIGHT_FILES = ["*.safetensors", "*.safetensors.index.json"]
# the loaders read top-level files only; consolidated.safetensors is Mistral's second copy of the same weights
IGNORED = ["*/*", "consolidated*.safetensors"]


def is_repo_id(ref: str) -> bool:
    """`owner/name` as the hub spells repository ids (a bare `name` is read as a local path)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if ref.count("/") != 1 or ref.endswith(".gguf"):
        return False
    try:
        validate_repo_id(ref)
    except HFValidationError:
        return False
    return True


def local_path(ref: str | os.PathLike, revision: str | None = None, what: str = "model",
               weights: bool = True) -> Path:
    """The local folder (or .gguf file) for `ref`. what: "model" (a target) or "drafter", which decides the
    files fetched; weights=False fetches no weights (load_format="dummy"). revision: a branch, tag or commit
    of a hub id (default: main)."""
    path = Path(ref).expanduser()
    if path.exists():
        if revision is not None:
            raise ValueError(f"a revision ({revision!r}) pins a hub id, but {what} {str(ref)!r} is a local path")
        return path
    text = str(ref)
    parts = text.split("/")
    gguf = text.endswith(".gguf") and len(parts) > 2 and is_repo_id("/".join(parts[:2]))
    if gguf:  # owner/name/file.gguf: that file alone
        repo_id, files = "/".join(parts[:2]), ["/".join(parts[2:])]
    elif is_repo_id(text):
        repo_id = text
        files = (TARGET_FILES if what == "model" else DRAFTER_FILES) + (WEIGHT_FILES if weights else [])
    else:
        raise FileNotFoundError(f"{what} path {text!r} does not exist")
    folder = _snapshot(repo_id, revision, files, what, ignored=[] if gguf else IGNORED)
    return folder / files[0] if gguf else folder


def _snapshot(repo_id: str, revision: str | None, files: list[str], what: str, ignored: list[str]) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f" at revision {revision!r}" if revision else ""
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=files, ignore_patterns=ignored,
                                   library_name="flashdraft")
    # `from None`: the hub's own traceback (HTTP request, retries) says nothing the message does not
    except GatedRepoError:
        raise ValueError(f"{what} {repo_id!r} is a gated repository on the Hugging Face hub: accept its terms "
                              "on its page, then log in (hf auth login) or set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise FileNotFoundError(f"{what} {repo_id!r} is neither a local path nor a repository on the Hugging Face "
                                "hub (a private one needs HF_TOKEN or hf auth login)") from None
    except RevisionNotFoundError:
        raise FileNotFoundError(f"{what} {repo_id!r} has no revision {revision!r} on the Hugging Face hub") from None
    except LocalEntryNotFoundError as e:
        if constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(f"{what} {repo_id!r}{at} is not in the Hugging Face cache "
                                    f"({constants.HF_HUB_CACHE}) and offline mode is on (HF_HUB_OFFLINE): "
                                    "download it once online, or pass a local folder") from None
        raise FileNotFoundError(f"{what} {repo_id!r}{at} is not in the Hugging Face cache and the hub could not "
                                f"be reached: {str(e).splitlines()[0]}") from None
    except HfHubHTTPError as e:
        raise ValueError(f"cannot fetch {what} {repo_id!r}{at} from the Hugging Face hub: "
                         f"{str(e).splitlines()[0]}") from None
    log.info("%s %s%s: %s", what, repo_id, at, folder)
    return Path(folder)
