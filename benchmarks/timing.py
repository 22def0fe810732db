"""What the benchmarks share: clocks (CUDA events on a GPU, the wall clock elsewhere), CUDA graphs of
repeated calls, the copy bandwidth every roofline divides by, what each kernel adds to a stream's span,
medians and percentiles, and the report each benchmark ends with: one table for a human and one JSON
line for a machine, carrying the device, torch, commit and date that a figure in docs/performance.md
names.

Scripts in benchmarks/ and benchmarks/device/ import it after putting the repository root and
benchmarks/ on sys.path (they run as `python benchmarks/[device/]NAME.py` from the root of a checkout or
of a copy of it). Progress goes to stderr (`log`); stdout holds the table and the JSON line."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
T0 = time.perf_counter()


def log(msg: str) -> None:
    """A progress line on stderr, with the wall time and the seconds since the script started."""
    print(f"[{time.strftime('%H:%M:%S')} +{time.perf_counter() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def short_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


def _on_cuda(device: torch.device | str | None) -> bool:
    if device is None:
        return torch.cuda.is_available()
    return torch.device(device).type == "cuda"


def sync(device: torch.device | str | None = None) -> None:
    if _on_cuda(device):
        torch.cuda.synchronize()


def cuda_ms(fn: Callable[[], object], n: int = 20, warmup: int = 1, device: torch.device | str | None = None
            ) -> float:
    """Milliseconds a call of fn over n back-to-back calls after `warmup` calls: CUDA events around the
    calls on a GPU (no sync between them), the wall clock elsewhere."""
    for _ in range(warmup):
        fn()
    sync(device)
    if not _on_cuda(device):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) * 1e3 / n
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


class Clock:
    """Milliseconds a call, as the median of `rounds` rounds of back-to-back calls (cuda_ms), each
    round sized to about round_s seconds from one probe call."""

    def __init__(self, device: torch.device | str, round_s: float = 0.2, rounds: int = 3):
        self.device = torch.device(device)
        self.round_s, self.rounds = round_s, rounds

    def sync(self) -> None:
        sync(self.device)

    def time(self, fn: Callable[[], object], warmup: int = 3, max_iters: int = 200) -> dict:
        probe = cuda_ms(fn, 1, warmup, self.device)
        iters = int(min(max_iters, max(3, self.round_s * 1e3 / max(probe, 1e-3))))
        runs = [cuda_ms(fn, iters, 0, self.device) for _ in range(self.rounds)]
        return {"ms": statistics.median(runs), "min_ms": min(runs), "iters": iters, "rounds": self.rounds}


def capture(fn: Callable[[], object], calls: int = 1) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` calls of fn, after one call on a side stream (allocations, compiles)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return g


def graph_ms(fn: Callable[[], object], clock: Clock, inner: int = 20) -> dict:
    """Milliseconds a call of fn with `inner` calls captured in one CUDA graph (no launch overhead),
    timed by `clock`; eagerly where the capture fails or off CUDA ("graph": False)."""
    fn()
    clock.sync()
    if clock.device.type == "cuda":
        try:
            g = capture(fn, inner)
            t = clock.time(g.replay, warmup=2, max_iters=50)
            del g
            return {"ms": t["ms"] / inner, "min_ms": t["min_ms"] / inner, "graph": True}
        except Exception as e:  # noqa: BLE001 (timed eagerly instead, and said so)
            log(f"  (graph capture failed, timing eagerly: {short_error(e)})")
            try:
                torch.cuda.synchronize()
            except Exception as e2:  # noqa: BLE001 (a failed capture can leave an error behind)
                log(f"  (synchronize after the failed capture: {short_error(e2)})")
    t = clock.time(fn, warmup=2)
    return {"ms": t["ms"], "min_ms": t["min_ms"], "graph": False}


def copy_bandwidth(device: torch.device | str, nbytes: int = 1 << 30, reps: int = 10) -> float | None:
    """Bytes per second of a device-to-device copy of `nbytes`, counting bytes read and written: the
    fastest of `reps` copies (None off CUDA). Every roofline here divides by it."""
    if not _on_cuda(device):
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(cuda_ms(lambda: dst.copy_(src), 1, 0, device) for _ in range(reps))
    return 2 * nbytes / (best / 1e3)


def kernel_spans(events) -> list[tuple[float, float, str]]:
    """(start, end, name) of the profiler's GPU kernels, in start order."""
    from torch.autograd import DeviceType

    return sorted(((e.time_range.start, e.time_range.end, e.key) for e in events
                   if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start), key=lambda k: k[0])


