"""The SGLang storage backend's tests: SGLang's real CPU host pools and storage factory, in-process.

They run in the SGLang venv (``scripts/install-sglang.sh build/venv-sglang``; ``make test-sglang``). Without
SGLang they are skipped; with KVTIER_REQUIRE_SGLANG=1 (CI) a missing SGLang or any skip is a failure.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

from helpers.required import fail_skip

REQUIRED = os.environ.get("KVTIER_REQUIRE_SGLANG") == "1"

try:
    importlib.import_module("sglang.srt.mem_cache.storage")
    HAVE_SGLANG = True
except ImportError as exc:
    if REQUIRED:
        raise RuntimeError(
            f"KVTIER_REQUIRE_SGLANG=1 but SGLang cannot be imported ({exc}); install it with "
            f"scripts/install-sglang.sh build/venv-sglang"
        ) from exc
    HAVE_SGLANG = False
    collect_ignore = [str(p) for p in Path(__file__).parent.glob("test_*.py")]


def pytest_report_header(config):
    return "kvtier SGLang backend tests: " + (
        "run" if HAVE_SGLANG else "skipped, SGLang is not installed (scripts/install-sglang.sh VENV)"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI (KVTIER_REQUIRE_SGLANG=1) a skipped backend test fails: they must run for real there."""
    outcome = yield
    if REQUIRED and "tests/connectors/sglang" in str(item.fspath):
        fail_skip(outcome.get_result(), "KVTIER_REQUIRE_SGLANG")


@pytest.fixture
def backends():
    """``backends(host_pool, config, ...)`` opens a backend (``helpers.sglang_pools.open_backend``) that is
    closed when the test ends."""
    from helpers.sglang_pools import open_backend

    opened = []

    def make(*args, **kwargs):
        backend = open_backend(*args, **kwargs)
        opened.append(backend)
        return backend

    yield make
    for backend in opened:
        backend.close()
