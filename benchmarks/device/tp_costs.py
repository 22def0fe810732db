"""What tensor parallelism adds to a step, measured on the GPUs of one host: the all-reduces and the
logits' all-gather of one target step over N ranks (NCCL, inside a CUDA graph, as the engine replays
them), and a sharded against a whole DFlash drafter's weight GEMMs.

- all-reduce: a step of an L-layer target sums two [rows, hidden] activations a layer (o_proj's and
  down_proj's outputs): 2L all-reduces in one graph, timed per replay, for each row count (decode: the
  batch; a DFlash verify: batch x block).
- all-gather: the LM head's [rows, vocab / N] shares, once a step.
- symmetric memory (CUDA): the same 2L all-reduces through torch's one-shot all-reduce over symmetric memory
  (peer loads over NVLink, no multicast), where this torch has it; an error is recorded, not raised.
- engine path (CUDA): 2L all-reduces as a step makes them, each of a message a kernel has just written
  (TPGroup.all_reduce after a scale), through NCCL and through the engine's one-shot all-reduce
  (models/parallel.py). Back-to-back collectives on one buffer, as above, cost NCCL more than a step pays.
- drafter: its layers' GEMMs (q/k/v, o, gate/up, down) at the draft's rows (batch x block), whole on one
  GPU against one rank's share (heads and intermediate size / N) plus the 2 x layers all-reduces that a
  sharded drafter adds. Attention itself (split by heads, short context) is left out of both.

    python benchmarks/device/tp_costs.py --tp 2 --target qwen3-8b --out tp_costs.json
    python benchmarks/device/tp_costs.py --tp 2 --device cpu       # smoke test (gloo, no graphs)

Prints a table and one JSON line (also written to --out).
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from timing import capture, cuda_ms, log, report  # noqa: E402

SHAPES = {  # hidden, layers, vocab, heads, kv heads, head dim, intermediate (drafter: 5 layers of the target's)
    "qwen3-8b": (4096, 36, 151936, 32, 8, 128, 12288),
    "llama-3-70b": (8192, 80, 128256, 64, 8, 128, 28672),
    "tiny": (256, 4, 1000, 4, 2, 64, 512),
}


def timed(fn, device: torch.device, replays: int, together: bool = True) -> float:
    """ms per call of fn: its CUDA graph replayed (CPU: called); together: every rank times it at once."""
    if device.type != "cuda":
        return cuda_ms(fn, replays, 1, device)
    g = capture(fn)
    g.replay()
    if together:
        dist.barrier()
    return cuda_ms(g.replay, replays, 0, device)


def symm_mem_ms(rows: int, hidden: int, count: int, dtype, device: torch.device, replays: int):
    """ms for `count` one-shot all-reduces of [rows, hidden] over symmetric memory, or the error's text."""
    if device.type != "cuda":
        return None
    try:
        import torch.distributed._symmetric_memory as symm_mem

        name = dist.group.WORLD.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):
            symm_mem.enable_symm_mem_for_group(name)
        x = symm_mem.empty(rows, hidden, dtype=dtype, device=device)
        symm_mem.rendezvous(x, name)
        x.normal_()

        def reduces():
            for _ in range(count):
                torch.ops.symm_mem.one_shot_all_reduce(x, "sum", name)
        return timed(reduces, device, replays)
    except Exception as e:  # noqa: BLE001 (recorded: this torch or host may not have it)
        return f"{type(e).__name__}: {str(e)[:200]}"


