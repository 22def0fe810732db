"""The engine over N tensor-parallel ranks, one process each (models/parallel.py splits the model).

Rank 0 is the engine: it schedules, drafts, samples and answers, exactly as with one device. Its model is
a `TPModel`: each call that runs the split target (a forward, the logits) is first announced to the
other ranks, which run the same call on their shares, so every collective inside meets its partners in
the same order. The other ranks hold nothing but their share, their KV pages (their KV heads, the pages
rank 0's block tables name) and an attention backend; `worker` is their whole loop. The drafter runs on
rank 0 only: the target's taps and logits reach it whole (all-reduced and gathered). A hybrid target's
ranks also hold their heads' recurrent states; each commit of a verify's accepted rows is announced as well.

A call's host fields (the step's lengths and block tables) travel as a pickled command down a pipe to each
rank (microseconds; a gloo broadcast of the same object took about a millisecond on a CPU); its tensors
(input ids, positions, cache slots, tree masks, a hidden state whose logits are wanted, the ids the drafter
embeds) over the main group, from wherever they are, so announcing a call never waits for the GPU.

CUDA graphs: when rank 0 captures a graph that runs the split target, the calls it announces during the
capture are captured by the other ranks too, into one graph of theirs: the broadcast of the step's
tensors (from rank 0's static buffers, inside its graph), the forward and its all-reduces. Rank 0's graph
then announces each of its replays (`Graph.follower`), and the other ranks replay theirs: one small
command a step, and the collectives meet inside the two graphs.

A rank that exits is seen within half a second by rank 0's watchdog thread, which logs it by name and aborts
the group, so that rank 0, if it waits on that rank in a collective, gets an error at once; the engine's step
then raises one naming the rank. A rank that hangs without exiting ends the group at its timeout
(`settings.TP_TIMEOUT_S`).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import math
import pickle
import socket
import threading
import time
from dataclasses import asdict, replace
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from flashdraft import settings
from flashdraft.attention.base import DeviceMeta
from flashdraft.config import EngineConfig
from flashdraft.engine.graphs import Graph, capture, capturing
from flashdraft.models.parallel import OneShotAllReduce, TPGroup, one_shot_or_none
from flashdraft.speculative.kv_slots import move_rows

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def tp_group(rank: int, size: int, device: torch.device, config: EngineConfig) -> TPGroup:
    """This rank's TPGroup, once the group has started: on GPUs with the one-shot all-reduce for small
    messages unless config.disable_custom_all_reduce (building it is collective: every rank calls this)."""
    one_shot = None if config.disable_custom_all_reduce else one_shot_or_none(device, size)
    return TPGroup(rank, size, one_shot=one_shot)


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
        if device.type == "cuda" and not config.disable_custom_all_reduce and OneShotAllReduce.built:
            log.warning("tensor parallel: this process built the one-shot all-reduce for an earlier engine, and "
                        "torch keeps its state for the life of the process; this engine sums through NCCL alone")
            config = replace(config, disable_custom_all_reduce=True)
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        fields = asdict(replace(config, speculative_config=None))  # (its fields are set already)
        pipes = [ctx.Pipe(duplex=False) for _ in range(1, size)]  # the commands: one pipe a rank
        self.procs = [ctx.Process(target=worker, args=(r, size, init, fields, str(device), pipes[r - 1][0]),
                                  daemon=True) for r in range(1, size)]
        for p in self.procs:
            p.start()
        for read, _ in pipes:
            read.close()  # (the rank holds it: its end closes with it)
        self.pipes = [write for _, write in pipes]
        self._join(_backend(device), init, size)
        self.graphs: list[Graph] = []  # rank 0's graphs that hold collectives (TPModel._announce)
        self.closed = False
        atexit.register(self.close)
        threading.Thread(target=self._watch, daemon=True).start()
        self.tp = tp_group(0, size, rank_device(device, 0), config)

    def _join(self, backend: str, init: str, size: int) -> None:
        """Start the group as rank 0; a rank that exits before it joins (a script that builds the engine
        outside `if __name__ == "__main__":` has its spawned ranks fail on import) ends the wait at once,
        with an error naming it, instead of after TP_TIMEOUT_S."""
        failed: list[BaseException] = []

        def join() -> None:
            try:
                dist.init_process_group(backend, init_method=init, rank=0, world_size=size,
                                        timeout=datetime.timedelta(seconds=settings.TP_TIMEOUT_S))
            except BaseException as e:  # noqa: BLE001 (raised below, in the caller's thread)
                failed.append(e)
        joining = threading.Thread(target=join, daemon=True)
        joining.start()
        while joining.is_alive():
            joining.join(0.2)
            if joining.is_alive() and self.gone():
                r, code = self.gone()[0]
                for p in self.procs:
                    p.kill()
                raise RuntimeError(f"tensor-parallel rank {r} exited while starting (code {code}). Its process is "
                                   "spawned and imports your main script: build a tensor-parallel engine under "
                                   "`if __name__ == \"__main__\":`, and see the rank's error above")
        if failed:
            raise failed[0]

    def gone(self) -> list[tuple[int, int | None]]:
        """(rank, exit code) of each other rank whose process has exited."""
        return [(r, p.exitcode) for r, p in enumerate(self.procs, 1) if not p.is_alive()]

    def exited(self) -> RuntimeError | None:
        """The error that names another rank whose process has exited, if one has."""
        gone = self.gone()
        return RuntimeError(f"tensor-parallel rank {gone[0][0]} exited (code {gone[0][1]}); the engine cannot "
                            "go on") if gone else None

    def named(self, error: BaseException, wait_s: float = 2.0) -> BaseException:
        """The error to raise for `error` (a failed call of rank 0): the one naming a rank that exited, if one
        did (given a moment to be reaped), else `error` itself."""
        deadline = time.monotonic() + wait_s
        while self.exited() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.exited() or error

    def _watch(self) -> None:
        """A rank that exits while rank 0 waits on it in a collective: logged at once by name, and the group
        aborted, so that the wait ends in an error now (NCCL would wait for its timeout, TP_TIMEOUT_S)."""
        while not self.closed:
            if self.gone():
                r, code = self.gone()[0]
                log.error("tensor-parallel rank %d exited (code %s): aborting the group", r, code)
                with contextlib.suppress(Exception):  # (a private call of torch's; gloo fails on its own)
                    dist.distributed_c10d._abort_process_group()
                return
            time.sleep(0.5)

    def send(self, *command) -> None:
        """Announce a call to the other ranks; a rank that is gone is an error naming it."""
        if self.closed:
            raise RuntimeError("the tensor-parallel engine is shut down")
        exited = self.exited()
        if exited is not None:
            raise exited
        data = pickle.dumps(command)
        try:
            for pipe in self.pipes:
                pipe.send_bytes(data)
        except OSError as e:  # (a rank exited since the check above)
            raise self.named(e) from e

    def close(self) -> None:
        """Stop the other ranks and leave the group (once; also at exit), whatever state they are in."""
        if self.closed:
            return
        self.closed = True
        stop = pickle.dumps(("stop",))
        for pipe in self.pipes:  # every rank still there (one that is gone: its pipe is broken)
            with contextlib.suppress(OSError):
                pipe.send_bytes(stop)
        _leave(self.graphs)  # with the other ranks, which leave on "stop" (NCCL's teardown is collective)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


class TPModel:
    """Rank 0's split target: its forward and its logits announced to the other ranks first; every other
    attribute is the split model's. Inside a CUDA graph's capture (engine/graphs.py) the announced calls
    are captured by the other ranks too, as one graph of theirs that the captured graph's replays replay."""

    def __init__(self, model, ranks: Ranks):
        self._model, self._ranks = model, ranks
        self._followed = 0  # graphs of rank 0 with a graph on the other ranks (their ids)

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids, positions, kv, attn, batch, tap_layers=()):
        """The step's host fields down the command pipes; its tensors (ids, positions, slots, tree masks; a
        DeviceMeta's every tensor) over the main group, from the device where they are, as one packed
        broadcast: nothing waits for the GPU here."""
        tensors = {"input_ids": input_ids, "positions": positions, "slot_mapping": batch.slot_mapping,
                   "tree_mask": batch.tree_mask}
        if isinstance(batch, DeviceMeta):  # a graphed step (or its warm-up): the step is on the device
            tensors |= {"query_start_loc": batch.query_start_loc, "seq_lens": batch.seq_lens,
                        "block_tables": batch.block_tables, "recurrent": batch.recurrent}
            host = replace(batch, **dict.fromkeys(tensors.keys() - {"input_ids", "positions"}))
        else:  # a hybrid's sequences travel as the host wrote them (before the layers cache device copies)
            rows = batch.recurrent if batch.recurrent is None else replace(batch.recurrent, spans=None, _dev=None)
            host = replace(batch, slot_mapping=None, tree_mask=None, recurrent=rows)
        tensors = {name: t for name, t in tensors.items() if t is not None}
        self._announce("forward", [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()], host,
                       tuple(tap_layers))
        dist.broadcast(_pack(list(tensors.values())), src=0)
        return self._model(input_ids, positions, kv, attn, batch, tap_layers)

    def commit_states(self, states: dict, rows: dict[int, int]) -> None:
        """A hybrid's commit of its last verify's accepted rows (HybridLM.commit_states), on every rank."""
        self._announce("commit", rows)
        self._model.commit_states(states, rows)

    def commit_pending(self, states: dict, pending: dict, take: torch.Tensor) -> None:
        """A graphed verify's commit kernels (HybridLM.commit_pending, captured as its commit graph): every
        rank over the rows of its own capture of that verify, each sequence taking rank 0's take[s] rows."""
        self._announce("commit_pending", (tuple(take.shape), take.dtype))
        dist.broadcast(take, src=0)
        self._model.commit_pending(states, pending, take)

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        hidden = hidden.contiguous()
        self._announce("logits", tuple(hidden.shape), hidden.dtype, float32)
        dist.broadcast(hidden, src=0)
        return self._model.compute_logits(hidden, float32)

    @property
    def embed_tokens(self) -> _Embedding:
        """The split embedding as rank 0's drafter embeds its blocks with it: each lookup announced."""
        return _Embedding(self)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        self._announce("embed", [(tuple(ids.shape), ids.dtype)])
        dist.broadcast(_pack([ids]), src=0)
        return self._model.embed_tokens(ids)

    def announce_move(self, src: torch.Tensor, dst: torch.Tensor, kernel: bool) -> None:
        """The other ranks move their K/V rows as rank 0 moves its (ModelRunner.move_kv)."""
        self._announce("move", [(tuple(t.shape), t.dtype) for t in (src, dst)], kernel)
        dist.broadcast(_pack([src, dst]), src=0)

    def _announce(self, *command) -> None:
        """Send a call; the first one inside a capture first opens the other ranks' graph of it, and
        gives the graph being captured its follower (the command that replays theirs)."""
        graph = capturing()
        if graph is not None and graph.follower is None:
            self._followed += 1
            self._ranks.send("capture", self._followed)
            graph.follower = partial(self._ranks.send, "replay", self._followed)
            self._ranks.graphs.append(graph)
        self._ranks.send(*command, graph is not None)


