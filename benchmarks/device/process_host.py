"""Host and GPU time of engine/logits.process() (repetition_penalty=1.1, frequency_penalty=0.3) over a
49,152-token vocabulary: 1 request x 1 row (a decode), 1 x 16 and 8 x 16 (verify blocks), each request with
a 200-token prompt and 100 output tokens; then torch.profiler over 20 calls of the one-row case (its GPU
time against its host time: launch-bound or not).

    python benchmarks/device/process_host.py [DEVICE]"""
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flashdraft.engine.logits import Seen, process  # noqa: E402
from flashdraft.engine.sequence import Sequence  # noqa: E402
from flashdraft.sampling_params import SamplingParams  # noqa: E402

V = 49152
dev = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
random.seed(0)


def case(S: int, R: int):
    """(call, seqs) of S requests x R rows; a chain's rows each see the block's rows before them."""
    seqs = []
    for _ in range(S):
        s = Sequence([random.randrange(V) for _ in range(200)], SamplingParams(repetition_penalty=1.1,
                                                                                 frequency_penalty=0.3))
        s.token_ids += [random.randrange(V) for _ in range(100)]
        seqs.append(s)
    rows = [s for s in seqs for _ in range(R)]
    pos = torch.tensor([s.num_tokens + j for s in seqs for j in range(R)], device=dev)
    ids = torch.randint(0, V, (S * R,), device=dev)
    pairs = [(r, (r // R) * R + d) for r in range(S * R) for d in range(1, r % R + 1)]
    seen = Seen([r for r, _ in pairs], [d for _, d in pairs], ids) if pairs else None
    logits = torch.randn(S * R, V, device=dev)
    return lambda: process(logits.clone(), rows, pos, [2], seen)


for S, R in ((1, 1), (1, 16), (8, 16)):
    fn = case(S, R)
    for _ in range(5):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(50):
        fn()
    host = (time.perf_counter() - t) / 50 * 1e3
    sync()
    total = (time.perf_counter() - t) / 50 * 1e3
    print(f"{S} x {R} rows: host {host:.3f} ms a call, host and device {total:.3f} ms")
fn = case(1, 1)
activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
with profile(activities=activities) as prof:
    for _ in range(20):
        fn()
    sync()
events = prof.key_averages()
print(f"1 x 1 rows under the profiler: host {sum(e.self_cpu_time_total for e in events) / 20e3:.3f} ms, "
      f"device {sum(e.self_device_time_total for e in events) / 20e3:.3f} ms a call")
