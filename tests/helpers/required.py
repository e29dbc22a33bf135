"""Tests that CI must run for real: under an environment variable set to 1 (KVTIER_REQUIRE_VLLM, ..._SGLANG) a
skip of theirs is a failure, so a missing engine can never turn a CI run green by skipping its tests."""

from __future__ import annotations

from typing import Any


def fail_skip(report: Any, variable: str) -> None:
    """Turn a skipped test's report into a failure that says why (call it for the tests ``variable`` covers)."""
    if report.skipped:
        report.outcome = "failed"
        report.longrepr = f"skipped under {variable}=1: {report.longrepr}"
