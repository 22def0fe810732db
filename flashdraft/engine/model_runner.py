"""Batch -> tensors -> target forward. Owns the model, the paged KV tensors and the attention
backend. Metadata for a step is built once here and shared by every layer."""

from __future__ import annotations

import torch

from flashdraft.attention.base import AttentionBackend, AttentionBatch, LayerMasks
from flashdraft.attention.torch_ref import TorchAttention
from flashdraft.config import EngineConfig
from flashdraft.engine.block_manager import BlockManager
from flashdraft.engine.graphs import Graph, StepGraph, capture, to_device
from flashdraft.engine.memory import local_heads, make_caches
from flashdraft.engine.sampler import SamplingBatch, greedy_tokens
from flashdraft.engine.sequence import Sequence
from flashdraft.kernels.dispatch import fused_enabled
from flashdraft.models.gdn import RecurrentRows, take_rows
from flashdraft.models.transformer import DecoderLM
from flashdraft.speculative.kv_slots import move_rows

PAD_ROWS = 32  # = settings.SKINNY_ROWS (its default): fewer rows run the Triton GEMMs, one variant for any count
# row counts of the placeholder steps run at start: the few-row GEMMs' two tile heights (up to 16
# rows, up to 32) and cuBLAS with the MLP's separate silu * up kernel (and for hybrid targets the
# chunked GDN kernel, gdn_ops.CHUNKED_MIN_ROWS rows: fla-core tunes its kernels on first use)
WARM_ROWS = (16, 32, 64)
# buckets of the graphed ragged steps (prefill chunks beside decode or verify rows): total rows,
# and sequences (a step's attention grid grows with rows x sequences, so both are bucketed)
RAGGED_ROWS = (32, 64, 128, 256, 512, 1024, 2048)
RAGGED_SEQS = (4, 16, 64, 256)


def make_backend(name: str) -> AttentionBackend:
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        from flashdraft.attention.triton_backend import TritonAttention  # GPU only

        return TritonAttention()
    raise ValueError(f"unknown attention_backend {name!r}; choose torch or triton")


