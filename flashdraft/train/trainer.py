"""`flashdraft train-drafter`: self-distillation data from the target, then the DFlash recipe;
writes a z-lab-format checkpoint (config.json + model.safetensors) that flashdraft loads and
that follows the published layout (unpacked q/k/v and gate/up, no embed_tokens, no lm_head)."""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.nn.attention import sdpa_kernel
from tqdm import tqdm

from flashdraft.models.dflash_draft import DFlashDraftModel
from flashdraft.models.loader import load_config, load_weights, resolve_model_dir
from flashdraft.spec.formats import DraftSpec, default_target_layer_ids
from flashdraft.train.loss import LABELS, TRAIN_SDPA, dflash_loss, gamma_for, sample_anchors


@dataclass
class TrainConfig:
    model: str | None = None
    out: str = "drafter"
    data: str | None = None  # jsonl of {"prompt_ids", "response_ids"}; generated when missing
    prompts: str | None = None  # comma-separated: jsonl files of prompts/messages, "sharegpt", "python"
    num_prompts: int | None = None
    prompt_turns: str = "first"  # ShareGPT prompts: "first" human turns, or "all" human turns with history
    samples_per_prompt: int = 1  # responses per prompt; more than 1 needs gen_temperature > 0
    gen_temperature: float = 0.0
    sampled_prefix: int = 0  # > 0: sample the first 0..N tokens at gen_temperature, then greedy (see data.py)
    max_new_tokens: int = 256
    max_prompt_tokens: int = 512
    trim_loops: int | None = None  # cut each response this many tokens into the loop it ends in (data.trim_loop)
    num_layers: int = 3
    intermediate_size: int | None = None
    block_size: int | None = None  # None: 16 for a new drafter, the saved one's with init_drafter (a number
    # there changes it: the weights do not depend on the block size)
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    epochs: int = 6
    max_steps: int | None = None
    batch_size: int = 8
    num_anchors: int = 512
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    device: str | None = None
    dtype: str = "bfloat16"
    save_every: int = 200
    keep_every: int | None = None  # also keep the drafter of every N-th step in out/steps/<step> (a learning curve)
    time_budget_s: float | None = None  # shorten the schedule to fit (rate measured at steps 10-30, 100-300)
    resume: bool = False
    gen_batch: int = 256
    precondition_taps: bool = True  # train on taps / RMS, fold the scale into the saved fc
    init_layers_from: int | None = None  # start the drafter layers from target layers N, N+1, ...
    init_drafter: str | None = None  # continue from a saved drafter folder (its shape and taps; a new schedule)
    add_layers: int = 0  # with init_drafter: layers appended after the saved ones (their outputs start at zero)
    local_context: int | None = None  # curriculum: blocks see only this many context positions ...
    local_context_frac: float = 0.1  # ... for this fraction of the steps
    labels: str = "data"  # slot targets: "data" tokens, the target's "argmax", or "kl" to its distribution
    walk_floor: float | None = None  # weight of the blocks off the walk a greedy verify takes (loss.walk_anchors)
    stop_after_s: float | None = None  # save and return once this many seconds have passed since train() began
    # (setup and data generation count), at a log step; --resume goes on
    log: list = field(default_factory=list, repr=False)


def _mask_token(tokenizer, explicit: int | None) -> int:
    if explicit is not None:
        return explicit
    if getattr(tokenizer, "mask_token_id", None) is not None:
        return tokenizer.mask_token_id
    raise ValueError("the tokenizer has no mask token: pass --mask-token-id (an id that never occurs in text)")


def drafter_spec(target_cfg, cfg: TrainConfig, mask_token_id: int) -> DraftSpec:
    n_taps = len(cfg.target_layer_ids) if cfg.target_layer_ids else max(cfg.num_layers, 2)
    ids = cfg.target_layer_ids or default_target_layer_ids(target_cfg.num_hidden_layers, n_taps)
    layer = SimpleNamespace(
        hidden_size=target_cfg.hidden_size, intermediate_size=cfg.intermediate_size or target_cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=target_cfg.num_attention_heads,
        num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=getattr(target_cfg, "head_dim", None) or target_cfg.hidden_size // target_cfg.num_attention_heads,
        rms_norm_eps=target_cfg.rms_norm_eps, attention_bias=False, rope_theta=_rope_theta(target_cfg),
        rope_scaling=None, rope_parameters=None, max_position_embeddings=target_cfg.max_position_embeddings,
        vocab_size=target_cfg.vocab_size, model_type="qwen3")
    return DraftSpec(layer, cfg.block_size or 16, mask_token_id, list(ids), None, "z-lab")


