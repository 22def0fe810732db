"""CUDA graphs for fixed-shape steps. A `StepGraph` owns static input buffers for one bucket (S
sequences x q_len rows each: q_len 1 for decode, B for a verify or a draft block) and a callable
that runs one forward over them; `capture()` records that callable once, `run(...)` copies a step's
values into the buffers and replays. On CPU nothing is captured and `run` calls the same code
eagerly over the same buffers, so everything here is testable without a GPU.

    g = StepGraph(lambda g: model(g.input_ids, g.positions, kv, attn, g.meta, taps),
                  num_seqs=8, q_len=16, max_blocks=66, block_size=16, device=dev, attn=[attn])
    g.capture()
    hidden, tapped = g.run(ids, pos, slots, seq_lens, tables)   # static outputs, valid until the next run

Padding: sequences past the real ones get seq_len 0 and no rows, rows past the real ones get slot
-1 (not stored); their outputs are garbage (zeros from the attention backends, whatever the layers
make of that). The attention backends named in `attn` get `set_meta(g.meta)` (or, given as a
(backend, meta) pair, that meta: a step that runs two attention kinds, like the DFlash draft and
verify, gives each backend its own) before every eager call and just before capture (outside it),
so index tensors that a backend derives from the meta at its first forward are part of the graph
and follow the buffers on every replay."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Sequence
from typing import Any

import torch

from flashdraft.attention.base import DeviceMeta

Tensorish = torch.Tensor | Sequence


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a tensor on `device` without waiting for the GPU: staged in pinned memory and
    copied asynchronously. `torch.tensor(values, device="cuda")` copies synchronously, returning only
    once everything already queued on the stream (the step just launched) has run; CUDA guarantees
    an asynchronous host-to-device copy only from pinned memory."""
    device = torch.device(device)
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


class Graph(torch.cuda.CUDAGraph):
    """torch's CUDA graph, and a `follower` told before each replay: a tensor-parallel target run
    inside the capture sets it (engine/parallel.py), so that the other ranks replay their graph of
    the same collectives."""

    follower: Callable[[], None] | None = None

    def replay(self) -> None:
        if self.follower is not None:
            self.follower()
        super().replay()


_capturing: list[Graph] = []


def capturing() -> Graph | None:
    """The graph this process is capturing now (through `capture`), or None."""
    return _capturing[-1] if _capturing else None


@contextlib.contextmanager
def capture(graph: Graph, pool=None):
    """torch.cuda.graph with Python's cyclic garbage collector held off: a collection during a capture
    can finalise an earlier engine's graphs, streams or memory, CUDA calls that invalidate the capture
    in progress (it then fails at a later launch, e.g. cuBLAS's EXECUTION_FAILED). torch no longer
    collects before a capture (torch.compiler.config.force_cudagraph_gc); the engine collects once
    before its first (collect_before_capture)."""
    enabled = gc.isenabled()
    gc.disable()
    _capturing.append(graph)
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        _capturing.pop()
        if enabled:
            gc.enable()


def collect_before_capture(device: torch.device) -> None:
    """Collect dead Python cycles (an earlier engine's, holding CUDA graphs and memory) before an
    engine captures its graphs, so that none is finalised between captures."""
    if device.type == "cuda":
        gc.collect()