class ModelRunner:
    def __init__(self, model: DecoderLM, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, max_model_len: int):
        self.model = model
        self.device, self.dtype = device, dtype
        self.kv_dtype = config.resolved_kv_dtype(device, dtype)  # the KV pages' (the drafter's context too)
        self.block_size = config.kv_block_size
        self.backend_name = config.resolved_attention_backend(device)
        self.attn = make_backend(self.backend_name)
        # CUDA graphs need a backend that reads its step description from device tensors
        self.use_graphs = config.cuda_graphs and device.type == "cuda" and hasattr(self.attn, "set_meta")
        # hybrid targets (models/hybrid.py): recurrent-state slots; graphed when the GDN kernels run
        # (kernels/gdn_ops.py), which read the step's sequences from device tensors
        self.hybrid = hasattr(model, "make_states")
        if self.hybrid and self.use_graphs:
            with torch.inference_mode():
                self.use_graphs = model.kernels_on(torch.empty(0, device=device, dtype=dtype))
        if any(window is not None for _, window in model.layer_masks):  # sliding-window layers
            self.attn = LayerMasks(lambda: make_backend(self.backend_name), model.layer_masks)
        self.max_graph_batch = config.max_graph_batch
        self.max_model_len = max_model_len
        self.max_blocks = -(-(max_model_len + 64) // self.block_size)
        self.graphs: dict[tuple, StepGraph] = {}
        # (key, rows per sequence) of the step kinds that replay graphs: only those registered by
        # capture_graphs; any other shape (a lone prompt's prefill) is ragged, never captured here
        self.graph_shapes: set[tuple] = set()
        # ragged steps of a registered kind replay a graph of (sequences bucket, rows bucket) when
        # one is captured (capture_ragged_graphs); others run eagerly
        self.ragged_graphs: dict[tuple, StepGraph] = {}
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # eager steps of more rows than the few-row GEMMs take are padded to a multiple of this
        # (padding rows: slot -1, nothing stored, nothing attended): cuBLAS picks and loads a kernel
        # per new row count (0.3-0.8 ms a GEMM on an H100), so a prefill of any length must not
        # bring a new one; the Triton backend skips the padding rows, the torch reference does not
        self.pad_rows = PAD_ROWS if self.backend_name == "triton" else 0
        cfg = model.config
        # max_model_len plus room for draft slots past the end of a sequence
        model.setup_rope(max_model_len + 64)
        self.k_cache, self.v_cache, self.states, self.kv = make_caches(model, num_blocks, self.block_size,
                                                                       config.max_num_seqs, device, dtype,
                                                                       self.kv_dtype)
        if self.backend_name == "triton" and device.type == "cuda":  # no kernel compiles once serving
            from flashdraft.kernels.attention import compile_variants

            for _, window in dict.fromkeys(model.layer_masks):
                compile_variants(*local_heads(model), model.head_dim, self.block_size,
                                 dtype, device, window=window, sinks=model.has_sinks, kv_dtype=self.kv_dtype)
        with torch.inference_mode():  # the sampler's greedy kernels, both logits dtypes
            if device.type == "cuda" and fused_enabled(self.k_cache):
                for dt in {dtype, torch.float32}:
                    greedy_tokens(torch.zeros(1, cfg.vocab_size, device=device, dtype=dt))
                for n in WARM_ROWS:  # and every GEMM and fused-kernel variant of eager steps
                    hidden, _ = self.run(*self.placeholder_batch(n))
                    for f32 in (False, True):
                        model.compute_logits(hidden, float32=f32)

    def step_lists(self, seqs: list[Sequence], tokens: list[list[int]], bm: BlockManager) -> tuple[list, ...]:
        """A step's host lists: token ids, positions and cache slots of every row, query start
        offsets, sequence lengths and block tables. tokens[s] are the new tokens of seqs[s], at
        positions num_computed_tokens onwards."""
        ids, pos, slots, qsl, seq_lens, tables = [], [], [], [0], [], []
        bs = self.block_size
        for seq, toks in zip(seqs, tokens):
            start = seq.num_computed_tokens
            table = bm.table(seq.seq_id)
            ids.extend(toks)
            p = range(start, start + len(toks))
            pos.extend(p)
            slots.extend(table[i // bs] * bs + i % bs for i in p)
            qsl.append(qsl[-1] + len(toks))
            seq_lens.append(start + len(toks))
            tables.append(table)
        return ids, pos, slots, qsl, seq_lens, tables

    def build_batch(self, seqs: list[Sequence], tokens: list[list[int]], bm: BlockManager,
                    causal: bool = True, keep: list[bool] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """tokens[s] are the new tokens of seqs[s], at positions num_computed_tokens onwards.
        The drafter builds its blocks with this too: same positions, same pages. Rows past
        query_start_loc[-1] are padding (see pad_rows): outputs are cut by the caller. keep[s]
        (hybrid targets): seqs[s]'s rows may be rejected, its recurrent state waits for
        commit_states."""
        ids, pos, slots, qsl, seq_lens, tables = self.step_lists(seqs, tokens, bm)
        bs = self.block_size
        n = len(ids)
        if self.pad_rows and n > self.pad_rows:
            pad = -n % self.pad_rows
            ids.extend([0] * pad)
            pos.extend([0] * pad)
            slots.extend([-1] * pad)
        dev = self.device
        batch = AttentionBatch(to_device(slots, torch.long, dev), qsl, seq_lens, tables, bs, causal)
        if self.hybrid and causal:
            batch.recurrent = RecurrentRows([bm.slot(s.seq_id) for s in seqs],
                                            [s.num_computed_tokens == 0 for s in seqs],
                                            list(keep) if keep is not None else [False] * len(seqs))
        return to_device(ids, torch.long, dev), to_device(pos, torch.long, dev), batch

    def commit_states(self, rows: dict[int, int]) -> None:
        """Hybrid targets: each state slot of `rows` keeps its state after the first rows[slot] of
        its sequence's kept rows of the last step (the accepted ones). After a graphed verify, one
        replay of its commit graph (two kernels a GDN layer); else the kernels or the torch scan."""
        if not (self.hybrid and rows):
            return
        first = next(iter(self.states.values())).pending
        if first is not None and first.commit_graph is not None:
            graph, take = first.commit_graph
            take.copy_(torch.tensor(take_rows(first.rows, rows, take.shape[0]), dtype=torch.int32,
                                    pin_memory=True), non_blocking=True)
            graph.replay()
            for state in self.states.values():
                state.pending = None
            return
        self.model.commit_states(self.states, rows)

    def commit_states_from(self, take: torch.Tensor) -> None:
        """Hybrid targets: commit the last graphed verify with the rows each of its sequences keeps in
        `take` (a device tensor, the step's sequences in order), without reading it on the host: its
        commit graph's replay (speculative/ahead.py launches the next verify right after it). The
        kept inputs stay for the verify that rewrites them. Off CUDA, the host commit (a CPU's
        tensors are the host's)."""
        first = next(iter(self.states.values())).pending
        if first is None or first.rows is None:
            return
        if first.commit_graph is not None:
            graph, buf = first.commit_graph
            buf.zero_()
            buf[: take.shape[0]].copy_(take)
            graph.replay()
            return
        self.commit_states({slot: int(t) for slot, t, keep in zip(first.rows.slots, take.tolist(), first.rows.keep)
                            if keep})

    def capture_commit(self, pending: dict, bucket: int):
        """The CUDA graph of a verify graph's commit (HybridLM.commit_pending over its kept rows, the
        rows each sequence takes read from a [bucket] buffer), captured after the verify: a commit is
        then one replay instead of two launches a GDN layer from Python."""
        take = torch.zeros(bucket, dtype=torch.int32, device=self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), torch.inference_mode():  # take 0: the warm-up changes no state
            self.model.commit_pending(self.states, pending, take)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        graph = Graph()
        with capture(graph, self.graph_pool), torch.inference_mode():
            self.model.commit_pending(self.states, pending, take)
        torch.cuda.synchronize(self.device)
        return graph, take

    def placeholder_batch(self, n: int, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor, AttentionBatch]:
        """A step of one placeholder sequence of n rows (token 0 at positions 0..n-1, keys read
        from page 0) that stores nothing: run at start, so no kernel variant compiles mid-serving."""
        dev = self.device
        batch = AttentionBatch(torch.full((n,), -1, dtype=torch.long, device=dev), [0, n], [n],
                               [[0] * -(-n // self.block_size)], self.block_size, causal)
        return torch.zeros(n, dtype=torch.long, device=dev), torch.arange(n, device=dev), batch

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], tokens: list[list[int]], bm: BlockManager,
                tap_layers: tuple[int, ...] = (), input_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None, list[int]]:
        """Run the target; returns final hidden [T, H], taps [T, n*H] or None, and row offsets
        (T may count padding rows past the last offset). input_ids: the rows' token ids already on
        the device (an overlapped step's: the samples of the step before), in place of the values
        of `tokens`, which then only count rows.
        Steps where every sequence brings the same number of tokens (decode, verify)
        replay a captured CUDA graph when graphs are on."""
        out = self.graphed(("target", tap_layers), seqs, tokens, bm, True, self.attn, self.target_step(tap_layers),
                           input_ids)
        if out is not None:
            (hidden, taps), qsl = out
            return hidden, taps, qsl
        g = self.ragged_graph(("target", tap_layers), seqs, tokens, bm) if self.ragged_graphs else None
        if g is not None:
            if input_ids is not None:
                g.input_ids[: input_ids.shape[0]].copy_(input_ids)
            hidden, taps = g.replay()
            qsl = [0]
            for t in tokens:
                qsl.append(qsl[-1] + len(t))
            return hidden[: qsl[-1]], taps[: qsl[-1]] if taps is not None else None, qsl
        ids, positions, batch = self.build_batch(seqs, tokens, bm)
        if input_ids is not None:
            ids[: input_ids.shape[0]] = input_ids
        hidden, taps = self.run(ids, positions, batch, tap_layers)
        return hidden, taps, batch.query_start_loc

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor, kernel: bool = False) -> None:
        """The target's K/V of every layer from slots src to slots dst (kv_slots.move_rows; token trees'
        accepted rows), on every tensor-parallel rank: a split target announces it (engine/parallel.py)."""
        announce = getattr(self.model, "announce_move", None)
        if announce is not None:
            announce(src, dst, kernel)
        move_rows(self.k_cache, self.v_cache, src, dst, kernel)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch,
            tap_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target eagerly over a built batch (build_batch): final hidden and taps."""
        self.attn.prepare(batch, self.device)
        return self.model(input_ids, positions, self.kv, self.attn, batch, tap_layers)

    def graphed(self, key: tuple, seqs: list[Sequence], tokens: list[list[int]], bm: BlockManager, causal: bool,
                attn: AttentionBackend, fn, input_ids: torch.Tensor | None = None) -> tuple | None:
        """Run fn(graph) through the captured graph of this step's shape (bucket of sequences x
        rows per sequence), capturing it on first use; None when the step is not graphable. The
        outputs (tensors or tuples of tensors, rows first) are cut to this step's rows. input_ids
        as in forward."""
        g = self.filled_graph(key, seqs, tokens, bm, causal, attn, fn)
        if g is None:
            return None
        if input_ids is not None:
            g.input_ids[: input_ids.shape[0]].copy_(input_ids)
        out = g.replay()
        q_len, n = len(tokens[0]), sum(len(t) for t in tokens)
        cut = tuple(o[:n] if o is not None else None for o in out) if isinstance(out, tuple) else out[:n]
        return cut, [i * q_len for i in range(len(seqs) + 1)]

    def filled_graph(self, key: tuple, seqs: list[Sequence], tokens: list[list[int]], bm: BlockManager,
                     causal: bool, attn, fn, setup=None) -> StepGraph | None:
        """The captured graph of this step's shape with the step's inputs and metadata copied into
        its buffers, ready to replay; None when the step is not graphable (graphs off, ragged
        rows, rows per sequence of no registered kind, more sequences than the largest bucket).
        `setup` as in `_graph`."""
        q_len = len(tokens[0]) if tokens else 0
        if not self.use_graphs or (key, q_len) not in self.graph_shapes or len(seqs) > self.max_graph_batch \
                or any(len(t) != q_len for t in tokens):
            return None
        bucket = 1 << (len(seqs) - 1).bit_length()
        ids, pos, slots, _, seq_lens, tables = self.step_lists(seqs, tokens, bm)
        g = self._graph(key, bucket, q_len, causal, attn, fn, setup)
        if not self.hybrid:
            g.fill(ids, pos, slots, seq_lens, tables)
        else:  # graphed steps of B rows are verifies: their rows wait for commit_states
            rows = RecurrentRows([bm.slot(s.seq_id) for s in seqs], [s.num_computed_tokens == 0 for s in seqs],
                                 [q_len > 1] * len(seqs))
            g.fill(ids, pos, slots, seq_lens, tables,
                   recurrent=[(slot, int(f), int(k)) for slot, f, k in zip(rows.slots, rows.fresh, rows.keep)])
            self._name_rows(g, rows)
        return g

    def _name_rows(self, g: StepGraph, rows: RecurrentRows) -> None:
        """Hybrid targets: `rows` are the sequences of graph g's next replay, for every GDN layer."""
        captured = g.pending
        for i, state in self.states.items():
            state.step_rows = rows  # read by the layers when they run (off CUDA, every replay)
            if captured is not None:  # the captured step's kept inputs, now this step's
                captured[i].rows = rows
                state.pending = captured[i]

    def verify_rows(self, g: StepGraph, seqs: list[Sequence], bm: BlockManager) -> None:
        """Hybrid targets: graph g's next replay verifies `seqs` (each continuing from its state slot,
        its rows kept for the commit), the sequences past them padding; for a verify launched before
        the last one is read, whose requests changed (speculative/ahead.py)."""
        rows = RecurrentRows([bm.slot(s.seq_id) for s in seqs], [False] * len(seqs), [True] * len(seqs))
        g.fill(recurrent=[(slot, 0, 1) for slot in rows.slots] + [(-1, 0, 0)] * (g.num_seqs - len(seqs)))
        self._name_rows(g, rows)

    def ragged_graph(self, key: tuple, seqs: list[Sequence], tokens: list[list[int]],
                     bm: BlockManager) -> StepGraph | None:
        """The captured ragged graph (see capture_ragged_graphs) of the smallest buckets that hold
        this step, its inputs and metadata filled, ready to replay; None when there is none.
        Rows past the step's are padding: no sequence, slot -1, outputs to be cut."""
        n = sum(len(t) for t in tokens)
        rows = next((r for r in RAGGED_ROWS if r >= n), None)
        nseq = next((b for b in RAGGED_SEQS if b >= len(seqs)), None)
        g = self.ragged_graphs.get((key, nseq, rows))
        if g is None or not self.use_graphs:
            return None
        ids, pos, slots, qsl, seq_lens, tables = self.step_lists(seqs, tokens, bm)
        g.fill(ids, pos, slots, seq_lens, tables, query_start_loc=qsl)
        return g

    def capture_ragged_graphs(self, key: tuple, fn, max_seqs: int, max_rows: int) -> None:
        """Capture, before serving, a graph of step kind `key` (fn as in capture_graphs, causal)
        for every (sequences, rows) bucket a ragged step of up to max_seqs sequences and max_rows
        rows can use. An eager ragged step costs 15-40 ms of host time on a 30-layer model (a few
        hundred launches); its replay, well under 1 ms."""
        if not self.use_graphs or self.hybrid:  # hybrid targets: ragged steps run eagerly
            return
        most = min(max_seqs, self.max_graph_batch)
        seq_buckets = [b for b in RAGGED_SEQS if b < most] + [next((b for b in RAGGED_SEQS if b >= most),
                                                                    RAGGED_SEQS[-1])]
        row_buckets = [r for r in RAGGED_ROWS if r < max_rows] + [r for r in RAGGED_ROWS if r >= max_rows][:1]
        for rows in reversed(row_buckets):  # largest first: smaller graphs reuse its memory pool
            for nseq in reversed(seq_buckets):
                if (key, nseq, rows) in self.ragged_graphs:
                    continue
                g = StepGraph(fn, nseq, rows, self.max_blocks, self.block_size, self.device, causal=True,
                              max_seq_len=self.max_blocks * self.block_size, attn=[self.attn], num_rows=rows)
                g.fill(*self.ragged_placeholder(nseq, rows))
                g.capture(pool=self.graph_pool)
                self.ragged_graphs[(key, nseq, rows)] = g

    def ragged_placeholder(self, nseq: int, rows: int) -> tuple[list, ...]:
        """The step a ragged graph of (nseq, rows) is warmed up and captured over, as StepGraph.fill
        arguments: sequences of at most max_model_len rows each (positions from 0, every page read is
        page 0, nothing stored) over the rows, as far as nseq of them reach; rows past them are padding.
        A bucket's rows can outnumber what one sequence may hold (2,048 rows against a 512-token
        model): one sequence over every row would read the RoPE tables and the block table past
        their ends."""
        lens, left = [], rows
        while left > 0 and len(lens) < nseq:
            lens.append(min(self.max_model_len, left))
            left -= lens[-1]
        pos = [i for n in lens for i in range(n)] + [0] * left
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        return [0] * rows, pos, [-1] * rows, lens, [[0]] * len(lens), qsl

    def target_step(self, tap_layers: tuple[int, ...]):
        return lambda g: self.model(g.input_ids, g.positions, self.kv, self.attn, g.meta, tap_layers)

    def _graph(self, key: tuple, bucket: int, q_len: int, causal: bool, attn, fn, setup=None) -> StepGraph:
        """The graph of (key, bucket, q_len), captured on first use. setup(g), when given, runs
        once before the capture: it adds what fn needs beyond the standard buffers."""
        g = self.graphs.get((key, bucket, q_len))
        if g is None:  # captured over a placeholder step: launch shapes depend on the bucket only
            g = StepGraph(fn, bucket, q_len, self.max_blocks, self.block_size, self.device, causal=causal,
                          max_seq_len=self.max_blocks * self.block_size, attn=[attn], recurrent=self.hybrid)
            if setup is not None:
                setup(g)
            n = bucket * q_len
            g.fill([0] * n, [0] * n, [-1] * n, [q_len] * bucket, [[0]] * bucket)
            for state in self.states.values():
                state.pending = state.step_rows = None
            g.capture(pool=self.graph_pool)
            if self.device.type == "cuda" and any(s.pending is not None for s in self.states.values()):
                # a verify of the target: each GDN layer's record of the rows it keeps (views of the
                # state's kept-rows buffer), handed to the layer's state at every replay
                g.pending = {i: s.pending for i, s in self.states.items()}
                commit = self.capture_commit(g.pending, bucket)
                for state in self.states.values():
                    state.pending.commit_graph = commit
                    state.pending = None
            self.graphs[(key, bucket, q_len)] = g
        return g

    def capture_graphs(self, key: tuple, q_len: int, causal: bool, attn, fn, max_seqs: int, setup=None) -> None:
        """Capture every bucket a step of up to max_seqs sequences can use, largest first (so
        smaller graphs reuse its memory pool), before serving: no capture stalls mid-run. The
        shape is registered even with graphs off, for runners whose graphs are switched on later."""
        self.graph_shapes.add((key, q_len))
        if not self.use_graphs:
            return
        bucket = 1 << (min(max_seqs, self.max_graph_batch) - 1).bit_length()
        while bucket >= 1:
            self._graph(key, bucket, q_len, causal, attn, fn, setup)
            bucket //= 2

    def sampling_batch(self, seqs: list[Sequence], positions: list[int]) -> SamplingBatch:
        """One row per (seq, position) pair, in order. An all-greedy batch needs no tensors."""
        vocab = self.model.config.vocab_size
        dev = self.device
        temps = [s.params.temperature for s in seqs]
        if not any(temps):
            return SamplingBatch(None, None, None, None, None, all_greedy=True)
        top_k = [s.params.top_k if s.params.top_k > 0 else vocab for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        return SamplingBatch(
            temperature=to_device(temps, torch.float32, dev),
            top_k=to_device(top_k, torch.long, dev),
            top_p=to_device(top_p, torch.float32, dev),
            seeds=to_device([s.seed for s in seqs], torch.int64, dev),
            positions=to_device(positions, torch.int64, dev),
            all_greedy=False,
            any_top_k=any(k < vocab for k in top_k),
            any_top_p=any(p < 1.0 for p in top_p),
            min_p=to_device([s.params.min_p for s in seqs], torch.float32, dev)
            if any(s.params.min_p for s in seqs) else None,
        )
