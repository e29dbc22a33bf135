"""A stack's lifetime: close() called from a future's done-callback (one of kvtier's own threads)
returns at once and everything is released right after the callback; a stack dropped without close()
is released by its finalizer with a ResourceWarning; a stack still open when the interpreter exits
neither hangs nor crashes the exit. Real stacks (host over disk), real bytes, real threads and files:
"released" means no thread kvtier started is left and the disk directory opens again."""

from __future__ import annotations

import contextlib
import gc
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier import ClosedError, KVTier, StateError
from kvtier.tiers.disk.transfer import DiskBackend
from kvtier.transfers.cpu import CPUBackend

BLOCK = 1 << 20  # 1 MiB: a copy lasts long enough for the test to attach its done-callback before it lands
TOKENS = list(range(16))  # four blocks of four tokens


def config(directory, placement: str = "write_back") -> dict:
    return {
        "block_tokens": 4,
        "block_bytes": "1MiB",
        "namespace": "lifecycle",
        "placement": placement,
        "tiers": [
            {"medium": "host", "capacity_blocks": 8},
            {"medium": "disk", "capacity_blocks": 16, "path": str(directory)},
        ],
    }


def blocks(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (4, BLOCK), dtype=np.uint8)


@contextlib.contextmanager
def copies_held(kv: KVTier) -> Iterator[None]:
    """Every thread that runs the stack's copies (the CPU backend's, the disk backend's jobs) kept busy
    until the block ends: a copy submitted inside waits for them, so a done-callback attached right after
    the call runs on a kvtier thread, however loaded the machine (else the copy may be over before the
    callback is attached, which then runs on the caller's thread)."""
    gate = threading.Event()
    pools = []
    for backend in kv.stack.transfers.backends:
        if isinstance(backend, CPUBackend):
            pools.append(backend._pool)
        elif isinstance(backend, DiskBackend):
            pools.append(backend._jobs)
    busy = [pool.submit(gate.wait, 10) for pool in pools for _ in range(pool._max_workers)]
    try:
        yield
    finally:
        gate.set()
        for waiting in busy:
            waiting.result()


def new_threads(before: set[threading.Thread]) -> list[str]:
    return [t.name for t in threading.enumerate() if t not in before]


def wait_for_threads_to_end(before: set[threading.Thread], seconds: float = 1.0) -> list[str]:
    """Names of threads started since ``before`` that are still alive after ``seconds`` (none: released)."""
    deadline = time.monotonic() + seconds
    while new_threads(before) and time.monotonic() < deadline:
        time.sleep(0.01)
    return new_threads(before)


def assert_directory_holds(directory, data: np.ndarray) -> None:
    """A new KVTier opens the directory (the old one's lock is gone) and loads ``data`` from disk, bit-exact."""
    with KVTier.open(config(directory)) as again:
        assert again.locate(TOKENS).tiers == ("disk",) * 4
        out = np.zeros_like(data)
        assert again.load(TOKENS, out).result(10).loaded == 4
        assert np.array_equal(out, data)


class CloseInCallback:
    """A done-callback that closes the KVTier and records on which thread, how long close() took and
    what it raised."""

    def __init__(self, kv: KVTier, linger: float = 0.0) -> None:
        self.kv, self.linger = kv, linger
        self.closed = threading.Event()  # close() returned
        self.returned = threading.Event()  # the whole callback returned
        self.thread: threading.Thread | None = None
        self.seconds = float("inf")
        self.error: BaseException | None = None

    def __call__(self, _future) -> None:
        self.thread = threading.current_thread()
        start = time.monotonic()
        try:
            self.kv.close()
        except BaseException as exc:
            self.error = exc
        self.seconds = time.monotonic() - start
        self.closed.set()
        time.sleep(self.linger)
        self.returned.set()

    def assert_closed_at_once(self) -> None:
        assert self.returned.wait(5), "close() in a done-callback hung"
        assert self.thread is not threading.main_thread(), "the callback must run on a kvtier thread to test this"
        assert self.error is None
        assert self.seconds < 1.0


def assert_refuses_new_calls(kv: KVTier, data: np.ndarray) -> None:
    with pytest.raises(ClosedError):
        kv.store(TOKENS, data)
    with pytest.raises(ClosedError):
        kv.load(TOKENS, np.zeros_like(data))
    with pytest.raises(ClosedError):
        kv.lookup(TOKENS)


@pytest.mark.parametrize("source", ["host", "disk"])  # completions on a CPU copy thread, on a disk job thread
def test_close_in_a_load_callback_returns_at_once_and_releases_right_after(tmp_path, source):
    data = blocks()
    if source == "disk":
        with KVTier.open(config(tmp_path)) as kv:
            kv.store(TOKENS, data).result(10)  # close() copies them down: the next stack finds them on disk only
    before = set(threading.enumerate())
    kv = KVTier.open(config(tmp_path))
    if source == "host":
        kv.store(TOKENS, data).result(10)
    assert kv.locate(TOKENS).tiers == (source,) * 4
    out = np.zeros_like(data)
    callback = CloseInCallback(kv)
    with copies_held(kv):
        kv.load(TOKENS, out).add_done_callback(callback)
    callback.assert_closed_at_once()
    assert np.array_equal(out, data), "the load itself completed"
    assert_refuses_new_calls(kv, data)
    assert wait_for_threads_to_end(before) == []
    assert_directory_holds(tmp_path, data)


