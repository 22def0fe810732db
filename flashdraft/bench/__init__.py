"""`flashdraft bench`: plain vs DFlash throughput, latency and acceptance over a concurrency sweep, in
process or against a running server. See `command.cmd_bench`."""

from __future__ import annotations

from flashdraft.bench.command import add_bench_args, cmd_bench

__all__ = ["add_bench_args", "cmd_bench"]
