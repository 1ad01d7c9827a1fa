"""CUDA-graph timing shared by the decode kernel benchmarks (bench_hc_fused.py,
bench_moe_fused.py): production decode runs in FULL cudagraphs, so both sides
of a comparison are timed as graph replays, launch overhead removed."""

import torch


def graph_us(step, calls: int, replays: int, warmup: int = 1) -> float:
    """Microseconds per call: step() issues `calls` calls (e.g. one per weight
    set or layer, more bytes than L2). It runs `warmup` times on a side stream
    (compiles, allocates), is captured once into a CUDA graph, replayed 3
    times, then CUDA events time `replays` replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(replays):
        graph.replay()
    b.record()
    torch.cuda.synchronize()
    del graph
    return a.elapsed_time(b) * 1e3 / (replays * calls)
