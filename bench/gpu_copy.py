"""GPU <-> pinned host copies of scattered KV blocks: kvtier's CUDA backend against one plain copy.

What is measured
    ``kvtier.transfers.cuda.CUDABackend`` moving a batch of blocks between a layer-outer KV
    cache on the GPU (per-layer views of one buffer, blocks along the second dimension, as vLLM
    keeps it) and the pinned host slab (``kvtier.tiers.host.HostSlab``, one contiguous run per slot):

    * store: GPU -> host, fragments of randomly chosen GPU blocks gathered into random host slots;
    * load:  host -> GPU, the reverse into other random GPU blocks;
    * both:  a store and a load of the same size submitted together (both copy engines at once).

    Fragment sizes 16 KiB and 64 KiB come with 32 fragments per block (16 layers, K and V split),
    256 KiB with 8, and 2 MiB is a block-outer layout (one 2 MiB fragment per block). Block ids are
    random on both sides, so no two fragments merge into one copy. Each method is measured on its
    own (``batch``: one cuMemcpyBatchAsync per job; ``kernel``: one copy-kernel launch; ``auto``:
    what kvtier picks), and the time is the whole job as a caller sees it, from ``submit`` until its
    completion callback ran.

Reference, measured in the same run
    One ``cudaMemcpyAsync`` of the same total bytes between a contiguous device buffer and the same
    pinned slab, on a non-blocking stream, timed the same way (call until the stream is idle); for
    both directions, one such copy per direction on two streams at once. Every figure is the median
    of the repetitions (at least ``--repeat``, and at least ``--min-seconds`` of copying), kvtier and
    reference repetitions interleaved.

SM interference
    A copy kernel uses SMs the model needs; DMA does not. The bench times a bf16 matrix-product loop
    alone, then while 16 KiB-fragment stores run back to back with each method, and reports the
    products' slowdown and the bandwidth the copies got meanwhile. (These stores are told to order
    after an idle stream; ordered after the products' stream, as a store of freshly computed blocks
    must be, they would wait for the products instead of running beside them.)

Correctness: after every variant, 16 random blocks of each job are checked bit for bit (host bytes
against the GPU fragments they came from, GPU blocks against the host slots they were loaded from).

The last line is one JSON object: ``ratio`` is the smallest one-way kvtier/reference ratio over all
fragment sizes at batches of at least ``--bandwidth-batch`` blocks (where bandwidth, not the fixed
cost of a call, decides), with every row of the table beside it.

Where the time goes (``--phases``): for jobs of ``--bandwidth-batch`` blocks, per fragment size,
direction and method, the CPU time in ``submit``, the copies alone on the GPU (the job held back behind
a sleeping kernel until all of it is enqueued), the time the GPU waited for the host, and the hand-off
from the GPU's end to the completion callback, with the completion waited for by spinning and by
sleeping; and a profile of ``submit``'s own CPU time by function. Its JSON holds those rows.

Run: ``python bench/gpu_copy.py [--batches 1,16,256,4096] [--repeat 5]`` on a machine with CUDA;
``python bench/gpu_copy.py --phases --fragments 16384,65536 --methods kernel,batch``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import threading
import time

import numpy as np

from kvtier.transfers.cuda import CUDABackend, cuda_available

KIB, MIB = 1024, 1024 * 1024
FRAGMENTS_PER_BLOCK = {16 * KIB: 32, 64 * KIB: 32, 256 * KIB: 8, 2 * MIB: 1}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="1,16,256,4096", help="blocks per job, comma separated")
    parser.add_argument("--fragments", default="16384,65536,262144,2097152", help="fragment sizes in bytes")
    parser.add_argument("--methods", default="batch,kernel,auto")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=0.2)
    parser.add_argument("--bandwidth-batch", type=int, default=256)
    parser.add_argument("--pool-bytes", type=int, default=16 * 1024 * MIB, help="GPU buffer and host slab size")
    parser.add_argument(
        "--phases",
        action="store_true",
        help="instead of the table: where the time of a --bandwidth-batch job goes (submit, GPU, waits, hand-off)",
    )
    return parser.parse_args()


class Rig:
    """One GPU buffer and one pinned host slab, reused for every fragment size."""

    def __init__(self, pool_bytes: int) -> None:
        import cupy
        import torch

        from kvtier.core.layout import BlockLayout
        from kvtier.tiers import host_pinning
        from kvtier.tiers.host import HostSlab

        self.cupy, self.torch = cupy, torch
        self.gpu = torch.empty(pool_bytes, dtype=torch.uint8, device="cuda")
        self.gpu.copy_(torch.randint(0, 256, (pool_bytes,), dtype=torch.uint8, device="cuda"))
        host_pinning.CHUNK_BYTES = max(host_pinning.CHUNK_BYTES, pool_bytes)  # one registration: the
        self.slab = HostSlab(pool_bytes // MIB, BlockLayout.contiguous(MIB))  # reference copies span it
        if not self.slab.pinned:
            sys.exit("could not pin the host slab")
        self.pool_bytes = pool_bytes
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.other_stream = cupy.cuda.Stream(non_blocking=True)

    def storages(self, fragment: int):
        """GPU storage (fragment f of block b at f * blocks * fragment + b * fragment) and host storage."""
        from kvtier.core.layout import BlockLayout
        from kvtier.core.storage import StridedStorage, contiguous_storage

        frags = FRAGMENTS_PER_BLOCK[fragment]
        layout = BlockLayout((fragment,) * frags)
        blocks = self.pool_bytes // layout.block_bytes
        base = self.gpu.data_ptr()
        gpu = StridedStorage(
            layout, blocks, [base + f * blocks * fragment for f in range(frags)], [fragment] * frags, "cuda", self.gpu
        )
        host = contiguous_storage(self.slab.address, blocks, layout, "cpu", self.slab)
        return layout, gpu, host

    def reference(self, nbytes: int, direction: str) -> float:
        """Seconds for one cudaMemcpyAsync (two, one per direction, for "both") of ``nbytes`` each."""
        runtime = self.cupy.cuda.runtime
        gpu, host = self.gpu.data_ptr(), self.slab.address
        start = time.perf_counter()
        if direction in ("store", "both"):
            runtime.memcpyAsync(host, gpu, nbytes, 4, self.stream.ptr)
        if direction in ("load", "both"):
            half = self.pool_bytes // 2 if direction == "both" else 0
            runtime.memcpyAsync(gpu + half, host + half, nbytes, 4, self.other_stream.ptr)
        self.stream.synchronize()
        self.other_stream.synchronize()
        return time.perf_counter() - start


def run_job(backend, transfers) -> float:
    """Seconds from submitting ``transfers`` until every completion callback ran."""
    left = [len(transfers)]
    done = threading.Event()
    lock = threading.Lock()
    failures: list[set[int]] = []

    def finished(failed: set[int]) -> None:
        with lock:
            if failed:
                failures.append(failed)
            left[0] -= 1
            if not left[0]:
                done.set()

    start = time.perf_counter()
    for transfer in transfers:
        backend.submit(transfer, finished)
    if not done.wait(120):
        sys.exit("a transfer never completed")
    elapsed = time.perf_counter() - start
    if failures:
        sys.exit(f"TRANSFER FAILURE: blocks {failures}")
    return elapsed


def make_transfers(rig: Rig, fragment: int, batch: int, direction: str, rng):
    from kvtier.core.transfer import Transfer

    layout, gpu, host = rig.storages(fragment)
    n = gpu.num_slots
    gpu_ids, host_ids = rng.permutation(n), rng.permutation(n)
    store = Transfer(gpu, gpu_ids[:batch].tolist(), host, host_ids[:batch].tolist())
    load = Transfer(host, host_ids[batch : 2 * batch].tolist(), gpu, gpu_ids[batch : 2 * batch].tolist())
    return layout, {"store": [store], "load": [load], "both": [store, load]}[direction]


def verify(rig: Rig, layout, transfer, rng, sample: int = 16) -> None:
    """Up to ``sample`` random blocks of ``transfer`` are equal on both sides, fragment by fragment."""
    src = transfer.src.fragment_addresses(transfer.src_slots)
    dst = transfer.dst.fragment_addresses(transfer.dst_slots)
    gpu_base, host_base = rig.gpu.data_ptr(), rig.slab.address
    for i in rng.permutation(transfer.num_blocks)[:sample].tolist():
        for f, size in enumerate(layout.fragment_bytes):
            sides = []
            for address, device in ((src[i, f], transfer.src.device), (dst[i, f], transfer.dst.device)):
                if device == "cuda":
                    offset = int(address) - gpu_base
                    sides.append(rig.gpu[offset : offset + size].cpu().numpy())
                else:
                    offset = int(address) - host_base
                    sides.append(rig.slab.array[offset : offset + size])
            if not np.array_equal(*sides):
                sys.exit(f"CORRECTNESS FAILURE: block {i} fragment {f} differs after the copy")


def measure(rig: Rig, backends: dict, args, rng) -> list[dict]:
    rows = []
    for fragment in [int(f) for f in args.fragments.split(",")]:
        for batch in [int(b) for b in args.batches.split(",")]:
            for direction in ("store", "load", "both"):
                layout, transfers = make_transfers(rig, fragment, batch, direction, rng)
                if 2 * batch * layout.block_bytes > rig.pool_bytes:
                    continue
                nbytes = batch * layout.block_bytes
                row = {
                    "fragment_kib": fragment // KIB,
                    "blocks": batch,
                    "direction": direction,
                    "job_mib": nbytes * len(transfers) / MIB,
                }
                for name, backend in backends.items():
                    times, reference = [], []
                    run_job(backend, transfers)  # warm-up (kernel compile, first-touch of the pool)
                    started = time.perf_counter()
                    while len(times) < args.repeat or time.perf_counter() - started < args.min_seconds:
                        times.append(run_job(backend, transfers))
                        reference.append(rig.reference(nbytes, direction))
                        if len(times) >= 200:
                            break
                    run_job(backend, transfers)  # the reference copies overwrote these bytes: copy again, check
                    for transfer in transfers:
                        verify(rig, layout, transfer, rng)
                    moved = nbytes * len(transfers)
                    row[f"{name}_gbs"] = moved / statistics.median(times) / 1e9
                    row.setdefault("reference_gbs", []).append(moved / statistics.median(reference) / 1e9)
                row["reference_gbs"] = statistics.median(row["reference_gbs"])
                for name in backends:
                    row[f"{name}_ratio"] = row[f"{name}_gbs"] / row["reference_gbs"]
                rows.append(row)
                print(
                    " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True
                )
    return rows


def interference(rig: Rig, rng) -> dict:
    """A bf16 matrix-product loop alone, then while 16 KiB-fragment stores run back to back with each
    method: the products' slowdown and the copies' bandwidth meanwhile."""
    torch = rig.torch
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")

    def products() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(100):
            a @ a
        torch.cuda.synchronize()
        return time.perf_counter() - start

    products()
    result = {"matmul_alone_s": min(products() for _ in range(3))}
    _, transfers = make_transfers(rig, 16 * KIB, 256, "store", rng)
    job_bytes = transfers[0].nbytes
    idle = rig.cupy.cuda.Stream(non_blocking=True)  # stores wait for this stream, not for the products
    for name in ("batch", "kernel"):
        backend = CUDABackend(name, compute_stream=idle)
        stop = threading.Event()
        jobs = [0]

        def copy_forever(backend: CUDABackend, stop: threading.Event, jobs: list[int]) -> None:
            while not stop.is_set():
                run_job(backend, transfers)
                jobs[0] += 1

        copier = threading.Thread(target=copy_forever, args=(backend, stop, jobs))
        copier.start()
        time.sleep(0.05)
        before = jobs[0]
        seconds = products()
        copied = (jobs[0] - before) * job_bytes
        stop.set()
        copier.join()
        backend.close()
        result[f"matmul_slowdown_{name}"] = seconds / result["matmul_alone_s"]
        result[f"copy_gbs_during_matmul_{name}"] = copied / seconds / 1e9
    return result


def job_phases(rig: Rig, backend: CUDABackend, transfer, hold, profile: cProfile.Profile | None = None) -> dict:
    """One job's time split (ms): ``submit`` (CPU in submit), ``gpu`` (the copies alone: the job is held
    back until submit has enqueued all of it), ``to_gpu_done`` (from submit until the GPU finished, not
    held), ``waits_for_host`` (to_gpu_done - gpu: the GPU idle while Python prepared pieces) and
    ``hand_off`` (from the GPU finishing until the completion callback ran)."""
    cupy, torch = rig.cupy, rig.torch
    lane = backend._lanes["load" if transfer.src.device == "cpu" else "store"].stream
    marker, held_stream = cupy.cuda.Stream(non_blocking=True), cupy.cuda.ExternalStream(hold.cuda_stream)
    begin, end = cupy.cuda.Event(), cupy.cuda.Event()
    done = threading.Event()
    finished_at = [0.0]

    def finished(failed: set[int]) -> None:
        finished_at[0] = time.perf_counter()
        done.set()

    start = time.perf_counter()
    begin.record(marker)
    if profile is not None:
        profile.enable()
    backend.submit(transfer, finished)
    if profile is not None:
        profile.disable()
    submitted = time.perf_counter()
    end.record(lane)
    done.wait(60)
    end.synchronize()
    wall = (finished_at[0] - start) * 1e3
    to_gpu_done = cupy.cuda.get_elapsed_time(begin, end)
    done.clear()
    with torch.cuda.stream(hold):
        torch.cuda._sleep(100_000_000)  # ~50 ms: submit enqueues the whole job before any of it runs
    begin.record(held_stream)
    backend.submit(transfer, finished)
    end.record(lane)
    done.wait(60)
    end.synchronize()
    gpu = cupy.cuda.get_elapsed_time(begin, end)
    return {
        "wall": wall,
        "submit": (submitted - start) * 1e3,
        "gpu": gpu,
        "to_gpu_done": to_gpu_done,
        "waits_for_host": to_gpu_done - gpu,
        "hand_off": wall - to_gpu_done,
    }


def phases(rig: Rig, args, rng) -> list[dict]:
    """Where the time of a job of ``--bandwidth-batch`` blocks goes, per fragment size, direction and
    method, with the completion waited for by spinning and by sleeping (``SPIN_BELOW_BYTES``, set here)."""
    import kvtier.transfers.cuda as cuda_transfer

    hold = rig.torch.cuda.Stream()
    default_spin = cuda_transfer.SPIN_BELOW_BYTES
    rows = []
    for fragment in [int(f) for f in args.fragments.split(",")]:
        for direction in ("store", "load"):
            _, (transfer,) = make_transfers(rig, fragment, args.bandwidth_batch, direction, rng)
            reference = statistics.median(rig.reference(transfer.nbytes, direction) for _ in range(7)) * 1e3
            for spin in (True, False):
                cuda_transfer.SPIN_BELOW_BYTES = 1 << 50 if spin else 0
                for method in args.methods.split(","):
                    backend = CUDABackend(method, compute_stream=hold)
                    job_phases(rig, backend, transfer, hold)  # warm-up
                    profile = cProfile.Profile()
                    runs = [job_phases(rig, backend, transfer, hold, profile) for _ in range(args.repeat)]
                    backend.close()
                    if spin:  # where submit's CPU time goes, per call
                        print(f"submit, {fragment // KIB} KiB {direction} {method}, {args.repeat} calls, by own time:")
                        pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(8)
                    row = {"fragment_kib": fragment // KIB, "direction": direction, "method": method, "spin": spin}
                    row |= {"reference": reference} | {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                    row["ratio"] = reference / row["wall"]
                    rows.append(row)
                    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    cuda_transfer.SPIN_BELOW_BYTES = default_spin
    return rows


def print_table(rows: list[dict], methods: list[str]) -> None:
    header = ["frag KiB", "blocks", "dir", "MiB", "ref GB/s"] + [f"{m} GB/s (ratio)" for m in methods]
    print("  ".join(f"{h:>16}" for h in header))
    for row in rows:
        cells = [
            row["fragment_kib"],
            row["blocks"],
            row["direction"],
            f"{row['job_mib']:.1f}",
            f"{row['reference_gbs']:.1f}",
        ]
        cells += [f"{row[m + '_gbs']:.1f} ({row[m + '_ratio']:.2f})" for m in methods]
        print("  ".join(f"{c:>16}" for c in cells))


def main() -> None:
    args = parse_args()
    if not cuda_available():
        sys.exit("bench/gpu_copy.py needs CuPy and a CUDA GPU")
    rng = np.random.default_rng(0)
    rig = Rig(args.pool_bytes)
    methods = args.methods.split(",")
    backends = {m: CUDABackend(m) for m in methods}
    import torch

    print(f"device: {torch.cuda.get_device_name()}; kvtier CUDABackend vs one cudaMemcpyAsync of the same bytes")
    if args.phases:
        rows = phases(rig, args, rng)
        best = max(rows, key=lambda r: r["ratio"])
        print(
            json.dumps(
                {
                    "ratio": min(r["ratio"] for r in rows),
                    "best": best,
                    "device": torch.cuda.get_device_name(),
                    "rows": rows,
                }
            )
        )
        return
    rows = measure(rig, backends, args, rng)
    print_table(rows, methods)
    sm = interference(rig, rng)
    print("SM interference:", json.dumps(sm))
    one_way = [r for r in rows if r["direction"] != "both" and r["blocks"] >= args.bandwidth_batch]
    both_2mib = [r for r in rows if r["direction"] == "both" and r["fragment_kib"] == 2048]
    headline = "auto" if "auto" in methods else methods[0]
    print(
        json.dumps(
            {
                "ratio": min(r[f"{headline}_ratio"] for r in one_way) if one_way else None,
                "method": headline,
                "ratio_all_batches": min(r[f"{headline}_ratio"] for r in rows if r["direction"] != "both"),
                "both_directions_2mib_gbs": max((r[f"{headline}_gbs"] for r in both_2mib), default=None),
                "device": torch.cuda.get_device_name(),
                "sm_interference": sm,
                "rows": rows,
            }
        )
    )
    for backend in backends.values():
        backend.close()


if __name__ == "__main__":
    main()
