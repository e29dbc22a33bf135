"""The harness against SGLang's own ``file`` storage backend: a real SGLang 0.5.23 server on CPU with HiCache writes a
prompt's KV pages to files, and after ``/flush_cache`` (device and host caches emptied) serves the same prompt from
storage with the same greedy tokens. Both host pool layouts run: ``layer_first`` and ``page_first`` (which SGLang
turns into ``page_first_direct`` for the direct IO backend). One server start each (~30 s on 2 cores).
"""

from __future__ import annotations

import random

import pytest

from sglang_server.harness import PAGE_SIZE, VOCAB_SIZE, flush_cache, generate, wait_until

PROMPT_TOKENS = 64
"""A multiple of the page size, so the one page SGLang recomputes (see ``reusable``) is a whole prompt page."""
NEW_TOKENS = 8
STORE_WRITE_TIMEOUT_S = 60.0


def reusable(prompt_tokens: int) -> int:
    """Prompt tokens SGLang can take from a cache: it matches at most all but the last prompt token (whose logits
    it must compute, ``Req._compute_max_prefix_len``), in whole pages. So a 64-token prompt reuses 60 tokens:
    its last page is computed again."""
    return (prompt_tokens - 1) // PAGE_SIZE * PAGE_SIZE


def prompt_ids(seed: int = 0) -> list[int]:
    """PROMPT_TOKENS token ids of the tiny model's vocabulary (past its special tokens), the same for a seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB_SIZE) for _ in range(PROMPT_TOKENS)]


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_flushed_prompt_comes_back_from_file_storage(make_server, tmp_path, layout):
    store = tmp_path / "store"
    server = make_server(
        layout=layout, storage="file", extra_config={"file_storage_path": str(store), "prefetch_threshold": PAGE_SIZE}
    )
    prompt = prompt_ids()

    first = generate(server.url, prompt, NEW_TOKENS)
    assert first.meta_info["prompt_tokens"] == PROMPT_TOKENS
    assert first.cached() == {"device": 0, "host": 0, "storage": 0}
    assert len(first.ids) == NEW_TOKENS
    # SGLang writes the pages to storage after answering; one file a page.
    wait_until(
        lambda: len(list(store.glob("*.bin"))) >= PROMPT_TOKENS // PAGE_SIZE,
        STORE_WRITE_TIMEOUT_S,
        f"the prompt's {PROMPT_TOKENS // PAGE_SIZE} pages written to {store}",
    )

    flush_cache(server.url)
    again = generate(server.url, prompt, NEW_TOKENS)
    assert again.cached() == {"device": 0, "host": 0, "storage": reusable(PROMPT_TOKENS)}
    assert again.meta_info["cached_tokens"] == reusable(PROMPT_TOKENS) == 60
    assert again.ids == first.ids