def _wider_taps(saved: list[int], wanted: list[int], n_target: int) -> list[int]:
    """The tap list a continued drafter may take: every saved tap kept, new ones added (any order)."""
    wanted = [int(i) for i in wanted]
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"target_layer_ids {wanted} repeats a layer")
    if not set(saved) <= set(wanted):
        raise ValueError(f"target_layer_ids {wanted} drop tap(s) {sorted(set(saved) - set(wanted))} of the saved "
                         f"drafter (taps {saved}); a continued drafter can add taps, not lose them")
    bad = [i for i in wanted if not 0 <= i < n_target]
    if bad:
        raise ValueError(f"target_layer_ids {bad} outside the target's {n_target} layers")
    return wanted


def widen_fc(w: torch.Tensor, saved: list[int], wanted: list[int]) -> torch.Tensor:
    """fc.weight [H, len(saved) * H] as fc over the taps `wanted` (a superset): each saved tap's columns
    move to its place in the new order, the added taps' columns are zero, so fc(taps) is unchanged."""
    if list(saved) == list(wanted):
        return w
    h = w.shape[1] // len(saved)
    out = w.new_zeros(w.shape[0], h * len(wanted))
    for j, layer in enumerate(saved):
        k = wanted.index(layer)
        out[:, k * h:(k + 1) * h] = w[:, j * h:(j + 1) * h]
    return out


def _grown_spec(spec: DraftSpec, add_layers: int, inter: int | None) -> DraftSpec:
    """The spec of a saved drafter given `add_layers` more layers and MLPs narrowed to `inter` channels."""
    c = spec.layer_config
    if add_layers < 0:
        raise ValueError(f"add_layers must be 0 or more, not {add_layers}")
    if inter is not None and not 0 < inter <= c.intermediate_size:
        raise ValueError(f"intermediate_size {inter}: a continued drafter can narrow its MLPs (the saved "
                         f"drafter's is {c.intermediate_size}), not widen them")
    if not add_layers and inter in (None, c.intermediate_size):
        return spec
    layer = SimpleNamespace(**vars(c))
    layer.num_hidden_layers = c.num_hidden_layers + add_layers
    layer.intermediate_size = inter or c.intermediate_size
    return replace(spec, layer_config=layer)


