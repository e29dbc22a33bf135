"""The SGLang server tests' setup: one tiny model for the session, and servers that always stop with their test.

They run in the SGLang venv (scripts/install-sglang.sh VENV, then VENV/bin/python -m pytest tests/sglang_server),
whose SGLang serves them. Elsewhere (kvtier's main venv has no SGLang) they are skipped; with
KVTIER_REQUIRE_SGLANG=1 (CI) a missing SGLang, missing CPU stand-ins or any skip here is a failure.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from helpers.required import fail_skip
from sglang_server.harness import Server, make_model

REQUIRED = os.environ.get("KVTIER_REQUIRE_SGLANG") == "1"
INSTALL = "scripts/install-sglang.sh VENV, then run pytest with VENV/bin/python"
# Found, not imported: importing SGLang takes ~5 s and only the servers need it.
MISSING = [name for name in ("sglang", "kvtier_sglang_cpu") if importlib.util.find_spec(name) is None]
if MISSING and REQUIRED:
    raise RuntimeError(f"KVTIER_REQUIRE_SGLANG=1 but {' and '.join(MISSING)} cannot be imported; {INSTALL}")
SKIP_REASON = f"needs SGLang 0.5.23 and the CPU stand-ins ({' and '.join(MISSING)} missing): {INSTALL}"


def pytest_report_header(config):
    return "kvtier SGLang server tests: " + (f"skipped, {SKIP_REASON}" if MISSING else f"run with {sys.prefix}")


def pytest_collection_modifyitems(config, items):
    """Without SGLang every test here is skipped (their modules import only the standard library's harness)."""
    if MISSING:
        here = Path(__file__).parent
        for item in items:
            if here in item.path.parents:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under KVTIER_REQUIRE_SGLANG=1 a skipped test here fails: in CI these tests must run for real."""
    outcome = yield
    if REQUIRED and Path(__file__).parent in item.path.parents:
        fail_skip(outcome.get_result(), "KVTIER_REQUIRE_SGLANG")


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    """The tiny random-weight Llama with its tokenizer (``harness.make_model``), made once a session."""
    return make_model(tmp_path_factory.mktemp("tiny-llama"), seed=0)


@pytest.fixture
def make_server(model, tmp_path):
    """``make(**kwargs)``: a started ``harness.Server`` of the session's model, run by this venv's Python, its log
    in ``tmp_path / "logs"``; ``kwargs`` are Server's (layout, storage, extra_config, env, ...). Every server
    made is stopped when the test ends, whatever its outcome."""
    servers: list[Server] = []

    def make(**kwargs) -> Server:
        server = Server(model, tmp_path / "logs", venv=sys.prefix, **kwargs)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


def pytest_terminal_summary(terminalreporter):
    """The figures tests record (``record_property``: the tokens before and after damage, ...) at the end of the
    run's report, so CI's log shows what each backend answered, not only that the test passed."""
    lines = [
        f"{report.nodeid}: {name} = {value}"
        for report in terminalreporter.stats.get("passed", [])
        for name, value in report.user_properties
        if Path(__file__).parent.name in report.nodeid
    ]
    if lines:
        terminalreporter.section("SGLang server tests: recorded figures")
        for line in lines:
            terminalreporter.write_line(line)