def run(rank: int, size: int, port: int, args, out: dict) -> None:
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=size, timeout=datetime.timedelta(seconds=300))
    H, L, V, heads, kv, hd, inter = SHAPES[args.target]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows_list = [int(r) for r in args.rows.split(",")]
    result = {"all_reduce_ms": {}, "all_gather_ms": {}, "symm_mem_all_reduce_ms": {}, "drafter": {}}
    share = -(-V // size)
    if device.type == "cuda":
        from flashdraft.models.parallel import TPGroup, one_shot_or_none

        one_shot = one_shot_or_none(device, size)
        groups = [("nccl", TPGroup(rank, size)), ("one_shot", TPGroup(rank, size, one_shot=one_shot))]
    for rows in rows_list:
        x = torch.randn(rows, H, device=device, dtype=dtype)

        def reduces(x=x):
            for _ in range(2 * L):
                dist.all_reduce(x)
        result["all_reduce_ms"][rows] = timed(reduces, device, args.replays)
        part = torch.randn(rows, share, device=device, dtype=dtype)
        parts = [torch.empty_like(part) for _ in range(size)]
        result["all_gather_ms"][rows] = timed(lambda p=parts, x=part: dist.all_gather(p, x), device, args.replays)
        result["symm_mem_all_reduce_ms"][rows] = symm_mem_ms(rows, H, 2 * L, dtype, device, args.replays)
        if device.type == "cuda":  # the engine's path (TPGroup.all_reduce): each message made by a kernel first
            for name, tp in groups:
                def made(x=x, tp=tp):
                    h = x
                    for _ in range(2 * L):
                        h = tp.all_reduce(h * 0.5)
                result.setdefault(f"engine_{name}_ms", {})[rows] = timed(made, device, args.replays)
            if rank == 0:
                log(f"rows {rows}: engine path, 2L (scale + all-reduce): nccl "
                    f"{result['engine_nccl_ms'][rows]:.3f} ms, one-shot {result['engine_one_shot_ms'][rows]:.3f} ms")
        if rank == 0:
            log(f"rows {rows}: 2L all-reduces {result['all_reduce_ms'][rows]:.3f} ms (symmetric memory: "
                f"{result['symm_mem_all_reduce_ms'][rows]}), all-gather {result['all_gather_ms'][rows]:.3f} ms")
    # the drafter: 5 layers of the target's width, its GEMMs whole (rank 0 alone) and as one rank's share
    layers = 5
    for rows in (int(r) for r in args.draft_rows.split(",")):
        def gemms(n: int, reduce: bool, rows: int = rows):
            q, k, i = heads * hd // n, kv * hd // n, inter // n
            ws = [torch.randn(q + 2 * k, H, device=device, dtype=dtype) * 0.02,
                  torch.randn(H, q, device=device, dtype=dtype) * 0.02,
                  torch.randn(2 * i, H, device=device, dtype=dtype) * 0.02,
                  torch.randn(H, i, device=device, dtype=dtype) * 0.02]
            x = torch.randn(rows, H, device=device, dtype=dtype)

            def step():
                h = x
                for _ in range(layers):
                    a = torch.nn.functional.linear(torch.nn.functional.linear(h, ws[0])[:, :q], ws[1])
                    if reduce:
                        dist.all_reduce(a)
                    m = torch.nn.functional.linear(torch.nn.functional.linear(a, ws[2])[:, :i], ws[3])
                    if reduce:
                        dist.all_reduce(m)
                    h = m
            return step
        whole = timed(gemms(1, False), device, args.replays, together=False) if rank == 0 else None
        dist.barrier()
        sharded = timed(gemms(size, True), device, args.replays)
        result["drafter"][rows] = {"whole_ms": whole, "sharded_ms": sharded}
        if rank == 0:
            log(f"drafter rows {rows}: whole {whole:.3f} ms, sharded {sharded:.3f} ms")
    if rank == 0:
        out.update(result)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--target", default="qwen3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", default="1,8,32,16,128,512")
    ap.add_argument("--draft-rows", default="16,128,512")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.device == "cpu" and args.target != "tiny":
        args.target = "tiny"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    manager = mp.get_context("spawn").Manager()
    out = manager.dict()
    mp.start_processes(run, args=(args.tp, port, args, out), nprocs=args.tp, start_method="spawn")
    result = {"bench": "tp_costs", "tp": args.tp, "target": args.target, "shape": SHAPES[args.target], **dict(out)}
    keys = ("all_reduce_ms", "symm_mem_all_reduce_ms", "engine_nccl_ms", "engine_one_shot_ms", "all_gather_ms")
    rows = [{"rows": r, **{k.removesuffix("_ms"): result.get(k, {}).get(r) for k in keys}}
            for r in result.get("all_reduce_ms", {})]
    rows += [{"rows": r, "drafter whole": d["whole_ms"], "drafter sharded": d["sharded_ms"]}
             for r, d in result.get("drafter", {}).items()]
    report(f"TP {args.tp}, {args.target}: ms for a step's 2L all-reduces, its all-gather, the drafter's GEMMs",
           rows, result, args.out, device=args.device)


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast: not available on these hosts
    main()