def critical_path(events, gap_us: float = 10.0) -> dict[str, float]:
    """Microseconds each kernel adds to the stream's span, summed by kernel name: its end minus the
    previous kernel's end (kernels of a stream end in order; with PDL a kernel starts before its
    predecessor ends, so its duration overstates what it adds). A kernel starting more than gap_us
    after the previous one ended (the next replay) adds its own duration."""
    out: dict[str, float] = {}
    prev_end = None
    for start, end, key in kernel_spans(events):
        add = end - start if prev_end is None or start - prev_end > gap_us else max(0.0, end - prev_end)
        out[key] = out.get(key, 0.0) + add
        prev_end = end if prev_end is None else max(prev_end, end)
    return out


def kernel_table(replay: Callable[[], object], replays: int = 10) -> tuple[list[dict], list]:
    """The kernels of `replays` calls of replay (a graph's), by the torch profiler: per kernel its
    microseconds a call, what it adds to the stream's span (critical_path) and its launches a call,
    the costliest first by what it adds; and the profiler's events."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    events = p.events()
    added = critical_path(events)
    rows = [{"kernel": e.key[:90], "us": round(e.device_time_total / replays, 1),
             "added_us": round(added.get(e.key, 0.0) / replays, 1), "calls": e.count / replays}
            for e in p.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r["added_us"])
    return rows, events


def median(xs: Iterable[float]) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None


def middle_median(xs: Sequence[float]) -> float | None:
    """The median of the middle half of a run's samples (past the prefill steps at its start and
    before the requests end one by one at its end): robust to a one-off stall."""
    return median(sorted(xs[len(xs) // 4: 3 * len(xs) // 4]))


def percentile(xs: Iterable[float], q: float) -> float:
    """The sample at rank q% (nearest rank); NaN without samples."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def run_info(device: torch.device | str | None = None) -> dict:
    """The conditions a figure names: device, torch (and Triton), commit and date (UTC). The commit is
    FLASHDRAFT_COMMIT where set (a copied tree may carry no .git, or a stale one), else git's HEAD, with
    `dirty` when the tree differs from it."""
    if _on_cuda(device):
        name = torch.cuda.get_device_name(torch.device(device or "cuda"))
    else:
        name = f"{os.cpu_count()}-core {platform.machine()} CPU"
    info = {"device": name, "torch": torch.__version__}
    if "triton" in sys.modules or _on_cuda(device):
        try:
            import triton

            info["triton"] = triton.__version__
        except ImportError:
            pass
    commit, dirty = os.environ.get("FLASHDRAFT_COMMIT"), None
    if not commit:
        try:
            git = ["git", "-C", str(ROOT)]
            commit = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    timeout=10).stdout.strip() or None
            if commit:
                dirty = bool(subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                                            capture_output=True, text=True, timeout=10).stdout.strip())
        except (OSError, subprocess.SubprocessError):
            commit = None
    info |= {"commit": commit, "dirty": dirty, "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat()}
    return info


def _cell(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float):
        return "nan" if v != v else f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3f}".rstrip("0").rstrip(".")
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, (list, tuple)):
        return " / ".join(_cell(x) for x in v)
    return str(v)


def table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """rows as a Markdown table (the form docs/performance.md keeps): `columns` (default: every key of
    the rows, in first-seen order), numbers right-aligned."""
    if columns is None:
        columns = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    numeric = [all(isinstance(r.get(c), (int, float)) or r.get(c) is None for r in rows) for c in columns]
    lines = ["| " + " | ".join(columns) + " |",
             "| " + " | ".join("---:" if n else "---" for n in numeric) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in cells]
    return "\n".join(lines)


def report(title: str, rows: Sequence[dict], record: dict, out: str | Path | None = None,
           columns: Sequence[str] | None = None, device: torch.device | str | None = None) -> dict:
    """The end of a benchmark: `title` and `rows` as a table, then `record` with run_info's conditions as
    one JSON line, both on stdout; the same JSON, indented, to `out` when given. Returns the record."""
    record = {**run_info(device), **record}
    print(title)
    print(table(rows, columns) if rows else "(no rows)")
    print(json.dumps(record, default=str), flush=True)
    if out:
        Path(out).write_text(json.dumps(record, indent=1, default=str))
    return record
