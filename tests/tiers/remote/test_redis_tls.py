"""The remote tier over TLS (``rediss://`` with ``ca_file``), against a real redis-server that listens
with TLS only, its certificates made per test by a throwaway CA (``helpers.redis_server``).

What it shows: blocks round-trip bit-exact between stacks over TLS, with and without a password from
the environment; a server whose certificate another CA signed, or one issued for another address, is
never trusted: lookups are misses within the timeout, loads of blocks the stack believed present fail
exactly those blocks (their bytes are never taken, even though the server holds the right ones),
stores are counted drops, and the logged error names the cause but no secret; a plain ``redis://``
client at the TLS port, or a ``rediss://`` one at a plain port, finds nothing within the timeout.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

from helpers.redis_server import certificate_authority, redis_server, server_certificate
from kvtier import KVTier
from kvtier.testing.common import assert_clean

BLOCK = 64 * 1024
TIMEOUT = 1.0
PASSWORD = "correct-horse-battery-tls"
PASSWORD_ENV = "KVTIER_TEST_REDIS_TLS_PASSWORD"
LINK_LOG = "kvtier.tiers.remote.link"


def block_records(server) -> int:
    """The blocks' records the server holds (each stack also records its namespace there at open)."""
    return sum(1 for name in server.client().scan_iter() if b"/namespaces/" not in name)


def prompt(n: int, start: int = 0) -> list[int]:
    """Token ids of ``n`` full blocks (16 tokens each); ``start`` makes another prompt."""
    return list(range(start * 1000, start * 1000 + 16 * n))


