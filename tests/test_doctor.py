"""``kvtier doctor CONFIG``: a good config passes (exit 0) and the stack it describes then works; each broken
item alone fails (exit 1) naming it, in the words the start itself would fail with; two configs that share
are said to, and really find each other's blocks; two that do not are said to differ in the field that
decides it, and really miss each other's blocks.

Everything is real: the disk tier's directory in the test's own folder, a redis-server per test
(``helpers.redis_server``: skipped without Redis, failed instead under KVTIER_REQUIRE_REMOTE=1), the
stacks opened through the public API.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from helpers.node_blocks import wait_for
from helpers.node_daemon import node_daemon
from helpers.redis_server import certificate_authority, redis_server, server_certificate
from kvtier import KVTier
from kvtier.cli import main
from kvtier.doctor import diagnose
from kvtier.testing.store import bounded
from kvtier.tiers.disk.files import SLAB_NAME, DiskTierError

BLOCK = 64 * 1024
TOKENS = 16  # block_tokens
NOBODY = 65534  # another user
SECRET_ENV, SECRET = "KVTIER_TEST_DOCTOR_SECRET", "doctor key secret, 32 bytes long"
MAC_ENV, MAC = "KVTIER_TEST_DOCTOR_MAC", "doctor MAC secret of 32 bytes ok"
PASSWORD_ENV, PASSWORD = "KVTIER_TEST_DOCTOR_PASSWORD", "doctor-redis-password-right"
VLLM = ["--engine", "vllm", "--dtype", "bfloat16", "--layout", "LBHNC"]

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="playing another user needs root (chown)")


@pytest.fixture
def server(tmp_path):
    with redis_server(tmp_path / "redis") as server:
        yield server


@pytest.fixture
def secrets_set(monkeypatch):
    monkeypatch.setenv(SECRET_ENV, SECRET)
    monkeypatch.setenv(MAC_ENV, MAC)


def stack(tmp_path: Path, url: str, *, disk: bool = True, **top) -> dict:
    """Host memory, a disk tier in the test's folder, the Redis store at ``url``; keyed, with MACs."""
    tiers: list[dict] = [{"medium": "host", "capacity": "4MiB"}]
    if disk:
        tiers.append({"medium": "disk", "path": str(tmp_path / "cache"), "capacity": "8MiB"})
    tiers.append(
        {"medium": "remote", "backend": "redis", "timeout": 1.0, "auth_key_env": MAC_ENV, "redis": {"url": url}}
    )
    return {"block_tokens": TOKENS, "block_bytes": BLOCK, "key_secret_env": SECRET_ENV, **top, "tiers": tiers}


