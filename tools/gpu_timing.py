"""CUDA-event timing shared by the GPU peer benchmarks (tools/bench_sdpa.py,
tools/bench_flashinfer.py): warm-up calls, then `repeats` timed calls, each after a write of the
`flush` buffer (larger than L2, so every repeat reads its operands from memory)."""
import torch


def time_it(fn, flush, warmup, repeats):
    """Median, 10th and 90th percentile of fn's time in microseconds."""
    for _ in range(warmup):
        fn()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    ts = []
    for i in range(repeats):
        flush.fill_(i & 0xFF)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        ts.append(1000.0 * start.elapsed_time(stop))
    ts.sort()
    return ts[len(ts) // 2], ts[len(ts) // 10], ts[(len(ts) * 9) // 10]