class StepGraph:
    def __init__(self, fn: Callable[[StepGraph], Any], num_seqs: int, q_len: int, max_blocks: int, block_size: int,
                 device: torch.device | str, causal: bool = True, max_seq_len: int | None = None,
                 attn: Sequence = (), extra: dict[str, torch.Tensor] | None = None, num_rows: int | None = None,
                 recurrent: bool = False):
        """fn(g) runs one step over g.input_ids [T], g.positions [T], g.meta and g.extra (further
        static inputs, e.g. taps); T = num_seqs * q_len. max_seq_len defaults to the pages' span.
        num_rows (T) given: a ragged step, up to num_seqs sequences sharing T rows in any split
        (prefill chunks beside decode or verify rows); q_len then bounds one sequence's rows (T
        for any split) and fills pass query_start_loc. recurrent: a hybrid target's meta.recurrent
        buffer (filled by `recurrent=`; padding sequences have no rows, so whatever they hold is unused)."""
        self.fn = fn
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"  # host values staged pinned: fills never wait for the GPU
        self.num_seqs, self.q_len = num_seqs, q_len
        self.num_rows = T = num_seqs * q_len if num_rows is None else num_rows
        dev = self.device
        # the per-row and per-sequence buffers are views of two device tensors, so that a step's
        # fill from host lists is two copies (rows; sequences), not one a buffer: each small copy
        # costs the GPU ~2.7 us between steps. Every view starts 16-byte aligned (kernels are
        # compiled per pointer alignment).
        width = -(-T // 2) * 2
        self._rows = torch.zeros(3, width, dtype=torch.long, device=dev)  # ids, positions, slots
        self._rows[2].fill_(-1)
        S = num_seqs
        self._lens_at = -(-(S + 1) // 4) * 4  # query starts, then lengths, then recurrent rows
        self._rec_at = self._lens_at + -(-S // 4) * 4
        self._ints = torch.full((self._rec_at + 3 * S,), -1, dtype=torch.int32, device=dev)
        self._ints[: self._rec_at] = 0
        self.input_ids, self.positions = self._rows[0, :T], self._rows[1, :T]
        self.meta = DeviceMeta(
            slot_mapping=self._rows[2, :T],
            query_start_loc=self._ints[: S + 1],
            seq_lens=self._ints[self._lens_at: self._lens_at + S],
            block_tables=torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device=dev),
            max_query_len=q_len, max_seq_len=max_seq_len or max_blocks * block_size, block_size=block_size,
            causal=causal, recurrent=self._ints[self._rec_at:].view(S, 3) if recurrent else None)
        self.extra = dict(extra or {})
        # what a kind of step keeps with these buffers (its own typed record: speculative/graphs.py), and a
        # hybrid target's record of the rows each GDN layer keeps for the commit (engine/model_runner.py)
        self.buffers: Any = None
        self.pending: dict | None = None
        self.attn = list(attn)
        self.graph: Graph | None = None
        self.outputs: Any = None

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def _install(self) -> None:
        for a in self.attn:
            backend, meta = a if isinstance(a, tuple) else (a, self.meta)
            backend.set_meta(meta)

    def _call(self) -> Any:
        with torch.inference_mode():
            return self.fn(self)

    def capture(self, warmup: int = 2, pool=None) -> StepGraph:
        """Warm up on a side stream (Triton JIT, cuBLAS handles, allocator), then capture one call.
        A no-op off CUDA. Capture uses whatever the buffers hold: fill() a representative step first
        when a kernel's launch configuration is chosen from the data."""
        if self.device.type != "cuda":
            return self
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._install()
                self._call()
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = Graph()
        self._install()  # outside the capture; index tensors derived from the meta are built inside
        with capture(graph, pool):
            self.outputs = self._call()
        torch.cuda.synchronize(self.device)
        self.graph = graph
        return self

    def fill(self, input_ids: Tensorish | None = None, positions: Tensorish | None = None,
             slot_mapping: Tensorish | None = None, seq_lens: Tensorish | None = None,
             block_tables: Tensorish | None = None, query_start_loc: Tensorish | None = None,
             recurrent: Tensorish | None = None, **extra: Tensorish) -> None:
        """Copy one step's values into the static buffers (non_blocking, no host sync). Arguments
        left None keep their buffers. Real rows / sequences come first; the rest is padding: slots
        past the given ones become -1, seq_lens past the given ones 0. query_start_loc defaults to
        q_len rows for each of the len(seq_lens) real sequences."""
        m = self.meta
        host = lambda v: v is not None and not isinstance(v, torch.Tensor)  # noqa: E731
        if host(input_ids) and host(positions) and host(slot_mapping):  # one copy of the three
            n = len(input_ids)
            if not n == len(positions) == len(slot_mapping) or n > self.num_rows:
                raise ValueError(f"{n} ids, {len(positions)} positions and {len(slot_mapping)} slots for a "
                                 f"static buffer of {self.num_rows} rows")
            pad = self._rows.shape[1] - n
            rows = [*input_ids, *[0] * pad, *positions, *[0] * pad, *slot_mapping, *[-1] * pad]
            self._rows.copy_(torch.tensor(rows, dtype=torch.long, pin_memory=self._pin).view(3, -1), non_blocking=True)
            input_ids = positions = slot_mapping = None
        if input_ids is not None:
            self.copy_into(self.input_ids, input_ids)
        if positions is not None:
            self.copy_into(self.positions, positions)
        if slot_mapping is not None:
            self.copy_into(m.slot_mapping, slot_mapping, pad=-1)
        if block_tables is not None:
            if not isinstance(block_tables, torch.Tensor):
                width = max([len(t) for t in block_tables] + [1])
                block_tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in block_tables],
                                            dtype=torch.int32, pin_memory=self._pin).view(len(block_tables), width)
            s, w = block_tables.shape
            m.block_tables[:s, :w].copy_(block_tables, non_blocking=True)
        S = self.num_seqs
        if host(seq_lens) and (query_start_loc is None or host(query_start_loc)) \
                and (recurrent is None or (host(recurrent) and m.recurrent is not None)):
            # one copy: query starts, lengths and (given) the recurrent rows, padding sequences with no rows
            n = len(seq_lens)
            if n > S:
                raise ValueError(f"{n} rows do not fit a static buffer of {S}")
            qsl = list(query_start_loc) if query_start_loc is not None else [i * self.q_len for i in range(n + 1)]
            ints = qsl + [qsl[-1]] * (S + 1 - len(qsl)) + [0] * (self._lens_at - S - 1) + list(seq_lens) \
                + [0] * (self._rec_at - self._lens_at - n)
            if recurrent is not None:
                flat = [int(v) for r in recurrent for v in r]
                ints += flat + [-1] * (3 * S - len(flat))
                recurrent = None
            self._ints[: len(ints)].copy_(torch.tensor(ints, dtype=torch.int32, pin_memory=self._pin),
                                          non_blocking=True)
            seq_lens = query_start_loc = None
        if seq_lens is not None:
            n = self.copy_into(m.seq_lens, seq_lens, pad=0)
            if query_start_loc is None:
                query_start_loc = [min(i, n) * self.q_len for i in range(self.num_seqs + 1)]
        if query_start_loc is not None:
            qsl = query_start_loc
            if not isinstance(qsl, torch.Tensor):  # padding sequences: no rows
                qsl = list(qsl) + [qsl[-1]] * (self.num_seqs + 1 - len(qsl))
                qsl = torch.tensor(qsl, dtype=torch.int32, pin_memory=self._pin)
            elif qsl.numel() < self.num_seqs + 1:
                qsl = torch.cat([qsl, qsl[-1:].expand(self.num_seqs + 1 - qsl.numel())])
            m.query_start_loc.copy_(qsl, non_blocking=True)
        if recurrent is not None:
            self.copy_into(m.recurrent, recurrent)
        for name, value in extra.items():
            self.copy_into(self.extra[name], value)

    def replay(self) -> Any:
        """Replay the captured step (or run it eagerly off CUDA); returns the step's outputs."""
        if self.graph is not None:
            self.graph.replay()
            return self.outputs
        self._install()
        self.outputs = self._call()
        return self.outputs

    def run(self, *args, **kwargs) -> Any:
        """fill(...) then replay()."""
        self.fill(*args, **kwargs)
        return self.replay()

    def copy_into(self, buf: torch.Tensor, value: Tensorish, pad: int | None = None) -> int:
        """Copy host values or a tensor into the first rows of a static buffer (non_blocking), the rest
        set to `pad` when given; returns how many rows were given."""
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(value, dtype=buf.dtype, pin_memory=self._pin)
        n = value.shape[0]
        if n > buf.shape[0]:
            raise ValueError(f"{n} rows do not fit a static buffer of {buf.shape[0]}")
        buf[:n].copy_(value, non_blocking=True)
        if pad is not None and n < buf.shape[0]:
            buf[n:].fill_(pad)
        return n