def write(tmp_path: Path, config: dict, name: str = "kvtier.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return str(path)


def doctor(capsys, *args: str) -> tuple[int, dict]:
    """``kvtier doctor ARGS --json`` in this process: exit status and report."""
    code = main(["doctor", *args, "--json"])
    return code, json.loads(capsys.readouterr().out)


def only_failure(code: int, report: dict, named: str) -> str:
    """The message of the one failed check, whose name holds ``named``; the exit status is 1."""
    assert code == 1 and not report["ok"]
    assert len(report["failed"]) == 1 and named in report["failed"][0], report["failed"]
    (failed,) = [check for check in report["checks"] if not check["ok"]]
    return failed["message"]


def prompt(n: int) -> list[int]:
    return list(range(1, 1 + TOKENS * n))


def blocks(n: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, (n, BLOCK), dtype=np.uint8)


def store_remotely(config: dict, n: int = 3) -> None:
    """Store ``n`` blocks through a stack of ``config``; every one reaches the store."""
    with KVTier.open(config) as kv:
        assert kv.store(prompt(n), blocks(n)).result(30).stored == n
        kv.wait_idle()
        assert kv.stats()["remote"]["committed"] == n


# --- a good config ---------------------------------------------------------------------------


def test_a_good_config_passes_and_creates_nothing(tmp_path, capsys, server, secrets_set):
    config = stack(tmp_path, server.url)
    code, report = doctor(capsys, write(tmp_path, config))
    assert code == 0 and report["ok"] and report["failed"] == []
    assert [check["name"] for check in report["checks"]] == [
        "config",
        "key secret",
        f"tiers[1] (disk) directory {tmp_path / 'cache'}",
        "tiers[2] (remote) secrets",
        "tiers[2] (remote) store",
        "host memory",
        "tiers[1] (disk) disk space",
    ]
    assert all(check["ok"] for check in report["checks"])
    assert not (tmp_path / "cache").exists(), "the doctor created the disk tier's directory"
    assert server.client().dbsize() == 0, "the doctor wrote into the store"
    host = next(check for check in report["checks"] if check["name"] == "host memory")
    assert host["details"]["need_bytes"] == 4 * 2**20 // (BLOCK + 4096) * (BLOCK + 4096)  # slots after header room

    # What it said holds: the stack opens, and its keys are the digest's.
    with KVTier.open(config) as kv:
        assert kv.keys([0] * TOKENS)[0].hex() == report["sharing"]["digest"]
    fields = report["sharing"]["fields"]
    assert fields["block_size"] == TOKENS and fields["namespace"] == ""
    assert fields["store"] == f"redis at {server.url}" and fields["store_prefix"] == "kvtier"
    assert len(fields["key_secret"]) == len(fields["store_mac_key"]) == 8  # fingerprints, never the secrets


def test_a_directory_and_slab_of_its_own_pass_while_no_one_holds_them(tmp_path, capsys, server, secrets_set):
    """After a stack ran there (its slab exists), the doctor still passes; while one runs, the slab is in
    use, and a second engine on this config could not start: that fails, naming the holder."""
    config = stack(tmp_path, server.url)
    path = write(tmp_path, config)
    store_remotely(config)
    assert (tmp_path / "cache" / SLAB_NAME).is_file()
    code, report = doctor(capsys, path)
    assert code == 0, report["failed"]
    with KVTier.open(config):
        message = only_failure(*doctor(capsys, path), "directory")
    assert f"in use by pid {os.getpid()}" in message


# --- each broken item alone ------------------------------------------------------------------


def assert_start_fails_alike(config: dict, message: str) -> None:
    """The stack's own start refuses the config with the doctor's very words."""
    with pytest.raises(DiskTierError) as info:
        KVTier.open(config)
    assert str(info.value) == message


@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_directory_others_can_write_fails(tmp_path, capsys, server, secrets_set, mode):
    config = stack(tmp_path, server.url)
    (tmp_path / "cache").mkdir()
    os.chmod(tmp_path / "cache", mode)
    message = only_failure(*doctor(capsys, write(tmp_path, config)), "directory")
    assert ("every user" if mode == 0o777 else "its group") in message and str(tmp_path / "cache") in message
    assert_start_fails_alike(config, message)


@needs_root
@pytest.mark.parametrize("shared", [False, True])
def test_a_directory_another_user_owns_fails_unless_shared(tmp_path, capsys, server, secrets_set, shared):
    config = stack(tmp_path, server.url)
    config["tiers"][1]["shared_directory"] = shared
    (tmp_path / "cache").mkdir(mode=0o700)
    os.chown(tmp_path / "cache", NOBODY, NOBODY)
    code, report = doctor(capsys, write(tmp_path, config))
    if shared:
        assert code == 0, report["failed"]
        return
    message = only_failure(code, report, "directory")
    assert f"belongs to uid {NOBODY}" in message
    assert_start_fails_alike(config, message)


def test_a_slab_that_is_a_symbolic_link_fails(tmp_path, capsys, server, secrets_set):
    config = stack(tmp_path, server.url)
    (tmp_path / "cache").mkdir(mode=0o700)
    (tmp_path / "elsewhere").write_bytes(b"someone's data")
    (tmp_path / "cache" / SLAB_NAME).symlink_to(tmp_path / "elsewhere")
    message = only_failure(*doctor(capsys, write(tmp_path, config)), "directory")
    assert "is a symbolic link" in message
    assert_start_fails_alike(config, message)
    assert (tmp_path / "elsewhere").read_bytes() == b"someone's data"


@needs_root
def test_a_directory_link_another_user_owns_fails(tmp_path, capsys, server, secrets_set):
    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "cache").symlink_to(tmp_path / "real")
    os.lchown(tmp_path / "cache", NOBODY, NOBODY)
    config = stack(tmp_path, server.url)
    message = only_failure(*doctor(capsys, write(tmp_path, config)), "directory")
    assert f"symbolic link owned by uid {NOBODY}" in message
    assert_start_fails_alike(config, message)