class _Embedding:
    """TPModel.embed_tokens: called, an announced lookup; any attribute, the split embedding's."""

    def __init__(self, model: TPModel):
        self._tp = model

    def __getattr__(self, name):
        return getattr(self._tp._model.embed_tokens, name)

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self._tp.embed(ids)


def _leave(graphs) -> None:
    """Leave the group: first destroy the CUDA graphs that captured its collectives (NCCL's communicator
    waits for them: with them alive, destroy_process_group never returned on two H200s)."""
    for g in graphs:
        g.reset()
    graphs.clear()
    if not dist.is_initialized():  # (aborted by the watchdog)
        return
    leaving = threading.Thread(target=dist.destroy_process_group, daemon=True)
    leaving.start()
    leaving.join(settings.TP_TIMEOUT_S)
    if leaving.is_alive():
        log.error("the tensor-parallel group did not close in %d s; left behind", settings.TP_TIMEOUT_S)


def _pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Integer tensors as one int64 vector, each part padded to an even length (16-byte aligned views
    on the receiving side: kernels are compiled per pointer alignment)."""
    parts = []
    for t in tensors:
        flat = t.reshape(-1).to(torch.long)
        parts += [flat, flat.new_zeros(1)] if flat.numel() % 2 else [flat]
    return torch.cat(parts)


def _unpack(specs: list[tuple], device: torch.device) -> list[torch.Tensor]:
    """Receive _pack's vector of tensors of these (shape, dtype)s."""
    sizes = [math.prod(shape) for shape, _ in specs]
    flat = torch.empty(sum(n + n % 2 for n in sizes), dtype=torch.long, device=device)
    dist.broadcast(flat, src=0)
    out, at = [], 0
    for (shape, dtype), n in zip(specs, sizes):
        out.append(flat[at: at + n].view(shape).to(dtype))
        at += n + n % 2
    return out