def grow_layers(state: dict[str, torch.Tensor], n_saved: int, add_layers: int, inter: int | None,
                energy: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A saved drafter's weights (DFlashDraftModel names) for a deeper and/or narrower drafter.
    inter: each layer's MLP keeps the `inter` channels with the largest sqrt(energy[i, j]) * |down_j|,
    energy from `mlp_channel_energy` (what each channel puts into the layer's output on real text), or
    without it |gate_j| * |up_j| * |down_j| (row / column norms, blind to which inputs the layer meets);
    the others are dropped, which changes the drafts a little, and training has to win that back.
    add_layers: copies of the last layer appended with o_proj and down_proj at zero, so each adds nothing
    to the residual stream (same drafts) until training moves them."""
    state = dict(state)
    for i in range(n_saved):
        key = f"layers.{i}.mlp."
        gate, up = state[key + "gate_up_proj.weight"].chunk(2)
        down = state[key + "down_proj.weight"]
        if inter is None or inter == gate.shape[0]:
            continue
        if energy is not None:
            score = energy[i].to(down.device).sqrt() * down.float().norm(dim=0)
        else:
            score = gate.float().norm(dim=1) * up.float().norm(dim=1) * down.float().norm(dim=0)
        keep = score.topk(inter).indices.sort().values
        state[key + "gate_up_proj.weight"] = torch.cat([gate[keep], up[keep]])
        state[key + "down_proj.weight"] = down[:, keep].contiguous()
    last = f"layers.{n_saved - 1}."
    for j in range(n_saved, n_saved + add_layers):
        for name in [k for k in state if k.startswith(last)]:
            t = state[name].clone()
            if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                t.zero_()
            state[f"layers.{j}." + name[len(last):]] = t
    return state


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)


def init_drafter(spec: DraftSpec, device, seed: int) -> DFlashDraftModel:
    torch.manual_seed(seed)
    model = DFlashDraftModel(spec).to(device)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)  # RMSNorm weights
    return model


@torch.no_grad()
def hidden_states(model, ids: torch.Tensor, idx: list[int], **kwargs) -> tuple[object, list[torch.Tensor]]:
    """A transformers forward of `model` (a causal LM or its base model) and its hidden states at HF
    indices `idx` (l + 1 for the output of layer l), every one taken before the final norm, as the
    engine taps them: transformers' last hidden state is the final norm's output (SmolLM2: RMS 1.8
    against 36 before it), so a drafter trained on it would read other features when serving."""
    raw = {}
    hook = model.base_model.norm.register_forward_pre_hook(lambda module, args: raw.setdefault("x", args[0]))
    try:
        out = model(ids, output_hidden_states=True, **kwargs)
    finally:
        hook.remove()
    last = len(out.hidden_states) - 1
    return out, [raw["x"] if i == last else out.hidden_states[i] for i in idx]


@torch.no_grad()
def tap_scale(target, samples, tap_idx: list[int], device, max_samples: int = 64) -> torch.Tensor:
    """1 / RMS of every tap dimension over real tokens (position 0, the attention sink, left out).
    Targets carry a few "massive" dimensions (SmolLM2: RMS ~500 against a median of ~13, and
    ~25,000 at the sink); fed raw, they dominate fc's random start and Adam's equal-sized steps
    move the outputs of those columns 40x more than the rest. Training sees taps * scale; the
    saved fc is fc * scale, so the checkpoint takes raw taps like every other z-lab drafter."""
    acc, count = None, 0
    for ids, _ in samples[:max_samples]:
        _, hs = hidden_states(target, torch.tensor([ids], device=device), tap_idx)
        taps = torch.cat([h[0, 1:] for h in hs], -1).float()
        acc = taps.pow(2).sum(0) if acc is None else acc + taps.pow(2).sum(0)
        count += taps.shape[0]
    return (acc / max(count, 1)).sqrt().clamp_min(1e-3).reciprocal()


@torch.no_grad()
def mlp_channel_energy(drafter: DFlashDraftModel, target, embed: torch.Tensor, samples, device, dtype,
                       max_samples: int = 16, max_response: int = 256) -> torch.Tensor:
    """[layers, inter]: each MLP channel's summed squared activation (the input of its down_proj) over
    the blocks anchored at the first `max_response` response positions of the first `max_samples`
    training answers, run as training runs the drafter: which channels carry the text a drafter
    meets. A channel can have large weights and still see no input along them; weight norms alone
    cannot tell (on SmolLM2, run 18 narrowed from 1,536 to 1,512 channels by weight norms fell from
    2.22 to 2.11 on 12 MT-Bench prompts on CPU, by this energy to 2.21)."""
    from flashdraft.train.loss import block_attention_mask, draft_hidden

    spec, block = drafter.spec, drafter.spec.block_size
    energy = torch.zeros(len(drafter.layers), drafter.layers[0].mlp.down_proj.in_features, device=device)

    def record(i: int):
        return lambda module, args: energy[i].add_(args[0].float().pow(2).flatten(0, -2).sum(0))

    hooks = [layer.mlp.down_proj.register_forward_pre_hook(record(i)) for i, layer in enumerate(drafter.layers)]
    try:
        for full, plen in samples[:max_samples]:
            ids = torch.tensor([full[: plen + max_response]], device=device)
            anchors = torch.arange(plen, ids.shape[1] - 1)[None]
            if not anchors.numel():
                continue
            taps, _ = target_features(target, ids, torch.tensor([ids.shape[1]], device=device),
                                      [i + 1 for i in spec.target_layer_ids], None, False)
            blocks = torch.full((1, anchors.shape[1], block), spec.mask_token_id, device=device)
            blocks[:, :, 0] = ids[0, anchors[0].to(device)]
            mask = block_attention_mask(anchors.to(device), torch.ones(anchors.shape, dtype=torch.bool, device=device),
                                        ids.shape[1], block)
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                draft_hidden(drafter, taps, torch.nn.functional.embedding(blocks.flatten(1), embed), anchors, mask)
    finally:
        for h in hooks:
            h.remove()
    return energy


def init_from_target(drafter: DFlashDraftModel, weights: dict[str, torch.Tensor], first_layer: int) -> None:
    """Start the drafter's layers from target layers first_layer.. (same shapes; q/k norms stay 1)."""
    with torch.no_grad():
        for j, layer in enumerate(drafter.layers):
            src = f"model.layers.{first_layer + j}."
            a, mlp = layer.self_attn, layer.mlp
            a.qkv_proj.weight.copy_(torch.cat([weights[src + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
            a.o_proj.weight.copy_(weights[src + "self_attn.o_proj.weight"])
            mlp.gate_up_proj.weight.copy_(torch.cat([weights[src + "mlp.gate_proj.weight"],
                                                     weights[src + "mlp.up_proj.weight"]]))
            mlp.down_proj.weight.copy_(weights[src + "mlp.down_proj.weight"])
            layer.input_layernorm.weight.copy_(weights[src + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(weights[src + "post_attention_layernorm.weight"])


def save_checkpoint(model: DFlashDraftModel, target_cfg, out: Path, dtype=torch.bfloat16,
                    fc_scale: torch.Tensor | None = None) -> None:
    """z-lab layout: unpacked projections, a Qwen3 config with the DFlash keys. fc_scale (the
    training-time tap preconditioner) is folded into fc's input columns."""
    spec, c = model.spec, model.spec.layer_config
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "d2t":
            continue
        if name == "fc.weight" and fc_scale is not None:
            t = t.float() * fc_scale.to(t.device)[None, :]
        t = t.detach().to("cpu", dtype)
        if ".qkv_proj." in name:
            a = model.layers[0].self_attn
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), t.split([a.q_size, a.kv_size, a.kv_size])):
                tensors[name.replace("qkv_proj", part)] = chunk.contiguous()
        elif ".gate_up_proj." in name:
            for part, chunk in zip(("gate_proj", "up_proj"), t.chunk(2)):
                tensors[name.replace("gate_up_proj", part)] = chunk.contiguous()
        else:
            tensors[name] = t.contiguous()
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": spec.block_size,
        "num_target_layers": target_cfg.num_hidden_layers,
        "dflash_config": {"mask_token_id": spec.mask_token_id, "target_layer_ids": spec.target_layer_ids,
                          "block_size": spec.block_size},
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": "silu",
        "attention_bias": False, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta, "rope_scaling": None,
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
        "tie_word_embeddings": False, "layer_types": ["full_attention"] * c.num_hidden_layers,
        "use_sliding_window": False, "sliding_window": None, "dtype": str(dtype).removeprefix("torch."),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def _batches(samples, batch_size: int, rng: random.Random):
    order = list(range(len(samples)))
    rng.shuffle(order)
    # similar lengths together keeps padding low
    order = sorted(order, key=lambda i: len(samples[i][0]) // 64 + rng.random())
    groups = [order[i: i + batch_size] for i in range(0, len(order), batch_size)]
    rng.shuffle(groups)
    return groups


def _init_distributed(cfg: TrainConfig) -> tuple[int, int, torch.device]:
    """Data parallel when started by torchrun (WORLD_SIZE > 1): one process per GPU (cuda:LOCAL_RANK),
    NCCL on CUDA and gloo on CPU. -> (rank, world size, device)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if world == 1:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():  # data generation can take hours before the first collective
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(hours=4))
    return dist.get_rank(), world, device


def _average(tensors: list[torch.Tensor], world: int) -> None:
    """All-reduce and average in place (gradients, logged scalars) in one flat message."""
    if world == 1:
        return
    flat = torch.cat([t.reshape(-1).float() for t in tensors])
    dist.all_reduce(flat)
    flat /= world
    for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(part.view_as(t))


def _check_in_sync(params: list[torch.Tensor], world: int) -> None:
    """Every rank must hold the same weights; a missed gradient reduction shows up here."""
    if world == 1:
        return
    with torch.no_grad():
        mine = torch.stack([p.double().sum() for p in params])
        everyone = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(everyone, mine)
    if any(not torch.allclose(e, everyone[0], rtol=1e-6, atol=1e-6) for e in everyone):
        raise RuntimeError("data-parallel ranks hold different drafter weights")


LOG_EVERY = 10  # steps between reads of the logged numbers from the GPU; the rate marks (10, 30, 100, 300) fall on them


def make_batch(seqs: list[tuple[list[int], int]], num_anchors: int, gen: torch.Generator, device
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """[(prompt + response ids, prompt length)] -> ids [b, S] (right-padded), lengths [b], anchors
    and valid [b, N] (sample_anchors among the response tokens); all on device but the anchors, which
    stay on the CPU for dflash_loss to plan its attention groups from without waiting for the GPU."""
    s_max = max(len(s) for s, _ in seqs)
    ids = torch.zeros(len(seqs), s_max, dtype=torch.long)
    loss_mask = torch.zeros(len(seqs), s_max, dtype=torch.bool)
    for r, (s, p) in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
        loss_mask[r, p: len(s)] = True
    lengths = torch.tensor([len(s) for s, _ in seqs])
    anchors, valid = sample_anchors(loss_mask, lengths, num_anchors, gen)
    return (ids.to(device, non_blocking=True), lengths.to(device, non_blocking=True), anchors,
            valid.to(device, non_blocking=True))


@torch.no_grad()
def target_features(target, ids: torch.Tensor, lengths: torch.Tensor, tap_idx: list[int],
                    scale: torch.Tensor | None, want_logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The frozen target over ids: taps [b, S, n*H] (`hidden_states`, times the preconditioner
    scale) and, when asked, its logits [b, S, vocab] (otherwise the head is not run). Its attention
    takes the drafter's kernel list: cuDNN would plan a graph on the host for every new length. The
    causal + padding mask is built here, additive [b, 1, S, S]: given a padding mask, transformers
    first asks the GPU whether it could skip the mask, a wait for the GPU in every step."""
    pos = torch.arange(ids.shape[1], device=ids.device)
    keep = (pos[None, :] <= pos[:, None])[None, None] & (pos < lengths[:, None])[:, None, None, :]
    dtype = target.get_input_embeddings().weight.dtype
    mask = torch.zeros(keep.shape, dtype=dtype, device=ids.device).masked_fill_(~keep, torch.finfo(dtype).min)
    with sdpa_kernel(TRAIN_SDPA):
        out, hs = hidden_states(target if want_logits else target.base_model, ids, tap_idx, attention_mask=mask)
    taps = torch.cat(hs, -1)
    if scale is not None:
        taps = (taps.float() * scale).to(taps.dtype)
    return taps, out.logits if want_logits else None


def train(cfg: TrainConfig) -> Path:
    t_called = time.time()  # --stop-after bounds the whole command, setup (imports too) included
    from transformers import AutoModelForCausalLM

    from flashdraft.train.data import read_samples

    if cfg.labels not in LABELS:
        raise ValueError(f"unknown labels {cfg.labels!r}; use one of {', '.join(LABELS)}")
    if cfg.add_layers and not cfg.init_drafter:
        raise ValueError("add_layers grows a saved drafter: pass init_drafter too (a new drafter takes num_layers)")
    if cfg.sampled_prefix < 0 or (cfg.sampled_prefix and not cfg.gen_temperature):
        raise ValueError(f"sampled_prefix {cfg.sampled_prefix}: needs 0, or N > 0 with gen_temperature above 0 "
                         "to sample the prefix with")
    if cfg.trim_loops is not None and cfg.trim_loops < 0:
        raise ValueError(f"trim_loops must be 0 or more tokens, not {cfg.trim_loops}")
    if cfg.walk_floor is not None and not 0 <= cfg.walk_floor <= 1:
        raise ValueError(f"walk_floor must lie in [0, 1], not {cfg.walk_floor}")
    if cfg.keep_every is not None and cfg.keep_every < 1:
        raise ValueError(f"keep_every must be a positive number of steps, not {cfg.keep_every}")
    if cfg.block_size is not None and cfg.block_size < 2:
        raise ValueError(f"block_size {cfg.block_size}: a block holds the last token and at least one draft "
                         "(2 or more)")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    rank, world, device = _init_distributed(cfg)
    main = rank == 0
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[cfg.dtype]
    folder = resolve_model_dir(cfg.model)
    target_cfg = load_config(folder)
    from flashdraft.models.loader import load_tokenizer

    start = None
    if cfg.init_drafter:  # the saved drafter decides the shape (block size, layers, taps, mask token); taps,
        # add_layers and intermediate_size can grow it
        from flashdraft.spec.dflash import load_drafter

        if cfg.init_layers_from is not None:
            raise ValueError("pass either init_drafter or init_layers_from, not both")
        start = load_drafter(cfg.init_drafter, target_cfg, device, torch.float32)
        spec = start.spec
        saved_taps = list(spec.target_layer_ids)
        if cfg.target_layer_ids and list(cfg.target_layer_ids) != saved_taps:  # more taps: fc widens (new ones at 0)
            spec = replace(spec, target_layer_ids=_wider_taps(saved_taps, cfg.target_layer_ids,
                                                              target_cfg.num_hidden_layers))
        n_saved = spec.layer_config.num_hidden_layers
        spec = _grown_spec(spec, cfg.add_layers, cfg.intermediate_size)  # deeper / narrower
        if cfg.block_size is not None:  # a longer (or shorter) block: same weights, more mask slots
            spec = replace(spec, block_size=cfg.block_size)
        cfg.block_size, cfg.num_layers = spec.block_size, spec.layer_config.num_hidden_layers
        cfg.target_layer_ids, cfg.mask_token_id = list(spec.target_layer_ids), spec.mask_token_id
        cfg.intermediate_size = spec.layer_config.intermediate_size
        mask_id = spec.mask_token_id
    else:
        mask_id = _mask_token(load_tokenizer(folder), cfg.mask_token_id)
        spec = drafter_spec(target_cfg, cfg, mask_id)
        cfg.block_size = spec.block_size
    # the shape is settled (and a bad option refused) above, before any data is generated
    data_path = Path(cfg.data) if cfg.data else out / "data.jsonl"
    if not data_path.exists():
        make_data(cfg, data_path, device, rank, world)
    samples = read_samples(data_path, cfg.trim_loops)
    if math.ceil(len(samples) / cfg.batch_size) < world:
        raise ValueError(f"{len(samples)} samples make {math.ceil(len(samples) / cfg.batch_size)} batches of "
                         f"{cfg.batch_size}; {world} data-parallel processes need at least one batch each")
    # the frozen target: HF transformers, taps = the outputs of the tapped layers (`hidden_states`)
    target = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval().requires_grad_(False)
    weights = load_weights(folder)
    embed = weights["model.embed_tokens.weight"].to(device, dtype)
    lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"]).to(device, dtype)
    drafter = init_drafter(spec, device, cfg.seed)
    with torch.no_grad():  # drafter output feeds the target's lm_head: start at the target's final-norm scale
        drafter.norm.weight.copy_(weights["model.norm.weight"])
    if cfg.init_layers_from is not None:
        if cfg.init_layers_from + cfg.num_layers > target_cfg.num_hidden_layers:
            raise ValueError(f"init_layers_from {cfg.init_layers_from} + {cfg.num_layers} layers exceeds the target's "
                             f"{target_cfg.num_hidden_layers}")
        init_from_target(drafter, weights, cfg.init_layers_from)
    if start is not None:
        energy = None
        if cfg.intermediate_size != start.spec.layer_config.intermediate_size:  # narrower: measure what to keep
            if main:
                start.setup(max(len(s[0]) for s in samples[:16]) + start.spec.block_size + 1)
                start.rope.cos, start.rope.sin = start.rope.cos.float(), start.rope.sin.float()
                energy = mlp_channel_energy(start, target, embed, samples, device, dtype)
            else:
                energy = torch.empty(n_saved, start.spec.layer_config.intermediate_size, device=device)
            if world > 1:  # every rank keeps rank 0's channels
                dist.broadcast(energy, 0)
        state = start.state_dict()
        state["fc.weight"] = widen_fc(state["fc.weight"], saved_taps, spec.target_layer_ids)
        state = grow_layers(state, n_saved, cfg.add_layers, cfg.intermediate_size, energy)
        drafter.load_state_dict(state)
        del start, state
    max_len = max(len(s[0]) for s in samples) + cfg.block_size + 1
    drafter.setup(max_len)
    drafter.rope.cos, drafter.rope.sin = drafter.rope.cos.float(), drafter.rope.sin.float()
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    # each rank takes every world-th batch of the same shuffled order; the tail that cannot be dealt
    # evenly waits for the next epoch's order
    steps_per_epoch = max(1, math.ceil(len(samples) / cfg.batch_size) // world)
    plan = {"total": cfg.max_steps or steps_per_epoch * cfg.epochs}
    plan["full"] = plan["total"]
    plan["warm"] = max(1, int(cfg.warmup_ratio * plan["total"]))

    def lr_factor(s: int) -> float:  # linear warm-up, then cosine to zero over the (possibly shortened) plan
        warm, total = plan["warm"], plan["total"]
        return (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    step, start_epoch, done_s = 0, 0, 0.0
    ckpt = out / "trainer_state.pt"
    resumed = cfg.resume and ckpt.exists()
    if resumed:
        st = torch.load(ckpt, map_location=device, weights_only=False)
        drafter.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        sched.load_state_dict(st["sched"])
        step, start_epoch = st["step"], st["epoch"]
        plan.update(st.get("plan", {}))  # a schedule the time budget shortened stays shortened
        done_s = st.get("elapsed_s", 0.0)
    gen = torch.Generator().manual_seed(cfg.seed + step + 1_000_003 * rank)  # ranks draw their own anchors
    gamma = gamma_for(cfg.block_size)
    tap_idx = [i + 1 for i in spec.target_layer_ids]
    if resumed:
        scale = st.get("tap_scale")
    else:
        scale = None
        if cfg.precondition_taps:  # measured once, on rank 0, and sent to the others
            scale = tap_scale(target, samples, tap_idx, device) if main else \
                torch.empty(drafter.fc.weight.shape[1], device=device)
            if world > 1:
                dist.broadcast(scale, 0)
        if cfg.init_drafter and scale is not None:  # the saved fc takes raw taps; training feeds taps * scale
            with torch.no_grad():
                drafter.fc.weight.div_(scale.to(drafter.fc.weight.dtype)[None, :])
    # a run that starts without saved state starts its log too (an attempt stopped before its first save left none)
    log_f = open(out / "train_log.jsonl", "a" if resumed else "w") if main else None
    t_start = time.time()
    t0 = t_start - done_s  # the time budget counts the runs before a resume too
    t_mark = (step, t_start)  # the rate marks at steps 10 and 100 replace it (a resumed run may start past them)
    bar = tqdm(total=plan["total"], initial=step, desc="training drafter", unit="step", disable=not main)
    pending: list[tuple[dict, torch.Tensor]] = []

    def flush() -> None:  # the pending records' numbers come back from the GPU in one read
        if not pending:
            return
        values = torch.stack([v for _, v in pending]).tolist()
        for (rec, _), (loss_v, tau_v, acc1_v, walk_v, gnorm_v) in zip(pending, values):
            rec |= {"loss": loss_v, "grad_norm": gnorm_v, "tau": tau_v, "acc_slot1": acc1_v}
            if cfg.walk_floor is not None:
                rec["walk_tau"] = walk_v
            if main:
                log_f.write(json.dumps(rec) + "\n")
            cfg.log.append(rec)
        bar.set_postfix(loss=f"{loss_v:.3f}", tau=f"{tau_v:.2f}")
        pending.clear()

    epoch, stop = start_epoch, False
    while step < plan["total"]:
        rng = random.Random(cfg.seed * 1000 + epoch)  # anchors and order resampled every epoch
        groups = _batches(samples, cfg.batch_size, rng)[rank::world][:steps_per_epoch]
        for group in groups[step % steps_per_epoch if epoch == start_epoch else 0:]:
            ids, lengths, anchors, valid = make_batch([samples[i] for i in group], cfg.num_anchors, gen, device)
            taps, t_logits = target_features(target, ids, lengths, tap_idx, scale, cfg.labels != "data")
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                window = cfg.local_context if step < cfg.local_context_frac * plan["total"] else None
                loss, stats = dflash_loss(drafter, lm_head, embed, taps, ids, lengths, anchors, valid, mask_id, gamma,
                                          window, cfg.labels, t_logits, cfg.walk_floor)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            logged = torch.stack([loss.detach().float(), stats["tau"].float(), stats["acc_per_slot"][0].float(),
                                  stats.get("walk_tau", stats["tau"]).float()])
            _average([p.grad for p in params] + [logged], world)  # the all-ranks batch's gradient
            gnorm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
            opt.step()
            sched.step()
            step += 1
            # the record's numbers stay on the GPU until the next flush: one wait every LOG_EVERY steps
            pending.append(({"step": step, "epoch": epoch, "lr": sched.get_last_lr()[0],
                             "elapsed_s": time.time() - t0, "total_steps": plan["total"]},
                            torch.cat([logged, gnorm.float().reshape(1)])))
            bar.update(1)
            kept = cfg.keep_every is not None and step % cfg.keep_every == 0
            due = step % LOG_EVERY == 0 or step >= plan["total"] or step % cfg.save_every == 0 or kept
            if not due:
                continue
            flush()
            if step in (10, 100):
                t_mark = (step, time.time())
            if cfg.time_budget_s and step in (30, 300):  # rate measured after warm-up, then re-measured
                rate = (step - t_mark[0]) / (time.time() - t_mark[1])
                fit = int(step + (cfg.time_budget_s - (time.time() - t0)) * rate)
                total = min(plan["full"], max(fit, step + 1))  # shrink, or grow back if it ran faster
                if world > 1:  # rank 0's clock decides for everyone
                    t = torch.tensor([total], device=device)
                    dist.broadcast(t, 0)
                    total = int(t.item())
                if total != plan["total"]:
                    plan["total"] = total
                    plan["warm"] = max(1, int(cfg.warmup_ratio * plan["total"]))
                    bar.total = plan["total"]
            stop = cfg.stop_after_s is not None and time.time() - t_called >= cfg.stop_after_s
            if world > 1 and cfg.stop_after_s is not None:  # rank 0's clock decides for everyone
                flag = torch.tensor([float(stop)], device=device)
                dist.broadcast(flag, 0)
                stop = bool(flag.item())
            if step % cfg.save_every == 0 or step == plan["total"] or stop:
                _check_in_sync(params, world)
                if main:
                    torch.save({"model": drafter.state_dict(), "opt": opt.state_dict(),
                                "sched": sched.state_dict(), "step": step, "epoch": epoch,
                                "plan": dict(plan), "elapsed_s": time.time() - t0,
                                "config": asdict(cfg) | {"log": []}, "tap_scale": scale}, ckpt)
                    save_checkpoint(drafter, target_cfg, out, fc_scale=scale)
            if kept and main:
                save_checkpoint(drafter, target_cfg, out / "steps" / f"{step:06d}", fc_scale=scale)
            if step >= plan["total"] or stop:
                break
        if step >= plan["total"] or stop:
            break
        epoch += 1
    flush()
    bar.close()
    if main:
        log_f.close()
        save_checkpoint(drafter, target_cfg, out, fc_scale=scale)
    if world > 1:
        dist.barrier()  # the checkpoint exists before any rank returns
    return out


def make_data(cfg: TrainConfig, data_path: Path, device: torch.device, rank: int = 0, world: int = 1) -> None:
    """Self-distillation data into data_path. Data parallel: rank r answers every world-th prompt
    into its own part file, then rank 0 joins the parts in rank order."""
    from flashdraft import LLM
    from flashdraft.train.data import generate_responses, training_conversations

    convs = training_conversations(cfg.prompts, cfg.prompt_turns)
    if cfg.num_prompts:
        convs = convs[: cfg.num_prompts]
    llm = LLM(cfg.model, draft=None, device=str(device), max_num_seqs=cfg.gen_batch,
              max_num_batched_tokens=max(4096, cfg.gen_batch * 2))
    part = data_path if world == 1 else data_path.with_name(f"{data_path.name}.part{rank}")
    # seeds follow the global prompt index, so the data does not depend on the number of ranks
    generate_responses(llm, convs[rank::world], part, cfg.max_new_tokens, cfg.max_prompt_tokens,
                       samples_per_prompt=cfg.samples_per_prompt, temperature=cfg.gen_temperature,
                       seed=cfg.seed + rank * cfg.samples_per_prompt, seed_stride=world,
                       sampled_prefix=cfg.sampled_prefix)
    del llm
    if world > 1:
        dist.barrier()
        if rank == 0:
            parts = [data_path.with_name(f"{data_path.name}.part{r}") for r in range(world)]
            data_path.write_text("".join(p.read_text() for p in parts))
            for p in parts:
                p.unlink()
        dist.barrier()