def test_a_missing_key_secret_fails_and_leaves_no_digest(tmp_path, capsys, server, secrets_set, monkeypatch):
    monkeypatch.delenv(SECRET_ENV)
    code, report = doctor(capsys, write(tmp_path, stack(tmp_path, server.url)))
    message = only_failure(code, report, "key secret")
    assert f"{SECRET_ENV} is unset or empty" in message
    assert report["sharing"]["digest"] is None and report["sharing"]["fields"]["key_secret"] == "unreadable"


@pytest.mark.parametrize("env", [SECRET_ENV, MAC_ENV])
def test_a_too_short_secret_fails(tmp_path, capsys, server, secrets_set, monkeypatch, env):
    monkeypatch.setenv(env, "short secret")
    code, report = doctor(capsys, write(tmp_path, stack(tmp_path, server.url)))
    message = only_failure(code, report, "key secret" if env == SECRET_ENV else "secrets")
    assert f"{env} holds 12 bytes, fewer than the 16" in message


def test_a_missing_mac_secret_fails(tmp_path, capsys, server, secrets_set, monkeypatch):
    monkeypatch.delenv(MAC_ENV)
    message = only_failure(*doctor(capsys, write(tmp_path, stack(tmp_path, server.url))), "(remote) secrets")
    assert f"auth_key_env: the environment variable {MAC_ENV} is unset" in message


def sealed(config: dict, secret_env: str) -> dict:
    """``config`` with its store's records sealed under the secret in ``secret_env`` (and no MAC)."""
    remote = config["tiers"][-1]
    del remote["auth_key_env"]
    remote.update(encryption="aes-gcm", encryption_key_env=secret_env)
    return config


def test_a_missing_sealing_secret_fails(tmp_path, capsys, server, secrets_set, monkeypatch):
    monkeypatch.delenv("KVTIER_TEST_DOCTOR_SEAL", raising=False)
    config = sealed(stack(tmp_path, server.url), "KVTIER_TEST_DOCTOR_SEAL")
    message = only_failure(*doctor(capsys, write(tmp_path, config)), "(remote) secrets")
    assert "encryption_key_env: the environment variable KVTIER_TEST_DOCTOR_SEAL is unset" in message


def test_sealed_configs_under_other_secrets_differ_in_the_sealing_key(
    tmp_path, capsys, server, secrets_set, monkeypatch
):
    monkeypatch.setenv("KVTIER_TEST_DOCTOR_SEAL", "a sealing secret of enough bytes")
    monkeypatch.setenv("KVTIER_TEST_DOCTOR_OTHER_SEAL", "another sealing secret, enough")
    mine = sealed(stack(tmp_path, server.url), "KVTIER_TEST_DOCTOR_SEAL")
    theirs = sealed(stack(tmp_path, server.url, disk=False), "KVTIER_TEST_DOCTOR_OTHER_SEAL")
    code, report = doctor(capsys, write(tmp_path, mine), "--compare", write(tmp_path, theirs, "theirs.yaml"))
    assert code == 1 and report["ok"] and not report["compare"]["share"]
    (said,) = report["compare"]["differences"]
    assert said.startswith("store_sealing_key ")
    fields = report["sharing"]["fields"]
    assert len(fields["store_sealing_key"]) == 8 and fields["store_mac_key"] is None  # a key's id, never a secret


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_store_that_is_down_fails_within_the_timeout(tmp_path, capsys, server, secrets_set, fault):
    path = write(tmp_path, stack(tmp_path, server.url))
    server.kill() if fault == "killed" else server.stop()
    (code, report), _ = bounded(doctor, capsys, path)  # a hung store must not hang the doctor
    message = only_failure(code, report, "(remote) store")
    assert f"redis at {server.url} failed an existence query (timeout 1 s)" in message
    if fault == "hung":
        server.cont()


