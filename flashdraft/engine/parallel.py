"""The engine over N tensor-parallel ranks, one process each (models/parallel.py splits the model).

Rank 0 is the engine: it schedules, drafts, samples and answers, exactly as with one device. Its model is
a `TPModel`: each call that runs the split target (a forward, the logits) is first announced to the
other ranks, which run the same call on their shares, so every collective inside meets its partners in
the same order. The other ranks hold nothing but their share, their KV pages (their KV heads, the pages
rank 0's block tables name) and an attention backend; `worker` is their whole loop. The drafter runs on
rank 0 only: the target's taps and logits reach it whole (all-reduced and gathered).

A call's host fields (the step's lengths and block tables) travel as a pickled command over a gloo group;
its tensors (input ids, positions, cache slots, tree masks, a hidden state whose logits are wanted) over
the main group, from wherever they are, so announcing a call never waits for the GPU. A rank that has
exited is named by rank 0's next call; a rank stuck in a collective ends it at the group's timeout
(`TP_TIMEOUT_S`). On CUDA the steps run eagerly (CUDA graphs are not captured per rank yet).
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import socket
from dataclasses import asdict, replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashdraft.config import EngineConfig
from flashdraft.models.parallel import TPGroup

log = logging.getLogger(__name__)
TP_TIMEOUT_S = int(os.environ.get("FLASHDRAFT_TP_TIMEOUT_S", "300"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else device


class Ranks:
    """Rank 0's side of the group: the other ranks' processes, and the command channel to them."""

    def __init__(self, config: EngineConfig, device: torch.device):
        size = config.tensor_parallel_size
        if device.type == "cuda" and torch.cuda.device_count() < size:
            raise ValueError(f"tensor_parallel_size {size} needs {size} GPUs; this host has "
                             f"{torch.cuda.device_count()}")
        if dist.is_initialized():
            raise ValueError("one tensor-parallel engine per process: shut the other down first "
                             "(LLMEngine.shutdown) or start this one in a process of its own")
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        fields = asdict(replace(config, speculative_config=None))  # (its fields are set already)
        self.procs = [ctx.Process(target=worker, args=(r, size, init, fields, str(device)), daemon=True)
                      for r in range(1, size)]
        for p in self.procs:
            p.start()
        timeout = datetime.timedelta(seconds=TP_TIMEOUT_S)
        dist.init_process_group(_backend(device), init_method=init, rank=0, world_size=size, timeout=timeout)
        self.control = dist.new_group(backend="gloo", timeout=timeout)
        self.tp = TPGroup(0, size)
        self.closed = False
        atexit.register(self.close)

    def send(self, *command) -> None:
        """Announce a call to the other ranks; a rank that is gone is an error naming it."""
        gone = [(r, p.exitcode) for r, p in enumerate(self.procs, 1) if not p.is_alive()]
        if self.closed or gone:
            raise RuntimeError("the tensor-parallel engine is shut down" if self.closed else
                               f"tensor-parallel rank {gone[0][0]} exited (code {gone[0][1]}); the engine cannot go on")
        dist.broadcast_object_list([command], src=0, group=self.control)

    def close(self) -> None:
        """Stop the other ranks and leave the group (once; also at exit), whatever state they are in."""
        if self.closed:
            return
        try:
            self.send("stop")
        except RuntimeError:
            pass  # (a rank is gone: the others are stopped below)
        self.closed = True
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        dist.destroy_process_group()


class TPModel:
    """Rank 0's split target: its forward and its logits announced to the other ranks first; every other
    attribute is the split model's."""

    def __init__(self, model, ranks: Ranks):
        self._model, self._ranks = model, ranks

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids, positions, kv, attn, batch, tap_layers=()):
        """The step's host fields over the control group; its tensors (ids, positions, slots, tree masks)
        over the main group, from the device where they are: nothing waits for the GPU here."""
        tensors = _step_tensors(input_ids, positions, batch)
        host = replace(batch, slot_mapping=None, tree_mask=None)
        self._ranks.send("forward", [tuple(t.shape) for t in tensors], host, tuple(tap_layers))
        for t in tensors:
            dist.broadcast(t, src=0)
        return self._model(input_ids, positions, kv, attn, batch, tap_layers)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        hidden = hidden.contiguous()
        self._ranks.send("logits", tuple(hidden.shape), hidden.dtype, float32)
        dist.broadcast(hidden, src=0)
        return self._model.compute_logits(hidden, float32)


def _step_tensors(input_ids, positions, batch) -> list[torch.Tensor]:
    """A forward's int64 tensors the other ranks receive: ids, positions, slots, and tree masks if any."""
    ts = [input_ids, positions, batch.slot_mapping] + ([batch.tree_mask] if batch.tree_mask is not None else [])
    return [t.to(input_ids.device, torch.long).contiguous() for t in ts]  # (NCCL: all on the GPU)


def worker(rank: int, size: int, init: str, config: dict, device_name: str) -> None:
    """Rank `rank`'s process: load and split the target, then run rank 0's calls until told to stop."""
    from flashdraft.attention.base import LayerMasks
    from flashdraft.engine.model_runner import make_backend
    from flashdraft.models.loader import load_model
    from flashdraft.models.parallel import shard_decoder

    config = EngineConfig(**config)
    device = rank_device(torch.device(device_name), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=TP_TIMEOUT_S)
    dist.init_process_group(_backend(device), init_method=init, rank=rank, world_size=size, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    try:
        dtype = config.resolved_dtype(device)
        loaded = load_model(config.model, device, dtype, config.load_format, config.revision)
        model = shard_decoder(loaded.model, TPGroup(rank, size))
        _, blocks, max_len = _receive(control)  # rank 0's plan
        model.setup_rope(max_len + 64)
        a = model.layers[0].self_attn
        shape = (blocks, config.kv_block_size, a.n_kv, a.head_dim)
        kv = [(torch.zeros(shape, device=device, dtype=dtype), torch.zeros(shape, device=device, dtype=dtype))
              for _ in model.layers]
        name = config.resolved_attention_backend(device)
        attn = make_backend(name)
        if any(window is not None for _, window in model.layer_masks):  # as ModelRunner builds it
            attn = LayerMasks(lambda: make_backend(name), model.layer_masks)
        with torch.inference_mode():
            while True:
                command = _receive(control)
                if command[0] == "stop":
                    return
                if command[0] == "forward":
                    shapes, batch, taps = command[1:]
                    ts = [torch.empty(shape, dtype=torch.long, device=device) for shape in shapes]
                    for t in ts:
                        dist.broadcast(t, src=0)
                    batch = replace(batch, slot_mapping=ts[2], tree_mask=ts[3] if len(ts) > 3 else None)
                    attn.prepare(batch, device)
                    model(ts[0], ts[1], kv, attn, batch, taps)
                elif command[0] == "logits":
                    shape, dt, float32 = command[1:]
                    hidden = torch.empty(shape, device=device, dtype=dt)
                    dist.broadcast(hidden, src=0)
                    model.compute_logits(hidden, float32)
    finally:
        dist.destroy_process_group()


def _receive(control) -> tuple:
    box = [None]
    dist.broadcast_object_list(box, src=0, group=control)
    return box[0]
