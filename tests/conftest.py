from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

from fixtures import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3")


@pytest.fixture(scope="module")
def drafter(tiny_llama, tmp_path_factory) -> Path:
    """A random z-lab-format drafter (block 4) for tiny_llama, per module (a module may define its own)."""
    from fixtures import build_random_drafter

    return build_random_drafter(tmp_path_factory.mktemp("draft"), tiny_llama, block_size=4)


@pytest.fixture(scope="module")
def plain(tiny_llama):
    """tiny_llama decoded plainly, float32 on CPU, per module."""
    from flashdraft import LLM

    return LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def spec(tiny_llama, drafter):
    """tiny_llama with `drafter`, float32 on CPU, per module."""
    from flashdraft import LLM

    return LLM(str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded default, plain decoding, float32 on CPU (shared across tests)."""
    from flashdraft import LLM

    return LLM(draft=None, device="cpu", dtype="float32")


@pytest.fixture(autouse=True, scope="session")
def _small_cpu_kv():
    """Every CPU engine in the suite takes 512 MiB of KV pages instead of the 2 GiB default: an engine
    zero-fills its pages, and the suite's engines are many (a collected engine frees them late), so at
    2 GiB each the process outgrew a 24 GB machine. Tests that size the cache say so themselves."""
    from flashdraft.engine import memory

    default, memory.CPU_KV_BYTES = memory.CPU_KV_BYTES, 512 << 20
    yield
    memory.CPU_KV_BYTES = default


@pytest.fixture(autouse=True, scope="session")
def _chain_unless_asked():
    """Engines verify the drafter's chain unless a test asks for token trees (the CPU default is a tree;
    its own tests turn it on). Session-wide: module-scoped engines are built before function fixtures."""
    from flashdraft import settings

    settings.CPU_TREE = False
    # tests drive the verify path on every step: random drafters' tau is ~1, which the default step
    # gate would soon stop drafting for (its own tests turn it on)
    settings.STEP_GATE = False
    yield
    settings.CPU_TREE = True
    settings.STEP_GATE = True


@pytest.fixture(autouse=True, scope="module")
def collect_engines():
    """After each test file, collect its engines: an engine and its speculator refer to each other, so their
    KV pages wait for the cycle collector; the suite's process once reached the machine's 24 GB in test_tree."""
    yield
    gc.collect()
