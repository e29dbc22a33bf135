"""A real SGLang 0.5.23 server on CPU with its hierarchical cache (HiCache), for tests that send it prompts.

    make_model(tmp_path / "model")                        # tiny random-weight Llama + locally trained tokenizer
    with Server(model, tmp_path / "logs", storage="file", extra_config={...}) as server:
        first = generate(server.url, prompt, 8)           # first.ids, first.meta_info, first.cached()
        flush_cache(server.url)                           # device and host caches emptied: storage serves next
    with pytest.raises(ServerFailed) as failed:           # a server that must refuse to start
        Server(model, tmp_path / "logs", storage="dynamic", extra_config=bad).start()
    failed.value.log_tail                                 # the end of its log, where SGLang said why

The server is ``python -m sglang.launch_server`` from the SGLang venv (scripts/install-sglang.sh, which also installs
the CPU stand-ins of tests/sglang_server/cpu_standins), on a free loopback port, in a process group of its own, its
output in ``<log_dir>/<name>-<port>.log``. Stopping it ends the whole group: SIGTERM, then SIGKILL, then a check that
no process of it is left. Servers are independent: several may run at once (e.g. sharing one store), and one may be
restarted on the same storage (a new ``Server`` with the same arguments; the port changes).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from helpers.ports import free_port

REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO / "build" / "venv-sglang"
START_TIMEOUT_S = 240.0
"""A start takes ~25 s on 2 cores; two servers starting at once share them, so the limit is generous."""
PORT_TRIES = 3
"""Starts tried on fresh ports when another process took the chosen one first (``Server.start``)."""
STOP_GRACE_S = 10.0
"""Seconds SGLang gets to exit on SIGTERM before its process group is killed."""
REQUEST_TIMEOUT_S = 120.0
LOG_TAIL_LINES = 40
PAGE_SIZE = 4
"""Tokens a KV page holds (``--page-size``): small, so short prompts span many pages."""
VOCAB_SIZE = 1000
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: LlamaConfig's default bos/eos ids are 1 and 2


class ServerFailed(RuntimeError):
    """SGLang exited before it was ready, or was not ready in time; ``log_tail`` is the end of its log."""

    def __init__(self, message: str, log_tail: str, returncode: int | None) -> None:
        super().__init__(f"{message}; the end of its log:\n{log_tail}")
        self.log_tail = log_tail
        self.returncode = returncode


def make_model(path: str | Path, seed: int = 0) -> Path:
    """A tiny random-weight Llama (2 layers, hidden 128, 2 KV heads of 64) and a byte-level BPE tokenizer trained
    here (no model hub is reachable), saved at ``path`` for SGLang and ``AutoTokenizer.from_pretrained``. The
    same ``seed`` gives the same weights and vocabulary. float32, so that greedy decoding does not flip between
    runs that compute the same logits along different paths (a full prefill, or the end of a prompt after cached
    pages): random weights give close logits, and bfloat16 rounding can reorder them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _make_tokenizer(path, seed)
    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return path


def _make_tokenizer(path: Path, seed: int) -> None:
    """A byte-level BPE (any text encodes, no unknown tokens) of at most VOCAB_SIZE ids, trained on words drawn
    from ``seed``, saved as a transformers fast tokenizer (tokenizer.json and tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer)
    unk, bos, eos = SPECIAL_TOKENS
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=unk, bos_token=bos, eos_token=eos).save_pretrained(
        path
    )


def _corpus(seed: int, sentences: int = 2000) -> list[str]:
    """Sentences of pseudo-words made of syllables, the same for a seed: something for BPE to merge."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(300)]
    return [" ".join(rng.choices(words, k=rng.randint(5, 15))) + "." for _ in range(sentences)]