@pytest.mark.parametrize("given", ["right", "wrong", "none", "unset"])
def test_credentials_are_tried_on_the_server_and_never_shown(tmp_path, capsys, secrets_set, monkeypatch, given):
    """A server with requirepass: the right password passes; a wrong one or none fails the round trip;
    a password_env naming no variable fails the secrets. No password appears in any output."""
    with redis_server(tmp_path / "redis", password=PASSWORD) as server:
        config = stack(tmp_path, server.url)
        if given != "none":
            config["tiers"][2]["redis"]["password_env"] = PASSWORD_ENV
        if given in ("right", "wrong"):
            monkeypatch.setenv(PASSWORD_ENV, PASSWORD if given == "right" else "doctor-redis-password-wrong")
        path = write(tmp_path, config)
        code, report = doctor(capsys, path)
        assert main(["doctor", path]) == code
    out = json.dumps(report) + capsys.readouterr().out
    for secret in (PASSWORD, "doctor-redis-password-wrong", SECRET, MAC):
        assert secret not in out
    if given == "right":
        assert code == 0, report["failed"]
    elif given == "unset":
        assert f"password_env: the environment variable {PASSWORD_ENV} is unset" in only_failure(
            code, report, "secrets"
        )
    else:
        assert f"redis at {server.url} failed an existence query" in only_failure(code, report, "(remote) store")


@pytest.mark.parametrize("trusted", [True, False])
def test_tls_is_tried_with_the_configured_ca(tmp_path, capsys, secrets_set, trusted):
    ca = certificate_authority(tmp_path / "ca")
    other = certificate_authority(tmp_path / "other-ca", "another kvtier test CA")
    with redis_server(tmp_path / "redis", tls=server_certificate(ca, tmp_path / "server")) as server:
        config = stack(tmp_path, server.url)
        config["tiers"][2]["redis"]["ca_file"] = str((ca if trusted else other).cert)
        code, report = doctor(capsys, write(tmp_path, config))
    if trusted:
        assert code == 0, report["failed"]
    else:
        assert "certificate verify failed" in only_failure(code, report, "(remote) store")


def test_host_capacity_above_free_memory_fails(tmp_path, capsys, server, secrets_set):
    config = stack(tmp_path, server.url)
    config["tiers"][0]["capacity"] = "1024TiB"
    code, report = doctor(capsys, write(tmp_path, config))
    assert "MemAvailable" in only_failure(code, report, "host memory")
    (check,) = [c for c in report["checks"] if c["name"] == "host memory"]
    assert check["details"]["need_bytes"] > check["details"]["available_bytes"] > 0


def test_disk_capacity_above_free_space_fails(tmp_path, capsys, server, secrets_set):
    config = stack(tmp_path, server.url)
    config["tiers"][1]["capacity"] = "1024TiB"
    code, report = doctor(capsys, write(tmp_path, config))
    assert "the filesystem has" in only_failure(code, report, "disk space")
    (check,) = [c for c in report["checks"] if c["name"].endswith("disk space")]
    assert check["details"]["need_bytes"] > check["details"]["usable_bytes"] > 0
    assert not (tmp_path / "cache").exists()


