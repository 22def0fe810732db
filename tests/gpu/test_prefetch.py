"""The L2 weight prefetch of flashdraft/models/prefetch.py: its switch and errors (anywhere), the
kernel over whole, capped and odd-sized weights (Hopper GPUs), and bf16 generation through CUDA
graphs with and without it giving the same tokens (a prefetch moves no data a kernel reads)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from flashdraft.models import prefetch  # noqa: E402

HOPPER = torch.cuda.is_available() and not INTERPRET and torch.cuda.get_device_capability()[0] >= 9


def test_switch_and_errors():
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    lens = torch.tensor([10], dtype=torch.int32)
    with prefetch.prefetch_mode("bogus"), pytest.raises(ValueError, match="FLASHDRAFT_PREFETCH"):
        prefetch.prefetch_l2(w, lens, 4096)
    with prefetch.prefetch_mode("-1"), pytest.raises(ValueError, match="negative"):
        prefetch.prefetch_l2(w, lens, 4096)
    for mode in ("off", "0"):
        with prefetch.prefetch_mode(mode):
            assert prefetch._cap_bytes() is None
    with prefetch.prefetch_mode("auto"):
        assert prefetch._cap_bytes() == prefetch.DEFAULT_CAP_MIB << 20
        assert not prefetch.prefetch_l2(w, lens, 4096)  # CPU tensors never


@pytest.mark.skipif(not HOPPER, reason="bulk L2 prefetch needs a Hopper (sm_90+) GPU")
@pytest.mark.parametrize("shape,mode,launched", [
    ((4096, 4096), "auto", True),  # 32 MiB: whole weight, one contiguous range
    ((4096, 4096), "4", True),  # capped: the first 1 KiB of every row
    ((100, 72), "auto", True),  # 14,400 bytes: one short chunk
    ((3000, 1000), "1", True),  # ragged: 336 of 2,000 bytes per row (1 MiB / 3,000 rows, down to 16)
    ((10, 7), "auto", False),  # 14-byte rows: not 16-byte aligned, skipped
])
def test_kernel_runs(shape, mode, launched):
    w = torch.randn(*shape, device="cuda").to(torch.bfloat16)
    before = w.clone()
    for keys in ([5], [1000, 3000], [100000]):  # the last is over the K/V budget: nothing issued
        lens = torch.tensor(keys, dtype=torch.int32, device="cuda")
        with prefetch.prefetch_mode(mode):
            assert prefetch.prefetch_l2(w, lens, 4096) is launched
        torch.cuda.synchronize()
    assert torch.equal(w, before)


@pytest.mark.skipif(not HOPPER, reason="bulk L2 prefetch needs a Hopper (sm_90+) GPU")
def test_prefetch_changes_no_token(tiny_qwen3, tmp_path, monkeypatch):
    """bf16 DFlash generation through CUDA graphs gives the same tokens with the prefetch as
    without, and the model path does launch it."""
    from fixtures import build_random_drafter

    from flashdraft import LLM, SamplingParams

    draft = str(build_random_drafter(tmp_path / "d", tiny_qwen3, block_size=4))
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 60))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    launches = []
    real = prefetch.prefetch_l2

    def counted(*a, **k):
        launches.append(real(*a, **k))
        return launches[-1]

    monkeypatch.setattr(prefetch, "prefetch_l2", counted)
    out = {}
    for mode in ("off", "auto"):
        launches.clear()
        with prefetch.prefetch_mode(mode):
            llm = LLM(str(tiny_qwen3), draft=draft, device="cuda", dtype="bfloat16")
            out[mode] = [o.token_ids for o in llm.generate(prompts, params)]
        assert any(launches) == (mode == "auto")
        del llm
    assert out["auto"] == out["off"]
