"""CUDA-event timing shared by the GPU peer benchmarks (tools/bench_sdpa.py,
tools/bench_flashinfer.py): warm-up calls, then `repeats` timed calls, each after a pass over the
`flush` buffer (larger than L2, so every repeat reads its operands from memory).

The flush mode matches bench/cuda_decode_attention.cu's --flush: "read" (the default) reads the
buffer, leaving L2 full of clean lines, as a decode step's projections (which read weights) leave
it; "write" fills it, the protocol before session 19, which leaves L2 full of dirty lines that the
timed call writes back while it reads (an extra cost that grows with L2's size, not the call's)."""
import torch


def flush_l2(flush, i, mode="read"):
    """Evicts L2: reads (mode "read") or writes (mode "write") every byte of flush."""
    if mode == "write":
        flush.fill_(i & 0xFF)
    elif mode == "read":
        # a reduction over the buffer as int32 words: reads all of it, writes one scalar
        flush.view(torch.int32).sum(dtype=torch.int64)
    else:
        raise ValueError(f"flush mode: expected 'read' or 'write' but got {mode!r}")


def time_it(fn, flush, warmup, repeats, mode="read"):
    """Median, 10th and 90th percentile of fn's time in microseconds."""
    for _ in range(warmup):
        fn()
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    ts = []
    for i in range(repeats):
        flush_l2(flush, i, mode)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        ts.append(1000.0 * start.elapsed_time(stop))
    ts.sort()
    return ts[len(ts) // 2], ts[len(ts) // 10], ts[(len(ts) * 9) // 10]