def test_a_config_that_does_not_load_fails_alone(tmp_path, capsys):
    code, report = doctor(capsys, write(tmp_path, {"tiers": [{"medium": "host"}]}))
    assert "capacity" in only_failure(code, report, "config") and report["sharing"] is None


# --- sharing ---------------------------------------------------------------------------------


def said_plainly(capsys) -> str:
    """What the doctor printed, its whitespace runs made single spaces: the terminal's width decides where
    its lines wrap (and a wrapped line may keep its trailing space), which must not decide a test."""
    return " ".join(capsys.readouterr().out.split())


def test_two_configs_that_share_say_so_and_find_each_others_blocks(tmp_path, capsys, server, secrets_set):
    """Another engine's config: no disk tier, other capacities; same keys and records, so it shares."""
    mine = stack(tmp_path, server.url)
    theirs = stack(tmp_path, server.url, disk=False)
    theirs["tiers"][0]["capacity"] = "2MiB"
    code, report = doctor(capsys, write(tmp_path, mine), "--compare", write(tmp_path, theirs, "theirs.yaml"))
    assert code == 0 and report["compare"]["share"] and report["compare"]["differences"] == []
    main(["doctor", write(tmp_path, mine), "--compare", str(tmp_path / "theirs.yaml")])
    assert "these two share" in said_plainly(capsys)

    store_remotely(mine)
    with KVTier.open(theirs) as kv:
        out = np.zeros((3, BLOCK), np.uint8)
        result = kv.load(prompt(3), out).result(30)
        assert (result.hits, result.failed) == (3, [])
        assert np.array_equal(out, blocks(3))


@pytest.mark.parametrize(
    "change, difference",
    [
        (lambda c: c.update(block_tokens=32), "block_size 16 vs 32"),
        (lambda c: c.update(namespace="another"), 'namespace "" vs "another"'),
        (lambda c: c["tiers"][-1].update(prefix="other-"), 'store_prefix "kvtier" vs "other-"'),
        (lambda c: c.update(key_secret_env="KVTIER_TEST_DOCTOR_OTHER_SECRET"), "key_secret "),
        (lambda c: c["tiers"][-1].update(auth_key_env="KVTIER_TEST_DOCTOR_OTHER_SECRET"), "store_mac_key "),
    ],
    ids=["block size", "namespace", "prefix", "key secret", "MAC secret"],
)
def test_two_configs_that_differ_name_the_field_and_miss_each_others_blocks(
    tmp_path, capsys, server, secrets_set, monkeypatch, change, difference
):
    monkeypatch.setenv("KVTIER_TEST_DOCTOR_OTHER_SECRET", "another secret of enough bytes")
    mine = stack(tmp_path, server.url)
    theirs = stack(tmp_path, server.url, disk=False)
    change(theirs)
    code, report = doctor(capsys, write(tmp_path, mine), "--compare", write(tmp_path, theirs, "theirs.yaml"))
    assert code == 1 and report["ok"] and not report["compare"]["share"]
    (said,) = report["compare"]["differences"]
    assert said.startswith(difference)
    main(["doctor", write(tmp_path, mine), "--compare", str(tmp_path / "theirs.yaml")])
    assert f"they differ in: {difference}" in said_plainly(capsys)

    store_remotely(mine)
    with KVTier.open(theirs) as kv:  # (records under another MAC key exist, but fail their check when read)
        out = np.zeros((3, BLOCK), np.uint8)
        assert kv.load(prompt(3), out).result(30).loaded == 0 and not out.any()


