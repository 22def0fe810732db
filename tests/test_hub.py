"""Hub ids for targets and drafters, offline: a Hugging Face cache laid out as huggingface_hub lays out a
download (blobs named by their etag, snapshot files linking to them, refs holding commits) in a tmp dir,
with HF_HUB_OFFLINE on, so nothing is ever downloaded."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from fixtures import build_random_drafter

from flashdraft import LLM, SamplingParams
from flashdraft.config import EngineConfig, add_engine_args, engine_kwargs
from flashdraft.hub import local_path
from flashdraft.models.loader import resolve_model_dir
from flashdraft.speculative.loader import load_drafter

MAIN, V2 = "a" * 40, "b" * 40  # two commits of one repository


def etag(data: bytes, lfs: bool) -> str:
    """The hub's etag, which names a blob: an LFS file's sha256, a git file's blob sha1."""
    return hashlib.sha256(data).hexdigest() if lfs else hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def cache_repo(cache: Path, repo_id: str, folder: Path, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """Put `folder`'s files into `cache` as snapshot_download leaves a download of `repo_id` at `commit`."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        data = f.read_bytes()
        blob = repo / "blobs" / etag(data, lfs=f.suffix in (".safetensors", ".gguf"))
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty cache at HF_HUB_CACHE, offline. huggingface_hub reads its environment once, at import, so its
    constants are set too."""
    from huggingface_hub import constants

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


@pytest.fixture(scope="module")
def tiny_drafter(tiny_llama, tmp_path_factory) -> Path:
    return build_random_drafter(tmp_path_factory.mktemp("hub-drafter"), tiny_llama, block_size=4, num_layers=1)


def test_the_cache_is_laid_out_as_the_hub_library_reads_it(hub_cache, tiny_llama):
    from huggingface_hub import scan_cache_dir, try_to_load_from_cache

    snapshot = cache_repo(hub_cache, "owner/tiny-llama", tiny_llama, MAIN, refs=("main", "v1"))
    info = scan_cache_dir(hub_cache)
    assert not info.warnings
    (repo,) = info.repos
    (rev,) = repo.revisions
    assert (repo.repo_id, rev.commit_hash, set(rev.refs)) == ("owner/tiny-llama", MAIN, {"main", "v1"})
    assert {f.file_name for f in rev.files} == {p.name for p in tiny_llama.iterdir()}
    assert try_to_load_from_cache("owner/tiny-llama", "config.json") == str(snapshot / "config.json")


def test_hub_ids_generate_as_their_folders(hub_cache, tiny_llama, tiny_drafter):
    """A target and a drafter named by hub id decode the same greedy tokens as the same folders by path."""
    target = cache_repo(hub_cache, "owner/tiny-llama", tiny_llama, MAIN)
    cache_repo(hub_cache, "owner/tiny-drafter", tiny_drafter, V2)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    prompts = ["the quick brown fox", "def add(a, b):"]
    for draft_id, draft_path in ((None, None), ("owner/tiny-drafter", str(tiny_drafter))):
        by_id = LLM("owner/tiny-llama", draft=draft_id, device="cpu", dtype="float32")
        by_path = LLM(str(tiny_llama), draft=draft_path, device="cpu", dtype="float32")
        assert by_id.engine.model_dir == target
        assert (by_id.engine.spec is None) == (draft_id is None)
        assert [o.token_ids for o in by_id.generate(prompts, params)] == \
            [o.token_ids for o in by_path.generate(prompts, params)]


def test_a_revision_pins_a_commit_or_a_ref(hub_cache, tiny_llama, tiny_drafter):
    main = cache_repo(hub_cache, "owner/tiny-llama", tiny_llama, MAIN)
    v2 = cache_repo(hub_cache, "owner/tiny-llama", tiny_llama, V2, refs=("v2",))
    assert resolve_model_dir("owner/tiny-llama") == main
    assert resolve_model_dir("owner/tiny-llama", revision="v2") == v2
    assert resolve_model_dir("owner/tiny-llama", revision=V2) == v2
    assert resolve_model_dir("owner/tiny-llama", revision=MAIN) == main
    assert LLM("owner/tiny-llama", revision="v2", draft=None, device="cpu").engine.model_dir == v2
    # the drafter's revision reaches its loader from the engine config (draft_revision): only v2 is cached
    cache_repo(hub_cache, "owner/tiny-drafter", tiny_drafter, V2, refs=("v2",))
    llm = LLM("owner/tiny-llama", draft="owner/tiny-drafter", draft_revision="v2", device="cpu", dtype="float32")
    assert llm.engine.spec is not None
    with pytest.raises(FileNotFoundError, match="'owner/tiny-drafter' is not in the Hugging Face cache"):
        LLM("owner/tiny-llama", draft="owner/tiny-drafter", device="cpu", dtype="float32")


def test_an_uncached_id_offline_names_the_id_and_offline_mode(hub_cache, tiny_llama):
    with pytest.raises(FileNotFoundError) as e:
        LLM("owner/absent", draft=None, device="cpu")
    assert str(e.value) == (f"model 'owner/absent' is not in the Hugging Face cache ({hub_cache}) and offline mode "
                            "is on (HF_HUB_OFFLINE): download it once online, or pass a local folder")
    assert e.value.__cause__ is None and e.value.__suppress_context__  # no hub traceback behind it
    cache_repo(hub_cache, "owner/tiny-llama", tiny_llama, MAIN)
    with pytest.raises(FileNotFoundError, match="model 'owner/tiny-llama' at revision 'v9' is not in the Hugging"):
        resolve_model_dir("owner/tiny-llama", revision="v9")
    with pytest.raises(FileNotFoundError, match="drafter 'owner/absent-drafter' is not in the Hugging Face cache"):
        load_drafter("owner/absent-drafter", None, None, None)


def test_neither_a_path_nor_an_id_keeps_the_path_error(hub_cache, tiny_llama):
    for ref in ("no/such/folder", "./missing", "missing", "owner/missing.gguf"):
        with pytest.raises(FileNotFoundError, match=f"model path '{ref}' does not exist"):
            resolve_model_dir(ref)
    with pytest.raises(FileNotFoundError, match="drafter path 'no/such/drafter' does not exist"):
        load_drafter("no/such/drafter", None, None, None)
    with pytest.raises(ValueError, match="pins a hub id, but model .* is a local path"):
        resolve_model_dir(str(tiny_llama), revision="main")


def test_what_is_fetched(monkeypatch):
    """What a target's and a drafter's download fetch out of a repository as the hub lists it."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    repo = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
            "special_tokens_map.json", "vocab.json", "merges.txt", "chat_template.jinja",
            "model.safetensors.index.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
            "consolidated.safetensors", "pytorch_model.bin", "flax_model.msgpack", "tf_model.h5", "onnx/model.onnx",
            "original/consolidated.00.pth", "original/tokenizer.model", "model-q4.gguf", "README.md", ".gitattributes",
            "mask_embedding.pt"]
    fetched: list[list[str]] = []

    def snapshot_download(repo_id, revision=None, allow_patterns=None, ignore_patterns=None, **kw):
        fetched.append(sorted(filter_repo_objects(repo, allow_patterns=allow_patterns,
                                                  ignore_patterns=ignore_patterns)))
        return "/snapshot"

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert local_path("owner/model") == Path("/snapshot")
    local_path("owner/model", weights=False)
    local_path("owner/drafter", what="drafter")
    assert local_path("owner/model/model-q4.gguf") == Path("/snapshot/model-q4.gguf")
    weights = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    files = ["chat_template.jinja", "config.json", "generation_config.json", "merges.txt", "special_tokens_map.json",
             "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json"]
    assert fetched == [sorted(files + weights), files, sorted(["config.json", "mask_embedding.pt"] + weights),
                       ["model-q4.gguf"]]


@pytest.mark.parametrize("error, message", [
    ("RepositoryNotFoundError", "model 'owner/private' is neither a local path nor a repository on the Hugging "
                                "Face hub (a private one needs HF_TOKEN or hf auth login)"),
    ("GatedRepoError", "model 'owner/private' is a gated repository on the Hugging Face hub: accept its terms on "
                       "its page, then log in (hf auth login) or set HF_TOKEN"),
    ("RevisionNotFoundError", "model 'owner/private' has no revision 'v3' on the Hugging Face hub"),
])
def test_what_the_hub_refuses_is_named(monkeypatch, error, message):
    import huggingface_hub
    from huggingface_hub import errors

    def snapshot_download(repo_id, **kw):
        raise getattr(errors, error)("404 Client Error", response=SimpleNamespace(headers={}, request=None,
                                                                                   status_code=404))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises((FileNotFoundError, ValueError)) as e:
        resolve_model_dir("owner/private", revision="v3" if error == "RevisionNotFoundError" else None)
    assert str(e.value) == message and e.value.__suppress_context__


def test_revision_flags_reach_the_engine_config():
    import argparse

    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(["--model", "Qwen/Qwen3-8B", "--revision", "v1", "--draft-revision", MAIN]))
    cfg = EngineConfig.from_kwargs(**kw)
    assert (cfg.model, cfg.revision, cfg.draft_revision) == ("Qwen/Qwen3-8B", "v1", MAIN)
    assert engine_kwargs(p.parse_args([]))["revision"] is None
