"""Test fixtures built locally: tiny random-weight Llama / Qwen3 folders with a small byte-level
BPE tokenizer, and helpers to run the engine and HF transformers side by side."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "the quick brown fox jumps over the lazy dog", "speculative decoding drafts a block of tokens",
    "def add(a, b):\n    return a + b\n", "Paris is the capital of France.", "1 + 1 = 2, 2 + 2 = 4",
] * 20


def build_tokenizer(folder: Path, vocab_size: int = 320):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def tiny_config(kind: str, vocab_size: int, **overrides):
    from transformers import (
        GptOssConfig,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3_5Config,
        Qwen3_5MoeTextConfig,
        Qwen3_5TextConfig,
        Qwen3Config,
        Qwen3MoeConfig,
        Qwen3NextConfig,
    )

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    if kind == "llama":
        cfg = LlamaConfig(**{**common, "rope_theta": 10000.0,
                             "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                             **overrides})
    elif kind == "qwen3":
        cfg = Qwen3Config(**{**common, "rope_theta": 1000000.0, **overrides})
    elif kind == "qwen2":
        cfg = Qwen2Config(**{**{k: v for k, v in common.items() if k != "head_dim"}, "rope_theta": 1000000.0,
                             **overrides})
    elif kind == "mistral":
        cfg = MistralConfig(**{**common, "rope_theta": 10000.0, **overrides})
    elif kind == "qwen3_moe":
        cfg = Qwen3MoeConfig(**{**common, "rope_theta": 1000000.0, "moe_intermediate_size": 32, "num_experts": 8,
                                "num_experts_per_tok": 2, "norm_topk_prob": True, **overrides})
    elif kind == "gpt_oss":  # alternating sliding / full layers, sinks, biases, yarn rope as published
        cfg = GptOssConfig(**{**common, "intermediate_size": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                              "sliding_window": 6, "rope_parameters": {
                                  "rope_type": "yarn", "rope_theta": 150000.0, "factor": 8.0, "beta_fast": 32.0,
                                  "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
                              **overrides})
    elif kind in ("qwen3_next", "qwen3_5_text"):  # GDN layers, a gated attention layer every 2nd
        hybrid = dict(common, head_dim=32, linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
                      linear_num_key_heads=2, linear_num_value_heads=4, full_attention_interval=2,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
        if kind == "qwen3_next":
            cfg = Qwen3NextConfig(**{**hybrid, "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                                     "decoder_sparse_step": 1, **overrides})
        else:
            cfg = Qwen3_5TextConfig(**{**hybrid, "num_hidden_layers": 4, **overrides})
    elif kind == "qwen3_5_moe_text":  # every layer a MoE with a shared expert, top-k always renormalised
        cfg = Qwen3_5MoeTextConfig(**{**common, "head_dim": 32, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16,
                                      "linear_value_head_dim": 8, "linear_num_key_heads": 2,
                                      "linear_num_value_heads": 4, "full_attention_interval": 2,
                                      "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
                                      "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                                      "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                          "partial_rotary_factor": 0.25}, **overrides})
    elif kind == "qwen3_5":  # the composite config as published: the text model under text_config
        cfg = Qwen3_5Config(text_config=tiny_config("qwen3_5_text", vocab_size, **overrides).to_dict(),
                            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                                               out_hidden_size=64, patch_size=16))
    else:
        raise ValueError(kind)
    cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                          "mistral": "MistralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                          "gpt_oss": "GptOssForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                          "qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
                          "qwen3_5": "Qwen3_5ForConditionalGeneration"}[kind]]
    return cfg


HYBRID_KINDS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_5")


def build_tiny_model(folder: Path, kind: str, seed: int = 0, **overrides) -> Path:
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(folder)
    cfg = tiny_config(kind, overrides.pop("vocab_size", len(tok)), **overrides)
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if kind == "qwen3_5" else AutoModelForCausalLM
    model = auto.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # larger-than-default weights give peaked, tie-free distributions
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # matrices and stacked experts
                p.normal_(0, 0.15)
            elif name.endswith("bias"):  # biases that are not zero, so a dropped one shows
                p.normal_(0, 0.1)
            elif name.endswith("sinks"):  # sinks that take a real share of each softmax
                p.normal_(0, 1.0)
            elif kind in HYBRID_KINDS and name.endswith(("norm.weight", "A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.3)  # zero-centred norms and GDN decays that differ per channel
    model.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "bos_token_id": 1}))
    return folder


def hf_model(folder: Path):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    composite = "text_config" in json.loads((folder / "config.json").read_text())
    auto = AutoModelForImageTextToText if composite else AutoModelForCausalLM
    return auto.from_pretrained(folder, dtype=torch.float32).eval()


def build_random_drafter(folder: Path, target_folder: Path, fmt: str = "z-lab", block_size: int = 4,
                         num_layers: int = 2, target_layer_ids: list[int] | None = None, mask_token_id: int = 3,
                         seed: int = 0, block_in_dflash_config: bool = False, own_head: bool = False,
                         dflash2: dict | None = None, **overrides) -> Path:
    """A random-weight DFlash drafter for the target in `target_folder`, in either published layout;
    dflash2 = {conv_kernel_size, conv_group_size, selector_rank, selector_top_k} makes it a DFlash2."""
    from safetensors.torch import save_file

    target = json.loads((target_folder / "config.json").read_text())
    target = target.get("text_config", target)  # a composite config's language model
    h, vocab = target["hidden_size"], target["vocab_size"]
    ids = target_layer_ids if target_layer_ids is not None else [0, target["num_hidden_layers"] - 2]
    layer = dict(hidden_size=h, intermediate_size=2 * h, num_hidden_layers=num_layers, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False,
                 max_position_embeddings=target.get("max_position_embeddings", 512), vocab_size=vocab,
                 model_type="qwen3")
    layer.update(overrides)
    g = torch.Generator().manual_seed(seed)
    hd, nq, nkv, inter = layer["head_dim"], layer["num_attention_heads"], layer["num_key_value_heads"], \
        layer["intermediate_size"]

    def rnd(*shape, scale=0.15):
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    w = {"fc.weight": rnd(layer["hidden_size"], len(ids) * h), "hidden_norm.weight": 1 + rnd(h, scale=0.1),
         "norm.weight": 1 + rnd(h, scale=0.1)}
    for i in range(num_layers):
        p = f"layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + rnd(h, scale=0.1),
              p + "post_attention_layernorm.weight": 1 + rnd(h, scale=0.1),
              p + "self_attn.q_proj.weight": rnd(nq * hd, h), p + "self_attn.k_proj.weight": rnd(nkv * hd, h),
              p + "self_attn.v_proj.weight": rnd(nkv * hd, h), p + "self_attn.o_proj.weight": rnd(h, nq * hd),
              p + "self_attn.q_norm.weight": 1 + rnd(hd, scale=0.1),
              p + "self_attn.k_norm.weight": 1 + rnd(hd, scale=0.1),
              p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
              p + "mlp.down_proj.weight": rnd(h, inter)}
    if dflash2:
        k, group, rank = dflash2["conv_kernel_size"], dflash2["conv_group_size"], dflash2["selector_rank"]
        for i in range(num_layers):
            for conv in ("attention_conv", "mlp_conv"):
                base = rnd(2, k, h, scale=0.3)
                base[:, 0] += 1
                w[f"layers.{i}.{conv}.base_kernel"] = base
                w[f"layers.{i}.{conv}.kernel_projection.weight"] = rnd(2 * k * (h // group), h)
        w |= {"candidate_selector.predecessor_codebook": rnd(vocab, rank, scale=0.5),
              "candidate_selector.successor_codebook": rnd(vocab, rank, scale=0.5),
              "candidate_selector.hidden_projection.weight": rnd(rank, h)}
    folder.mkdir(parents=True, exist_ok=True)
    if fmt == "z-lab":
        cfg = {**layer, "architectures": ["DFlashDraftModel"], "num_target_layers": target["num_hidden_layers"],
               "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": ids}}
        if block_in_dflash_config:
            cfg["dflash_config"]["block_size"] = block_size
        else:
            cfg["block_size"] = block_size
        if dflash2:
            cfg["architectures"] = ["DFlash2DraftModel"]
            cfg["dflash_config"].update(dflash2)
    elif fmt == "speculators":
        cfg = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash",
               "transformer_layer_config": layer, "draft_vocab_size": vocab, "block_size": block_size,
               "target_hidden_size": h, "aux_hidden_state_layer_ids": [i + 1 for i in ids],
               "mask_token_id": mask_token_id}
        if dflash2:
            cfg |= {"speculators_model_type": "dflash2", **dflash2}
        if own_head:
            emb = target_state(target_folder)
            w["embed_tokens.weight"] = emb["model.embed_tokens.weight"]
            w["lm_head.weight"] = emb.get("lm_head.weight", emb["model.embed_tokens.weight"])
    else:
        raise ValueError(fmt)
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(folder / "model.safetensors"))
    return folder


def target_state(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(next(folder.glob("*.safetensors"))))


class Served:
    """A uvicorn server for `app` on a free loopback port, in a background thread."""

    def __init__(self, app):
        import socket
        import threading
        import time

        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def record_fed_drafts(monkeypatch) -> list:
    """Patch the acceptance of every DFlash step (and the post graph of greedy whole steps, which accepts
    on the device) to record, at every step, the drafts each verifying request fed the target (the
    verify input rows after its first); returns the list it appends to."""
    import flashdraft.speculative.ahead as ahead
    import flashdraft.speculative.dflash as dflash
    from flashdraft.speculative.graphs import StepGraphs

    fed: list = []
    real_accept, real_post = dflash.accept_plans, StepGraphs.run_post

    def accept(plans, ids, toks):
        fed.append([ids[p.row + 1: p.row + p.n].tolist() for p in plans if p.verify])
        return real_accept(plans, ids, toks)

    def post(self, g):
        rows, ids = g.buffers.rows, g.buffers.ids.tolist()
        fed.append([ids[i * rows + 1: (i + 1) * rows] for i in range(int((g.meta.seq_lens > 0).sum()))])
        return real_post(self, g)

    for module in (dflash, ahead):
        monkeypatch.setattr(module, "accept_plans", accept)
    monkeypatch.setattr(StepGraphs, "run_post", post)
    return fed


def step_gated(llm, break_even: float):
    """The step gate at a given break-even tau, its step costs (as if measured at start) far above
    what a CPU step is observed to take, so that they decide alone."""
    from flashdraft.speculative.costs import StepCosts
    from flashdraft.speculative.gate import StepGate

    policy = llm.engine.spec.policy
    policy.costs, policy.step_gate = StepCosts((64,), (1e6,), (break_even * 1e6,)), StepGate()
    policy.seen.max_tries = 0  # no steps without drafts run to time their pace
    return llm


class poison_rejected:
    """From its call on (or inside `with poison_rejected(llm):`, undone at its end), make any read of
    K/V that a rejected draft or a draft block left behind show: after every draft block the
    drafter's scratch slots, and before a request's pages are cut back to its committed length every
    slot past it (target and drafter caches), are filled with NaN. Every step then runs eagerly and
    one at a time (graphs and steps in flight off), where these hooks see its slots."""

    def __init__(self, llm):
        import torch

        from flashdraft.speculative.kv_slots import poison_slots, position_slots

        self.llm = llm
        eng = llm.engine
        sp, bm, runner = eng.spec, eng.block_manager, eng.runner
        caches = (runner.k_cache, runner.v_cache, sp.context.k_cache, sp.context.v_cache)
        eager, truncate = sp.drafts.eager, bm.truncate

        def drafted(seqs, manager):
            out = eager(seqs, manager)
            poison_slots(caches[2:], out[3])  # the block's scratch K/V must never be read again
            return out

        def cut(seq_id, num_tokens):
            sp.context.flush()
            slots = position_slots(bm, seq_id, range(num_tokens, len(bm.table(seq_id)) * bm.block_size))
            if slots:
                poison_slots(caches, torch.tensor(slots, device=runner.device))
            truncate(seq_id, num_tokens)

        self.saved = runner.use_graphs, eng.ctx.async_scheduling
        runner.use_graphs = False
        eng.ctx.async_scheduling = False
        sp.drafts.eager, bm.truncate = drafted, cut

    def undo(self) -> None:
        eng = self.llm.engine
        del eng.spec.drafts.eager, eng.block_manager.truncate
        eng.runner.use_graphs, eng.ctx.async_scheduling = self.saved

    def __enter__(self):
        return self.llm

    def __exit__(self, *exc) -> None:
        self.undo()


class StepClock:
    """A clock for the draft policy that advances only as the engine computes: each target forward
    costs `step` ms plus `row` ms a row, each drafter forward `draft` plus `draft_row` a row. What a
    step costs with and without drafts is then the test's to say, whatever the machine's load."""

    def __init__(self, llm, step: float = 1.0, row: float = 0.25, draft: float = 0.5, draft_row: float = 0.05):
        self.ms = 0.0
        spec = llm.engine.spec
        for net, base, per in ((llm.engine.runner.model, step, row), (spec.drafter, draft, draft_row)):
            net.forward = self._costing(net.forward, base, per)
        spec.policy.clock = self

    def _costing(self, forward, base: float, per: float):
        def timed(x, *args, **kwargs):
            self.ms += base + per * x.shape[0]
            return forward(x, *args, **kwargs)

        return timed

    def __call__(self) -> float:
        return self.ms / 1e3


def wait_until(done, guard_s: float, what: str = "a condition", every_s: float = 0.01) -> None:
    """Poll `done()` until it is true; a hang guard of guard_s seconds (no assertion on how long it took)."""
    import time

    deadline = time.monotonic() + guard_s
    while not done():
        assert time.monotonic() < deadline, f"hang guard expired waiting for {what}"
        time.sleep(every_s)


def engine_logits(llm, ids: list[int], prefill: int) -> torch.Tensor:
    """Logits at every position: one prefill forward over ids[:prefill], then one token a step."""
    import random

    from flashdraft import SamplingParams
    from flashdraft.engine.sequence import Sequence

    eng = llm.engine
    random.Random(0).shuffle(eng.block_manager.free_blocks)  # pages out of order on purpose
    seq = Sequence(ids[:prefill], SamplingParams())
    chunks = [ids[:prefill]] + [[t] for t in ids[prefill:]]
    rows = []
    for chunk in chunks:
        eng.block_manager.allocate(seq.seq_id, seq.num_computed_tokens + len(chunk))
        hidden, _, _ = eng.runner.forward([seq], [chunk], eng.block_manager)
        rows.append(eng.runner.model.compute_logits(hidden))
        seq.num_computed_tokens += len(chunk)
    eng.block_manager.free(seq.seq_id)
    return torch.cat(rows)