def test_another_model_named_by_engine_flags_differs_through_a_recorded_report(tmp_path, capsys, server, secrets_set):
    """One engine's report, recorded as JSON (another machine's, say), against another engine's flags."""
    path = write(tmp_path, stack(tmp_path, server.url))
    code, recorded = doctor(capsys, path, *VLLM, "--model", "org/model-a", "--tp", "2")
    assert code == 0 and recorded["sharing"]["fields"]["model"] == "org/model-a"
    assert recorded["sharing"]["fields"]["dtype"] == "torch.bfloat16"  # as vLLM's config holds it
    assert [c["name"] for c in recorded["checks"] if "directory" in c["name"]] == [
        f"tiers[1] (disk) directory {tmp_path / 'cache' / f'rank{rank}'}" for rank in (0, 1)
    ]
    (tmp_path / "a.json").write_text(json.dumps(recorded))

    code, report = doctor(
        capsys, path, *VLLM, "--model", "org/model-a", "--tp", "2", "--compare", str(tmp_path / "a.json")
    )
    assert code == 0 and report["compare"]["share"]
    code, report = doctor(
        capsys, path, *VLLM, "--model", "org/model-b", "--tp", "2", "--compare", str(tmp_path / "a.json")
    )
    assert code == 1 and report["compare"]["differences"] == ['model "org/model-b" vs "org/model-a"']
    assert report["sharing"]["digest"] != recorded["sharing"]["digest"]

    (tmp_path / "b.json").write_text(json.dumps(report))  # two recorded reports, compared as they are
    code, again = doctor(capsys, str(tmp_path / "b.json"), "--compare", str(tmp_path / "a.json"))
    assert (
        code == 1
        and again["checks"] == report["checks"]
        and again["compare"] == report["compare"] | {"other": str(tmp_path / "a.json")}
    )


def test_new_weights_in_a_local_model_folder_differ(tmp_path, capsys, server, secrets_set):
    model = tmp_path / "model"
    model.mkdir()
    (model / "weights.bin").write_bytes(b"first weights")
    path = write(tmp_path, stack(tmp_path, server.url))
    (tmp_path / "before.json").write_text(json.dumps(doctor(capsys, path, *VLLM, "--model", str(model))[1]))
    (model / "weights.bin").write_bytes(b"second weights, longer")
    code, report = doctor(capsys, path, *VLLM, "--model", str(model), "--compare", str(tmp_path / "before.json"))
    assert code == 1 and [d.split()[0] for d in report["compare"]["differences"]] == ["weights"]


def test_a_comparison_with_what_does_not_load_fails(tmp_path, capsys, server, secrets_set):
    path = write(tmp_path, stack(tmp_path, server.url))
    code, report = doctor(capsys, path, "--compare", str(tmp_path / "missing.yaml"))
    assert code == 1 and "no such file" in report["compare"]["error"]


@pytest.mark.parametrize(
    "args",
    [["--model", "m"], ["--engine", "vllm", "--model", "m", "--dtype", "bfloat16"], ["--engine", "vllm", "--tp", "0"]],
)
def test_engine_flags_that_name_no_engine_are_a_usage_error(tmp_path, capsys, args):
    assert main(["doctor", write(tmp_path, {"tiers": [{"medium": "host", "capacity_blocks": 4}]}), *args]) == 2
    assert "kvtier doctor:" in capsys.readouterr().out


def test_an_unresolved_dtype_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["doctor", "x.yaml", *VLLM[:2], "--dtype", "auto"])
    assert "not auto" in capsys.readouterr().err


# --- the console script ------------------------------------------------------------------------