def worker(rank: int, size: int, init: str, config: dict, device_name: str, control) -> None:
    """Rank `rank`'s process: load and split the target, then run rank 0's calls until told to stop."""
    from flashdraft.attention.base import LayerMasks
    from flashdraft.attention.torch_ref import StaticTorchAttention
    from flashdraft.engine.memory import make_caches
    from flashdraft.engine.model_runner import make_backend
    from flashdraft.models.loader import load_model

    config = EngineConfig(**config)
    device = rank_device(torch.device(device_name), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=settings.TP_TIMEOUT_S)
    dist.init_process_group(_backend(device), init_method=init, rank=rank, world_size=size, timeout=timeout)
    tp = tp_group(rank, size, device, config)
    graphs: dict[int, Graph] = {}
    try:
        dtype = config.resolved_dtype(device)
        model = load_model(config.model, device, dtype, config.load_format, config.revision, tp,
                           config.quantization, config.kv_cache_dtype).model
        _, blocks, max_len, slots = _receive(control)  # rank 0's plan
        model.setup_rope(max_len + 64)
        k_cache, v_cache, states, kv = make_caches(model, blocks, config.kv_block_size, slots, device, dtype,
                                                   config.resolved_kv_dtype(device, dtype))
        name = config.resolved_attention_backend(device)
        # steps built on the host, and steps described by device tensors (graphed ones): on a CPU the
        # latter need the torch backend's static variant (the triton backend reads both)
        own = lambda: make_backend(name)  # noqa: E731
        makers = [own, own if name == "triton" else StaticTorchAttention]
        windows = any(window is not None for _, window in model.layer_masks)  # as ModelRunner builds it
        attn, static = (LayerMasks(make, model.layer_masks) if windows else make() for make in makers)
        _follow(control, device, model, (k_cache, v_cache), kv, states, attn, static, graphs)
    finally:
        _leave(list(graphs.values()))


