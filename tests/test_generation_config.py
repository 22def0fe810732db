"""The model's sampling defaults from generation_config.json, as vLLM applies them (generation_config="auto"):
requests that leave a field unset take the model's value, through LLM.generate and the server; "vllm" turns
them off; a bad source is refused by name."""

from __future__ import annotations

import json
import shutil

import pytest

from flashdraft import LLM, SamplingParams

GEN = {"temperature": 0.7, "top_k": 20, "top_p": 0.9, "repetition_penalty": 1.3, "max_new_tokens": 9,
       "do_sample": True}
EXPLICIT = dict(temperature=0.7, top_k=20, top_p=0.9, repetition_penalty=1.3, max_tokens=9)
PROMPTS = [[5, 17, 33, 80], list(range(40, 71))]


@pytest.fixture(scope="module")
def model(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gen") / "m"
    shutil.copytree(tiny_llama, folder)
    cfg = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**cfg, **GEN}))
    return folder


def test_llm_takes_the_models_defaults(model):
    llm = LLM(str(model), draft=None, device="cpu", dtype="float32")
    assert llm.get_default_sampling_params() == SamplingParams(**EXPLICIT)
    got = [o.token_ids for o in llm.generate(PROMPTS)]  # (seeds drawn from the engine's seed, in order)
    again = LLM(str(model), draft=None, device="cpu", dtype="float32")
    want = [o.token_ids for o in again.generate(PROMPTS, SamplingParams(**EXPLICIT))]
    assert got == want and all(len(t) == 9 for t in got)
    greedy = [o.token_ids for o in again.generate(PROMPTS, SamplingParams(max_tokens=9))]
    assert greedy != got  # (the defaults change the output)
    off = LLM(str(model), draft=None, device="cpu", dtype="float32", generation_config="vllm")
    assert off.get_default_sampling_params() == SamplingParams()
    with pytest.raises(ValueError, match="generation_config must be auto, vllm or a folder"):
        LLM(str(model), draft=None, device="cpu", dtype="float32", generation_config="nowhere")


def test_server_takes_the_models_defaults(model):
    import openai
    from fixtures import Served

    from flashdraft.config import EngineConfig
    from flashdraft.engine.engine import LLMEngine
    from flashdraft.server.app import build_app

    served = Served(build_app(LLMEngine(EngineConfig(model=str(model), draft=None, device="cpu", dtype="float32"))))
    try:
        client = openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        name = client.models.list().data[0].id
        messages = [{"role": "user", "content": "hello"}]
        unset = client.chat.completions.create(model=name, messages=messages, seed=5)
        explicit = client.chat.completions.create(
            model=name, messages=messages, seed=5, temperature=0.7, top_p=0.9, max_tokens=9,
            extra_body={"top_k": 20, "repetition_penalty": 1.3})
        greedy = client.chat.completions.create(model=name, messages=messages, seed=5, temperature=0, max_tokens=9)
        assert unset.choices[0].message.content == explicit.choices[0].message.content
        assert unset.usage.completion_tokens <= 9
        assert unset.choices[0].message.content != greedy.choices[0].message.content
    finally:
        served.close()