def test_the_console_script_exits_0_then_1_naming_the_broken_item(tmp_path, server, secrets_set):
    script = Path(sys.executable).parent / "kvtier"
    path = write(tmp_path, stack(tmp_path, server.url))
    done = subprocess.run([script, "doctor", path, "--json"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True
    (tmp_path / "cache").mkdir(mode=0o777)
    os.chmod(tmp_path / "cache", 0o777)
    done = subprocess.run(
        [script, "doctor", path], capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "400"}
    )
    assert done.returncode == 1
    failing = [line for line in done.stdout.splitlines() if "FAIL" in line]
    assert len(failing) == 1 and "tiers[1] (disk) directory" in failing[0] and "writable by every user" in failing[0]


# --- a node tier -------------------------------------------------------------------------------


def node_stack(daemon_or_socket, block_bytes: int = BLOCK) -> dict:
    tier = (
        daemon_or_socket.tier() if hasattr(daemon_or_socket, "tier") else {"medium": "node", "socket": daemon_or_socket}
    )
    return {"block_tokens": TOKENS, "block_bytes": block_bytes, "tiers": [tier]}


def test_a_node_tier_whose_daemon_answers_passes_with_its_numbers(tmp_path, capsys):
    with node_daemon(tmp_path / "node", capacity="1MiB", block_bytes="64KiB") as daemon:
        code, report = doctor(capsys, write(tmp_path, node_stack(daemon)))
        assert code == 0, report
        (check,) = [c for c in report["checks"] if "daemon" in c["name"]]
        assert check["details"]["slots"] == 16 and "answers" in check["message"]
        wait_for(lambda: daemon.stats()["connected"] == 1)  # the doctor's connection goes: only this one is left


def test_a_node_tier_without_a_daemon_or_with_slots_too_small_fails(tmp_path, capsys, secrets_set):
    message = only_failure(*doctor(capsys, write(tmp_path, node_stack(str(tmp_path / "none.sock")))), "daemon")
    assert "no node daemon socket" in message
    with node_daemon(tmp_path / "node", capacity="1MiB", block_bytes="64KiB") as daemon:
        message = only_failure(*doctor(capsys, write(tmp_path, node_stack(daemon, 2 * BLOCK))), "daemon")
        assert "do not fit its slots of 65536" in message
        sealed = node_stack(daemon)
        sealed["tiers"][0].update(encryption="aes-gcm", encryption_key_env=SECRET_ENV)
        message = only_failure(*doctor(capsys, write(tmp_path, sealed)), "daemon")  # (its secrets pass)
        assert f"blocks of {BLOCK} bytes ({BLOCK + 32} sealed) do not fit its slots of 65536" in message


def test_doctor_reports_a_tiers_tenant_shares_in_blocks_and_whether_tenants_names_are_hidden(tmp_path, monkeypatch):
    host = {"medium": "host", "capacity_blocks": 100, "tenants": {"shares": {"alice": 0.25, "bob": 0.5}}}
    path = tmp_path / "kvtier.yaml"
    path.write_text(yaml.safe_dump({"block_bytes": 4096, "tiers": [host]}))
    check = next(c for c in diagnose(str(path))["checks"] if c["name"].endswith("tenants"))
    assert (
        check["ok"]
        and "alice 25, bob 50" in check["message"]
        and "0.25 of the tier held by no named share" in check["message"]
    )
    assert "a guessed id can be checked" in check["message"]
    monkeypatch.setenv("KVTIER_TEST_DOCTOR_SECRET", "a key-hashing secret of 32 bytes")
    path.write_text(
        yaml.safe_dump({"block_bytes": 4096, "key_secret_env": "KVTIER_TEST_DOCTOR_SECRET", "tiers": [host]})
    )
    check = next(c for c in diagnose(str(path))["checks"] if c["name"].endswith("tenants"))
    assert "guessed" not in check["message"] and check["details"]["capacity_blocks"] == 100


def test_the_printed_report_keeps_a_long_path_whole_in_a_log(tmp_path, capsys):
    """Printed where stdout is no terminal (a log), a check naming a disk path longer than 80 columns
    holds the whole path on one line: rich would cut it to fit 80 columns with "…"."""
    deep = tmp_path / ("a-directory-name-long-enough-" * 3) / "to-pass-eighty-columns-in-a-table" / "kv"
    config = {
        "block_tokens": TOKENS,
        "block_bytes": BLOCK,
        "tiers": [
            {"medium": "host", "capacity_blocks": 8},
            {"medium": "disk", "capacity_blocks": 8, "path": str(deep)},
        ],
    }
    assert main(["doctor", write(tmp_path, config)]) == 0
    out = capsys.readouterr().out
    assert str(deep) in out and "…" not in out