def test_close_in_a_store_callback_releases_after_copying_the_blocks_to_disk(tmp_path):
    before = set(threading.enumerate())
    kv = KVTier.open(config(tmp_path))  # write_back: the stored blocks are in the host tier only
    data = blocks(1)
    callback = CloseInCallback(kv)
    with copies_held(kv):
        kv.store(TOKENS, data).add_done_callback(callback)
    callback.assert_closed_at_once()
    assert_refuses_new_calls(kv, data)
    assert wait_for_threads_to_end(before) == []
    assert_directory_holds(tmp_path, data)  # the release copied them down, as a close() on the caller's thread does


def test_a_second_close_waits_for_the_release_a_callback_began(tmp_path):
    before = set(threading.enumerate())
    kv = KVTier.open(config(tmp_path))
    data = blocks(2)
    kv.store(TOKENS, data).result(10)
    callback = CloseInCallback(kv, linger=0.3)  # the release cannot begin before the callback returns
    with copies_held(kv):
        kv.load(TOKENS, np.zeros_like(data)).add_done_callback(callback)
    assert callback.closed.wait(5)
    kv.close()  # still inside the callback's linger: must wait for the release, not return at once
    assert callback.returned.is_set()
    assert_directory_holds(tmp_path, data)  # at once: the disk tier is closed and its lock gone
    assert wait_for_threads_to_end(before) == []
    callback.assert_closed_at_once()


def wait_idle_in_a_done_callback(directory) -> tuple[threading.Thread, list[BaseException]]:
    """A store whose done-callback calls wait_idle: the thread the callback ran on, and what it raised."""
    raised: list[BaseException] = []
    threads: list[threading.Thread] = []

    def wait_here(_future) -> None:
        threads.append(threading.current_thread())
        try:
            kv.wait_idle()
        except StateError as exc:
            raised.append(exc)

    with KVTier.open(config(directory)) as kv:
        with copies_held(kv):
            kv.store(TOKENS, blocks(4)).add_done_callback(wait_here)
        kv.wait_idle(5)  # on the old code the callback waits for its own job: TimeoutError here after 5 s
    (thread,) = threads
    return thread, raised


def test_wait_idle_in_a_done_callback_raises_instead_of_waiting_for_itself(tmp_path):
    thread, raised = wait_idle_in_a_done_callback(tmp_path)
    assert thread is not threading.main_thread()
    assert len(raised) == 1 and "callback" in str(raised[0])


def test_a_dropped_kvtier_releases_its_threads_and_lock_with_a_warning(tmp_path):
    before = set(threading.enumerate())
    kv = KVTier.open(config(tmp_path, "write_through"))
    data = blocks(3)
    kv.store(TOKENS, data).result(10)
    kv.load(TOKENS, np.zeros_like(data)).result(10)
    kv.wait_idle()  # the write-through copies are on disk
    assert new_threads(before), "the stack runs threads of its own"
    with pytest.warns(ResourceWarning, match="dropped without close"):
        del kv
        gc.collect()
    assert new_threads(before) == []  # released on this thread, before gc.collect() returned
    assert_directory_holds(tmp_path, data)


def test_a_kvtier_whose_last_reference_a_callback_held_is_released_on_a_thread_of_its_own(tmp_path):
    before = set(threading.enumerate())
    kv = KVTier.open(config(tmp_path, "write_through"))
    data = blocks(5)
    landed = threading.Event()
    with copies_held(kv):
        kv.store(TOKENS, data).add_done_callback(lambda _future, kv=kv: landed.set())
    with pytest.warns(ResourceWarning, match="dropped without close"):
        del kv  # now only kvtier's jobs hold it: it is collected on one of kvtier's threads, which cannot wait
        assert landed.wait(5)
        assert wait_for_threads_to_end(before) == []
    assert_directory_holds(tmp_path, data)  # the write-through copy had landed before the stack was collected


@pytest.mark.filterwarnings("ignore::ResourceWarning")
def test_dropping_stacks_again_and_again_does_not_grow_the_thread_count(tmp_path):
    before = set(threading.enumerate())
    for i in range(20):
        kv = KVTier.open(config(tmp_path))  # the same directory: each one's lock must be gone
        data = blocks(i)
        kv.store(TOKENS, data).result(10)
        kv.load(TOKENS, np.zeros_like(data)).result(10)
        del kv
        gc.collect()
    assert new_threads(before) == []


EXITING_SCRIPT = """
import json, sys
import numpy as np
from kvtier import KVTier

kv = KVTier.open(json.loads(sys.argv[1]))
data = np.random.default_rng(0).integers(0, 256, (4, 1 << 20), dtype=np.uint8)
kv.store(list(range(16)), data).result(10)
future = kv.load(list(range(16)), np.zeros_like(data))
if sys.argv[2] == "close-in-callback":
    future.add_done_callback(lambda _: kv.close())
"""  # and the interpreter exits with the load perhaps still in flight, the stack open or closing


@pytest.mark.parametrize("ending", ["no-close", "close-in-callback"])
@pytest.mark.parametrize("placement", ["write_back", "write_through"])
def test_the_interpreter_exits_promptly_with_a_stack_open(tmp_path, ending, placement):
    child = subprocess.run(
        [sys.executable, "-c", EXITING_SCRIPT, json.dumps(config(tmp_path, placement)), ending],
        capture_output=True,
        text=True,
        timeout=20,
        cwd=tmp_path,
    )
    assert child.returncode == 0, child.stderr
    assert "Traceback" not in child.stderr and "Exception ignored" not in child.stderr, child.stderr
    with KVTier.open(config(tmp_path)) as again:  # whatever reached the disk is whole
        hits = again.lookup(TOKENS)
        out = np.zeros((4, BLOCK), np.uint8)
        assert again.load(TOKENS, out).result(10).loaded == hits
        assert np.array_equal(out[:hits], blocks()[:hits])