def data(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def config(url: str, ca_file=None, password_env: str | None = None, timeout: float = TIMEOUT) -> dict:
    """A host tier, then the store at ``url`` trusting ``ca_file`` (a path, or None: the system's CAs)."""
    redis: dict = {"url": url}
    if ca_file is not None:
        redis["ca_file"] = str(ca_file)
    if password_env is not None:
        redis["password_env"] = password_env
    return {
        "block_bytes": BLOCK,
        "namespace": "model-a",
        "tiers": [
            {"medium": "host", "capacity_blocks": 16},
            {"medium": "remote", "backend": "redis", "timeout": timeout, "redis": redis},
        ],
    }


def stored(cfg: dict, tokens: list[int], blocks: np.ndarray) -> None:
    """Store ``blocks`` through a stack of its own; all of them reach the store."""
    with KVTier.open(cfg) as kv:
        assert kv.store(tokens, blocks).result(30).stored == len(blocks)
        kv.wait_idle()
        assert kv.stats()["remote"]["committed"] == len(blocks)


def load(kv: KVTier, tokens: list[int], n: int):
    out = np.zeros((n, BLOCK), np.uint8)
    return kv.load(tokens, out).result(30), out


def assert_untrusted(kv: KVTier, tokens: list[int], n: int) -> None:
    """Lookups miss within the timeout, a load takes nothing, a store is a counted drop, no crash."""
    started = time.monotonic()
    assert kv.lookup(tokens) == 0
    assert time.monotonic() - started < TIMEOUT
    result, out = load(kv, tokens, n)
    assert (result.hits, result.loaded, result.failed) == (0, 0, []) and not out.any()
    assert kv.store(prompt(2, start=7), data(2, seed=7)).result(30).stored == 2  # host memory takes them
    kv.wait_idle()
    stats = kv.stats()["remote"]
    assert (stats["committed"], stats["aborted"], stats["hits"]) == (0, 2, 0)
    assert_clean(kv)


def logged_failure(caplog) -> str:
    """The link's warnings: the store's failure as the operator sees it."""
    text = "\n".join(r.getMessage() for r in caplog.records if r.name == LINK_LOG and r.levelno >= logging.WARNING)
    assert "failed for" in text, "the store's failure was not logged"
    return text


@pytest.fixture
def ca(tmp_path):
    return certificate_authority(tmp_path / "ca")


@pytest.fixture
def other_ca(tmp_path):
    return certificate_authority(tmp_path / "other-ca", "another kvtier test CA")


@pytest.fixture
def tls_server(tmp_path, ca):
    with redis_server(tmp_path / "redis", tls=server_certificate(ca, tmp_path / "server")) as server:
        yield server


@pytest.fixture
def password(monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    return PASSWORD


# --- a trusted server ----------------------------------------------------------------------------


def test_blocks_round_trip_between_stacks_over_tls(tls_server, ca):
    assert tls_server.url.startswith("rediss://127.0.0.1:")
    assert tls_server.client().config_get("port") == {"port": "0"}  # TLS only: no plain port
    tokens, blocks = prompt(8), data(8)
    stored(config(tls_server.url, ca.cert), tokens, blocks)
    assert block_records(tls_server) == 8
    with KVTier.open(config(tls_server.url, ca.cert)) as kv:
        assert kv.locate(tokens).tiers == ("remote",) * 8
        result, out = load(kv, tokens, 8)
        assert (result.loaded, result.failed, result.per_tier) == (8, [], {"remote": 8})
        assert np.array_equal(out, blocks)
        assert_clean(kv)
    clients = tls_server.client().client_list()
    assert not [c for c in clients if c["name"] == "kvtier"]  # the stacks closed their connections


def test_tls_with_a_password_from_the_environment(tmp_path, ca, password, monkeypatch, caplog):
    tls = server_certificate(ca, tmp_path / "server")
    with redis_server(tmp_path / "guarded", password=password, tls=tls) as guarded:
        tokens, blocks = prompt(4), data(4, seed=1)
        stored(config(guarded.url, ca.cert, PASSWORD_ENV), tokens, blocks)
        with KVTier.open(config(guarded.url, ca.cert, PASSWORD_ENV)) as kv:
            result, out = load(kv, tokens, 4)
            assert (result.loaded, result.failed) == (4, []) and np.array_equal(out, blocks)
            assert_clean(kv)
        monkeypatch.setenv(PASSWORD_ENV, "wrong-password-over-tls")
        caplog.set_level(logging.WARNING, LINK_LOG)
        with KVTier.open(config(guarded.url, ca.cert, PASSWORD_ENV)) as kv:
            assert_untrusted(kv, tokens, 4)
        text = logged_failure(caplog)
        assert PASSWORD not in text and "wrong-password-over-tls" not in text
        assert block_records(guarded) == 4  # what was refused wrote nothing


# --- an untrusted server -------------------------------------------------------------------------


def test_a_server_whose_certificate_another_ca_signed_is_never_trusted(tmp_path, ca, other_ca, password, caplog):
    """The server holds the right records (stored by a stack that trusts its CA), yet a stack trusting
    another CA takes nothing from it, and stores nothing there."""
    tls = server_certificate(other_ca, tmp_path / "server")
    with redis_server(tmp_path / "impostor", password=password, tls=tls) as impostor:
        tokens, blocks = prompt(4), data(4, seed=2)
        stored(config(impostor.url, other_ca.cert, PASSWORD_ENV), tokens, blocks)
        caplog.set_level(logging.WARNING, LINK_LOG)
        with KVTier.open(config(impostor.url, ca.cert, PASSWORD_ENV)) as kv:
            assert_untrusted(kv, tokens, 4)
        assert block_records(impostor) == 4
    text = logged_failure(caplog)
    assert "CERTIFICATE_VERIFY_FAILED" in text and PASSWORD not in text


def test_a_certificate_swapped_under_a_running_stack_fails_the_blocks_it_was_loading(
    tmp_path, tls_server, ca, other_ca, caplog
):
    """A stack that found blocks in the store; then the server comes back (same address, same records)
    with a certificate from another CA: the load fails exactly those blocks and writes none of them."""
    tokens, blocks = prompt(4), data(4, seed=3)
    stored(config(tls_server.url, ca.cert), tokens, blocks)
    caplog.set_level(logging.WARNING, LINK_LOG)
    with KVTier.open(config(tls_server.url, ca.cert)) as kv:
        assert kv.lookup(tokens) == 4  # the store's answer counts for a few seconds
        raw = tls_server.client()
        records = {name: raw.get(name) for name in raw.keys()}
        tls_server.tls = server_certificate(other_ca, tmp_path / "impostor")
        tls_server.restart()
        tls_server.client().mset(records)  # the same records, behind a certificate the stack does not trust
        started = time.monotonic()
        result, out = load(kv, tokens, 4)
        assert (result.hits, result.loaded, result.failed) == (4, 0, [0, 1, 2, 3])
        assert time.monotonic() - started < TIMEOUT and not out.any()
        assert kv.stats()["remote"]["read_errors"] == 4
        assert kv.lookup(tokens) == 0
        assert_clean(kv)
    assert "CERTIFICATE_VERIFY_FAILED" in logged_failure(caplog)
    with KVTier.open(config(tls_server.url, other_ca.cert)) as trusting:  # the bytes were there all along
        result, out = load(trusting, tokens, 4)
        assert result.loaded == 4 and np.array_equal(out, blocks)


def test_a_certificate_for_another_address_is_never_trusted(tmp_path, ca, caplog):
    """Signed by the trusted CA, but for another host name only: the host name check refuses 127.0.0.1."""
    tls = server_certificate(ca, tmp_path / "server", san="DNS:kvtier-elsewhere.invalid")
    with redis_server(tmp_path / "elsewhere", tls=tls) as elsewhere:
        tokens = prompt(4)
        elsewhere.client().set("kvtier/unrelated", b"x")
        caplog.set_level(logging.WARNING, LINK_LOG)
        with KVTier.open(config(elsewhere.url, ca.cert)) as kv:
            assert_untrusted(kv, tokens, 4)
        assert block_records(elsewhere) == 1
    text = logged_failure(caplog)
    assert "CERTIFICATE_VERIFY_FAILED" in text and "mismatch" in text


# --- TLS and plain mixed up ----------------------------------------------------------------------


def test_a_plain_url_at_the_tls_port_finds_nothing(tls_server, ca, caplog):
    tokens, blocks = prompt(4), data(4, seed=4)
    stored(config(tls_server.url, ca.cert), tokens, blocks)
    plain = tls_server.url.replace("rediss://", "redis://", 1)
    caplog.set_level(logging.WARNING, LINK_LOG)
    with KVTier.open(config(plain)) as kv:
        assert_untrusted(kv, tokens, 4)
    logged_failure(caplog)
    assert block_records(tls_server) == 4


def test_a_tls_url_at_a_plain_port_finds_nothing_within_the_timeout(tmp_path, ca, caplog):
    """A plain server reads the TLS hello as a command and never answers: the handshake hangs until the
    link's deadline (the client's socket timeout ends it later); the engine waits no longer than that."""
    timeout = 0.3
    with redis_server(tmp_path / "plain") as plain:
        tls_url = plain.url.replace("redis://", "rediss://", 1)
        caplog.set_level(logging.WARNING, LINK_LOG)
        with KVTier.open(config(tls_url, ca.cert, timeout=timeout)) as kv:
            started = time.monotonic()
            assert kv.lookup(prompt(4)) == 0
            assert time.monotonic() - started < timeout + 0.5
            result, out = load(kv, prompt(4), 4)
            assert result.hits == 0 and not out.any()
        assert block_records(plain) == 0
    logged_failure(caplog)
