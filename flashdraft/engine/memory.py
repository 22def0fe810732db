"""Memory: the paged KV tensors and recurrent states a target needs, and how many of them fit the
budget (kv_cache_memory_gb, gpu_memory_utilization, or a share of what is free)."""

from __future__ import annotations

import logging

import torch

from flashdraft.config import EngineConfig
from flashdraft.models.transformer import DecoderLM

log = logging.getLogger(__name__)

VERIFY_ROWS = 16  # rows a sequence's verify is planned for (memory plan of hybrid targets' kept rows)


def kv_layers(model: DecoderLM) -> list[int]:
    """The layers with K/V pages: all of a transformer's, the attention layers of a hybrid target."""
    return getattr(model, "kv_layers", None) or list(range(model.config.num_hidden_layers))


def local_heads(model: DecoderLM) -> tuple[int, int]:
    """(query heads, KV heads) this process computes: a tensor-parallel rank's share (models/parallel.py)."""
    cfg, tp = model.config, getattr(model, "tp", None)
    n = tp.size if tp is not None else 1
    return cfg.num_attention_heads // n, cfg.num_key_value_heads // n


def make_caches(model: DecoderLM, num_blocks: int, block_size: int, num_slots: int, device: torch.device,
                dtype: torch.dtype, kv_dtype: torch.dtype | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, dict, list]:
    """(k pages, v pages) of the paged layers [layers, blocks, page, KV heads, head dim] (this process's KV
    heads), a hybrid target's recurrent states of num_slots sequences (layer -> state), and per layer what
    its forward takes: its (k, v) pages or its state. kv_dtype: the pages' (default: dtype)."""
    paged = kv_layers(model)
    shape = (len(paged), num_blocks, block_size, local_heads(model)[1], model.head_dim)
    k_cache = torch.zeros(shape, device=device, dtype=kv_dtype or dtype)
    v_cache = torch.zeros(shape, device=device, dtype=kv_dtype or dtype)
    states = model.make_states(num_slots, device, dtype) if hasattr(model, "make_states") else {}
    kv = [states.get(i) for i in range(model.config.num_hidden_layers)]
    for j, i in enumerate(paged):
        kv[i] = (k_cache[j], v_cache[j])
    return k_cache, v_cache, states, kv


def kv_bytes_per_token(model: DecoderLM, dtype: torch.dtype) -> int:
    return 2 * len(kv_layers(model)) * local_heads(model)[1] * model.head_dim * torch.finfo(dtype).bits // 8


def state_bytes_per_seq(model: DecoderLM, dtype: torch.dtype) -> int:
    """Recurrent-state bytes one sequence holds (hybrid targets; 0 for a transformer)."""
    fn = getattr(model, "state_bytes_per_seq", None)
    return fn(dtype) if fn is not None else 0


# of the GPU memory left after the target's weights, the share the KV pages take: the rest is kept for
# activations, CUDA graphs and the drafter, which are sized after the cache (an estimate, not a profile run)
KV_SHARE = 0.85
# the KV budget on a CPU, where there is no free-memory figure to take a share of
CPU_KV_BYTES = 2 << 30


def memory_budget(config: EngineConfig, device: torch.device) -> float:
    """Bytes for the KV pages and recurrent states: kv_cache_memory_gb, else on a GPU KV_SHARE of the
    memory that gpu_memory_utilization leaves after the weights (utilization_budget), or of the free
    memory, else 2 GiB on a CPU (where gpu_memory_utilization means nothing)."""
    if config.kv_cache_memory_gb is not None:
        return config.kv_cache_memory_gb * (1 << 30)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        if config.gpu_memory_utilization is not None:
            return utilization_budget(config.gpu_memory_utilization, total, free, torch.cuda.memory_reserved(device))
        return KV_SHARE * free
    return CPU_KV_BYTES


def utilization_budget(fraction: float, total: int, free: int, held: int) -> float:
    """KV bytes under vLLM's gpu_memory_utilization: of fraction x the device's total memory, what this
    process does not hold yet (`held`: the target's weights), never more than is free (other processes),
    then KV_SHARE of that as without the setting. fraction=1 on an idle device is the default budget."""
    room = min(fraction * total - held, free)
    if room <= 0:
        raise ValueError(f"gpu_memory_utilization {fraction} allows {fraction * total / 2**30:.2f} GiB, but the "
                         f"engine holds {held / 2**30:.2f} GiB already and {free / 2**30:.2f} GiB is free: raise it "
                         "or free the device")
    return KV_SHARE * room


def plan_state_slots(config: EngineConfig, model: DecoderLM, device: torch.device, dtype: torch.dtype) -> int:
    """Sequences that may run at once: max_num_seqs, lowered (and said so) when their recurrent
    states (hybrid targets: one slot each) would take more than half the memory budget."""
    per = state_bytes_per_seq(model, dtype)
    if not per:
        return config.max_num_seqs
    fit = int(memory_budget(config, device) // 2 // per)
    if fit < 1:
        raise ValueError(f"one sequence's recurrent state ({per / 2**20:.1f} MiB) does not fit half the memory "
                         "budget: raise kv_cache_memory_gb")
    if fit < config.max_num_seqs:
        log.warning("max_num_seqs lowered from %d to %d: each running sequence holds %.1f MiB of recurrent state, "
                    "and states may take half of the %.2f GiB budget", config.max_num_seqs, fit, per / 2**20,
                    memory_budget(config, device) / 2**30)
        return fit
    return config.max_num_seqs


def plan_num_blocks(config: EngineConfig, model: DecoderLM, device: torch.device, dtype: torch.dtype,
                    max_model_len: int) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    per_block = kv_bytes_per_token(model, config.resolved_kv_dtype(device, dtype)) * config.kv_block_size
    # never more than every running sequence at full length could use
    ceiling = config.max_num_seqs * -(-max_model_len // config.kv_block_size)
    budget = memory_budget(config, device) - config.max_num_seqs * state_bytes_per_seq(model, dtype)
    if hasattr(model, "kept_bytes_per_row") and config.draft not in (None, "auto") and device.type == "cuda":
        # a hybrid target's verify graphs keep their rows for the commit: the largest batch bucket x
        # VERIFY_ROWS rows (the block size of z-lab's drafters; the drafter is not loaded yet)
        bucket = 1 << (min(config.max_num_seqs, config.max_graph_batch) - 1).bit_length()
        budget -= bucket * VERIFY_ROWS * model.kept_bytes_per_row(dtype)
    return max(1, min(ceiling, int(budget // per_block)))