class Server:
    """One SGLang server process group: ``python -m sglang.launch_server`` on CPU with HiCache.

    ``layout`` is ``--hicache-mem-layout`` (``layer_first`` or ``page_first``; SGLang turns ``page_first`` into
    ``page_first_direct`` for the direct IO backend). ``storage`` is ``--hicache-storage-backend`` (``file``,
    ``dynamic``, ...; None: no L3) and ``extra_config`` its ``--hicache-storage-backend-extra-config`` (a dict,
    sent as JSON). ``prefetch_policy`` is ``--hicache-storage-prefetch-policy``: ``wait_complete`` by default, so a
    request waits for its storage hits to load instead of giving up after SGLang's timeout, which a busy 2-core
    machine can miss. ``dtype`` is ``--dtype``: SGLang's ``auto`` runs a float32 checkpoint in float16. ``args``
    are more SGLang flags; ``env`` overrides the environment of the server."""

    def __init__(
        self,
        model: str | Path,
        log_dir: str | Path,
        *,
        layout: str = "layer_first",
        storage: str | None = None,
        extra_config: dict[str, Any] | None = None,
        prefetch_policy: str = "wait_complete",
        dtype: str = "float32",
        args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        venv: str | Path = DEFAULT_VENV,
        name: str = "sglang",
        start_timeout: float = START_TIMEOUT_S,
    ) -> None:
        self.model = Path(model)
        self.log_dir = Path(log_dir)
        self.layout = layout
        self.storage = storage
        self.extra_config = extra_config
        self.prefetch_policy = prefetch_policy
        self.dtype = dtype
        self.args = tuple(args)
        self.env = dict(env or {})
        self.python = Path(venv) / "bin" / "python"
        self.name = name
        self.start_timeout = start_timeout
        self.port = free_port()
        self.log_path = self.log_dir / f"{name}-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.start_s: float | None = None
        """Seconds from launch to the first healthy answer (None until then)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """SGLang's command line: its plain-torch CPU path (torch_native attention, no CUDA graphs, no warmup request),
        a small device pool of 4-token pages, and HiCache with a 1 GB host pool and the direct IO backend."""
        cmd = [
            str(self.python),
            "-m",
            "sglang.launch_server",
            "--model-path",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            "cpu",
            "--dtype",
            self.dtype,
            "--attention-backend",
            "torch_native",
            "--disable-cuda-graph",
            "--skip-server-warmup",
            "--max-total-tokens",
            "2048",
            "--page-size",
            str(PAGE_SIZE),
            "--enable-hierarchical-cache",
            "--hicache-size",
            "1",
            "--hicache-io-backend",
            "direct",
            "--hicache-mem-layout",
            self.layout,
        ]
        if self.storage is not None:
            cmd += [
                "--hicache-storage-backend",
                self.storage,
                "--hicache-storage-prefetch-policy",
                self.prefetch_policy,
            ]
        if self.extra_config is not None:
            cmd += ["--hicache-storage-backend-extra-config", json.dumps(self.extra_config)]
        return cmd + list(self.args)

    def environment(self) -> dict[str, str]:
        """This process's environment, with what SGLang needs on CPU, then ``env``'s overrides: SGLang's CPU
        engine (without it ``--device cpu`` imports vLLM for rotary embeddings), no GPU, no model hub; ``/health``
        without generating a token (by default it runs a 1-token request through the scheduler and its caches, which
        a test would see among its own); no py-spy or CUDA core dumps when a child process dies (SGLang sleeps 5 s
        first, which every stop would pay: SIGTERM ends the scheduler before the main process)."""
        return {
            **os.environ,
            "SGLANG_USE_CPU_ENGINE": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
            "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "0",
            "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
            "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0",
            **self.env,
        }

    def start(self) -> Server:
        """Launch SGLang and wait until ``/health`` answers 200. Raises ServerFailed (with the log's tail) when the
        process exits first, or when it is not healthy within ``start_timeout`` (then it is stopped first).

        The port is only known to be free when it is chosen; by the time SGLang binds it (~20 s later) another
        process may hold it (SGLang's own processes pick their ports from the same range). A start that fails on
        exactly that is repeated on a fresh port, up to PORT_TRIES times."""
        if self.proc is not None:
            raise RuntimeError(f"{self.name} on port {self.port} was already started")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        attempt = 1
        while True:
            started = time.monotonic()
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    self.command(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.environment(),
                    start_new_session=True,
                )
            try:
                self._wait_healthy(started + self.start_timeout)
            except ServerFailed:
                self.stop()
                port_taken = f"bind on address ('127.0.0.1', {self.port})" in self.log_path.read_text(errors="replace")
                if attempt == PORT_TRIES or not port_taken:
                    raise
                self.port = free_port()
                self.log_path = self.log_dir / f"{self.name}-{self.port}.log"
                self.proc = None
                attempt += 1
                continue
            except BaseException:
                self.stop()
                raise
            self.start_s = round(time.monotonic() - started, 1)
            return self

    def _wait_healthy(self, deadline: float) -> None:
        """Poll ``/health`` (503 while SGLang starts) until 200, the process exits, or the deadline passes."""
        assert self.proc is not None
        while True:
            if self.proc.poll() is not None:
                raise ServerFailed(
                    f"{self.name} exited with {self.proc.returncode} before it was ready",
                    self.log_tail(),
                    self.proc.returncode,
                )
            if _status(self.url + "/health") == 200:
                return
            if time.monotonic() > deadline:
                raise ServerFailed(f"{self.name} was not ready within {self.start_timeout} s", self.log_tail(), None)
            time.sleep(0.5)

    def stop(self) -> int | None:
        """End the process group: SIGTERM, SIGKILL after STOP_GRACE_S, then wait until none of its processes is
        left (SGLang's scheduler and detokenizer are its children). Returns the main process's exit status (None if
        it never started); stopping twice is harmless. Raises if a process of the group outlives SIGKILL."""
        if self.proc is None:
            return None
        group = self.proc.pid
        _signal_group(group, signal.SIGTERM)
        try:
            self.proc.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            pass
        if _group_members(group) or self.proc.poll() is None:
            _signal_group(group, signal.SIGKILL)
        self.proc.wait(STOP_GRACE_S)
        deadline = time.monotonic() + STOP_GRACE_S
        while (left := _group_members(group)) and time.monotonic() < deadline:
            time.sleep(0.1)
        if left:
            raise RuntimeError(f"processes {left} of {self.name} (group {group}) outlived SIGKILL")
        return self.proc.returncode

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of the server's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(group: int, sig: signal.Signals) -> None:
    """Signal every process of the group; a group already gone is fine."""
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _group_members(group: int) -> list[int]:
    """The live processes of a process group, read from /proc rather than followed from parent to child: SGLang's
    children are reparented when its main process ends first. Zombies do not count: they have ended, and their
    new parent collects their exit status."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # ended while listed
        state, _ppid, pgrp = stat[stat.rindex(")") + 2 :].split()[:3]
        if int(pgrp) == group and state != "Z":
            members.append(int(entry.name))
    return members


def _status(url: str) -> int | None:
    """The HTTP status of a GET, None when nothing answers yet."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (OSError, http.client.HTTPException):  # refused, reset, or cut short while SGLang starts
        return None


def _post(url: str, body: dict[str, Any] | None = None, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
    """POST ``body`` as JSON: the status and the response body, error statuses included."""
    data = json.dumps(body or {}).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


class Generation(NamedTuple):
    """What ``/generate`` answered: the output token ids, and SGLang's ``meta_info`` (``prompt_tokens``,
    ``cached_tokens``, ``cached_tokens_details``, ...)."""

    ids: list[int]
    meta_info: dict[str, Any]

    def cached(self) -> dict[str, int]:
        """Cached prompt tokens by where they were found: ``device``, ``host`` and ``storage``, 0 where none
        (SGLang leaves out ``cached_tokens_details`` when nothing was cached, and ``storage`` without a backend)."""
        details = self.meta_info.get("cached_tokens_details") or {}
        return {tier: int(details.get(tier, 0)) for tier in ("device", "host", "storage")}


def generate(url: str, prompt: str | list[int], max_new_tokens: int) -> Generation:
    """Greedy generation (temperature 0) of exactly ``max_new_tokens`` (EOS ignored) for a text or token ids."""
    body: dict[str, Any] = {"text": prompt} if isinstance(prompt, str) else {"input_ids": list(prompt)}
    body["sampling_params"] = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "ignore_eos": True}
    status, answer = _post(url + "/generate", body)
    if status != 200:
        raise RuntimeError(f"POST {url}/generate answered {status}: {answer[:2000]!r}")
    out = json.loads(answer)
    return Generation(list(out["output_ids"]), out["meta_info"])


def flush_cache(url: str, timeout: float = 30.0) -> None:
    """Empty SGLang's device and host KV caches (``POST /flush_cache``), storage untouched. SGLang refuses (400)
    while requests are queued or running; ``timeout`` asks it to flush as soon as it is idle, within that many
    seconds. It answers 200 once the flush is done, so the next request finds nothing in device or host memory.

    The flush also drops the host-to-storage writes SGLang has not done yet (its cache controller's reset clears
    the backup queue), and they run in the background after a request's answer: wait for the store to hold what a
    test expects there (``wait_until``) before flushing."""
    status, answer = _post(f"{url}/flush_cache?timeout={timeout}", timeout=timeout + REQUEST_TIMEOUT_S)
    if status != 200:
        raise RuntimeError(f"POST {url}/flush_cache answered {status}: {answer[:2000]!r}")


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Poll ``condition`` until it returns something true, and return that; TimeoutError naming ``what`` after
    ``timeout`` seconds. For what SGLang does in the background, such as writing pages to storage."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout} s: {what}")
        time.sleep(0.1)
    return result
