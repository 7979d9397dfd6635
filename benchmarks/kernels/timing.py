"""How the kernel benchmarks time a kernel: launches captured in one CUDA graph, replayed, timed
with CUDA events (`time_graph`); the GPU's SMs, L2 size and copy bandwidth, printed as a run's
first line (`device_header`). torch comes in as an argument: importing this loads nothing."""

from __future__ import annotations

DEVICE = "cuda"


def time_graph(torch, fns, graph_launches: int, warmup: int, replays: int) -> float:
    """Microseconds per launch: capture fns[i % len(fns)] for i < graph_launches, replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns:
            fn()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(graph_launches):
            fns[i % len(fns)]()
    for _ in range(warmup):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    us = start.elapsed_time(end) * 1e3 / (replays * graph_launches)
    del graph
    return us


def device_header(torch, copy_gib: float) -> tuple[int, int, float]:
    """(SMs, L2 bytes, copy bandwidth in bytes/s) of GPU 0, printed as the output's first line."""
    props = torch.cuda.get_device_properties(0)
    num_sms, l2_bytes = props.multi_processor_count, getattr(props, "L2_cache_size", 50 << 20)
    bandwidth = measure_hbm_bandwidth(torch, copy_gib)
    print(f"# {props.name}: {num_sms} SMs, L2 {l2_bytes >> 20} MiB, "
          f"copy bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    return num_sms, l2_bytes, bandwidth


def measure_hbm_bandwidth(torch, gib: float) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    reps = 10
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * reps / seconds