def _follow(control, device: torch.device, model, caches: tuple, kv: list, states: dict, attn, static,
            graphs: dict) -> None:
    """Run rank 0's calls as they come: eagerly, or into a graph of this rank's while rank 0 captures
    (a "capture" command opens it, the first call not captured or any other command closes it), and
    replay those graphs when rank 0 replays its own. caches: the paged layers' (k, v) pages; kv: per layer its
    pages or (a hybrid's) its recurrent state, of states."""
    kept = []  # the kept rows each captured commit reads (as rank 0's verify graphs hold theirs)
    pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
    open_ = contextlib.ExitStack()  # the capture in progress, if any
    with torch.inference_mode():
        while True:
            command = _receive(control)
            kind, captured = command[0], command[-1]
            if kind not in ("forward", "logits", "move", "embed", "commit_pending") or not captured:
                open_.close()
            if kind == "stop":
                return
            if kind == "capture":
                graphs[command[1]] = Graph()
                open_.enter_context(capture(graphs[command[1]], pool))
            elif kind == "replay":
                graphs[command[1]].replay()
            elif kind == "forward":
                specs, batch, taps = command[1:4]
                ts = dict(zip([name for name, _, _ in specs], _unpack([spec[1:] for spec in specs], device)))
                batch = replace(batch, **{name: t for name, t in ts.items() if name not in ("input_ids", "positions")})
                backend = static if isinstance(batch, DeviceMeta) else attn
                if isinstance(batch, DeviceMeta):
                    backend.set_meta(batch)
                else:
                    backend.prepare(batch, device)
                model(ts["input_ids"], ts["positions"], kv, backend, batch, taps)
            elif kind == "commit":
                model.commit_states(states, command[1])
            elif kind == "commit_pending":
                shape, dt = command[1]
                take = torch.empty(shape, device=device, dtype=dt)
                dist.broadcast(take, src=0)
                pending = {i: s.pending for i, s in states.items()}  # this rank's capture of the verify
                model.commit_pending(states, pending, take)
                if captured:  # as rank 0 (ModelRunner._graph): the graph holds them, no later commit reads them
                    kept.append(pending)
                    for state in states.values():
                        state.pending = None
            elif kind == "embed":
                model.embed_tokens(*_unpack(command[1], device))
            elif kind == "move":
                move_rows(*caches, *_unpack(command[1], device), kernel=command[2])
            elif kind == "logits":
                shape, dt, float32 = command[1:4]
                hidden = torch.empty(shape, device=device, dtype=dt)
                dist.broadcast(hidden, src=0)
                model.compute_logits(hidden, float32)


def _receive(control) -> tuple:
    """Rank 0's next command from the pipe (rank 0 gone: EOFError, and this rank leaves)."""
    return pickle.loads(control.recv_bytes())
