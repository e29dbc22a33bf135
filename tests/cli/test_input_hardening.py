"""Hostile and careless input (issue 11): every one ends in one clear error, fast, never a hang,
a traceback or code run for a config that is refused.

Invariants checked:
- YAML aliases are refused while the file is parsed, before any value is built: an alias bomb
  (nested anchors, a few hundred bytes that expand to 9**8 strings) within a second, a merge key
  ``<<: *x`` too, each naming the file, the line and column, and the fix;
- a dotted eviction path is imported only once the whole config validated: a module that leaves a
  marker file when imported leaves none for a config refused for another mistake, and one for the
  same config without it; a path that fails to import or is no policy names ``tiers[i].eviction``;
- ``key_secret_env`` that is not an environment variable's name says what it must be;
- every bad trace line (a length of 1e400, a negative length, a boolean, float, negative or >= 2**64
  id, no ``hash_ids``, a line that is no JSON object, ...) makes ``kvtier replay`` exit 2 with one
  line on stderr naming the file, the line number and the field; an empty ``hash_ids`` list and left
  out optional fields are valid;
- a capacity the machine cannot provide (``--block-bytes 100GiB``, a tier of 2**60 bytes, a host
  tier just over the machine's RAM, replay buffers past the address space) is an error naming the
  tier, the blocks and the bytes, and the tiers built before it are released (their disk lock too).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import pytest

from helpers.config_helpers import error_of
from helpers.replay_helpers import write
from kvtier.builder import build_stack
from kvtier.cli import main
from kvtier.core.config import load_config
from kvtier.core.errors import ConfigError
from kvtier.policies import eviction_policy_class
from kvtier.replay.trace import load_trace
from kvtier.tiers.host import physical_memory

# --- YAML aliases ------------------------------------------------------------------------------

# 9 levels of 9 aliases each: 9**8 (43 million) strings in tiers[8] once expanded.
ALIAS_BOMB = "tiers:\n  - &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"  - &{name} [{', '.join([f'*{prev}'] * 9)}]\n" for prev, name in zip("abcdefgh", "bcdefghi", strict=True)
)


def test_an_alias_bomb_is_refused_within_a_second(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text(ALIAS_BOMB)
    assert len(ALIAS_BOMB) < 600
    started = time.monotonic()
    msg = error_of(path)
    assert time.monotonic() - started < 1.0
    assert msg == (
        f"{path}: line 3, column 9: YAML error: aliases (*a) are not allowed in a kvtier config; write the value out"
    )


def test_a_merge_key_is_an_alias_and_refused(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text("host: &host {medium: host, capacity: 1GiB}\ntiers:\n  - <<: *host\n    name: fast\n")
    msg = error_of(path)
    assert msg.startswith(f"{path}: line 3, column 9: ") and "aliases (*host) are not allowed" in msg


def test_an_anchor_without_an_alias_is_plain_yaml(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text("tiers:\n  - &host {medium: host, capacity: 1GiB}\n")
    assert load_config(path).tiers[0].capacity == 2**30


# --- dotted eviction paths ---------------------------------------------------------------------

MARKED_MODULE = """
    import pathlib

    from kvtier.policies import LRUPolicy

    pathlib.Path(__file__).with_name("imported").write_text("the config's code ran")
    raise_on_import = {raise_on_import}
    if raise_on_import:
        raise RuntimeError("broken on purpose")


    class MarkedPolicy(LRUPolicy):
        pass


    class NotAPolicy:
        pass
"""


@pytest.fixture
def marked_module(tmp_path, monkeypatch, request):
    """A module on sys.path that writes ``tmp_path/imported`` when imported; its name is unique to the test.
    Call it with raise_on_import=True for a module that fails after writing the marker."""
    name = "kvtier_marked_" + "".join(c if c.isalnum() else "_" for c in request.node.name)
    monkeypatch.syspath_prepend(str(tmp_path))

    def make(raise_on_import: bool = False) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(MARKED_MODULE.format(raise_on_import=raise_on_import)))
        return name

    yield make
    sys.modules.pop(name, None)


def test_a_dotted_policy_is_imported_only_after_the_whole_config_validated(tmp_path, marked_module):
    config = {
        "block_bytes": "4KiB",
        "placement": "write_bak",
        "tiers": [{"medium": "host", "capacity_blocks": 4, "eviction": f"{marked_module()}.MarkedPolicy"}],
    }
    msg = error_of(config)
    assert "placement: 'write_bak' is not allowed" in msg
    assert not (tmp_path / "imported").exists()  # refused: the module never ran

    config["placement"] = "write_back"
    cfg = load_config(config)
    assert (tmp_path / "imported").read_text() == "the config's code ran"
    stack = build_stack(cfg)
    try:
        assert type(stack.tiers[0].policy).__name__ == "MarkedPolicy"
    finally:
        stack.close()


def test_a_dotted_policy_that_fails_on_import_names_its_key(tmp_path, marked_module):
    name = marked_module(raise_on_import=True)
    msg = error_of(
        {
            "tiers": [
                {"medium": "gpu", "capacity_blocks": 2},
                {"medium": "host", "capacity": "1GiB", "eviction": f"{name}.MarkedPolicy"},
            ]
        }
    )
    assert msg == (
        f"config: tiers[1].eviction: eviction policy '{name}.MarkedPolicy' cannot be loaded: "
        f"RuntimeError: broken on purpose"
    )


def test_a_dotted_path_to_something_else_names_its_key(marked_module):
    msg = error_of({"tiers": [{"medium": "host", "capacity": "1GiB", "eviction": f"{marked_module()}.NotAPolicy"}]})
    assert msg.startswith("config: tiers[0].eviction: ") and "is not a subclass of" in msg


@pytest.mark.parametrize("name", ["my policy", "pkg..Policy", "pkg.1st.Policy", "pkg.mod:Cls:x", "Policy"])
def test_a_name_that_is_no_dotted_path_is_refused_without_an_import(name):
    msg = error_of({"tiers": [{"medium": "host", "capacity": "1GiB", "eviction": name}]})
    assert f"tiers[0].eviction: unknown eviction policy {name!r}" in msg and "dotted path" in msg


def test_both_spellings_of_a_dotted_path_load(marked_module):
    name = marked_module()
    assert eviction_policy_class(f"{name}:MarkedPolicy") is eviction_policy_class(f"{name}.MarkedPolicy")


# --- key_secret_env ----------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["KVTIER KEY", "1SECRET", "$KVTIER_KEY_SECRET", ""])
def test_key_secret_env_must_name_an_environment_variable(value):
    msg = error_of({"key_secret_env": value, "tiers": [{"medium": "host", "capacity": "1GiB"}]})
    assert msg == (
        f"config: key_secret_env: {value!r} is not the name of an environment variable, e.g. KVTIER_KEY_SECRET"
    )


# --- trace lines -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"hash_ids": [1], "input_length": 1e400}', "input_length: expected an integer in [0, 2**63), got Infinity"),
        ('{"hash_ids": [1], "input_length": -512}', "input_length: expected an integer in [0, 2**63), got -512"),
        ('{"hash_ids": [1], "output_length": -1}', "output_length: expected an integer in [0, 2**63), got -1"),
        ('{"hash_ids": [1], "input_length": 512.0}', "input_length: expected an integer in [0, 2**63), got 512.0"),
        ('{"hash_ids": [1], "output_length": true}', "output_length: expected an integer in [0, 2**63), got true"),
        ('{"hash_ids": [1], "input_length": 9223372036854775808}', "input_length: expected an integer in [0, 2**63)"),
        ('{"hash_ids": [1, true]}', "hash_ids[1]: expected an integer in [0, 2**64), got true"),
        ('{"hash_ids": [1, 2.0]}', "hash_ids[1]: expected an integer in [0, 2**64), got 2.0"),
        ('{"hash_ids": [-1]}', "hash_ids[0]: expected an integer in [0, 2**64), got -1"),
        (
            '{"hash_ids": [18446744073709551616]}',
            "hash_ids[0]: expected an integer in [0, 2**64), got 18446744073709551616",
        ),
        ('{"hash_ids": [7, 8, 7]}', "hash_ids[2]: 7 repeats an earlier id"),
        ('{"hash_ids": "1,2"}', 'hash_ids: expected a list of block ids, got "1,2"'),
        ('{"hash_ids": null}', "hash_ids: expected a list of block ids, got null"),
        ('{"input_length": 512, "output_length": 1}', "missing field 'hash_ids'"),
        ("[1, 2]", "expected a JSON object, got [1, 2]"),
        ('"hash_ids"', 'expected a JSON object, got "hash_ids"'),
        ('{"hash_ids": [1], "timestamp": NaN}', "timestamp: expected a finite number, got NaN"),
        ('{"hash_ids": [1], "timestamp": -Infinity}', "timestamp: expected a finite number, got -Infinity"),
        ('{"hash_ids": [1], "timestamp": false}', "timestamp: expected a finite number, got false"),
        ('{"hash_ids": [1], "timestamp": "0"}', 'timestamp: expected a finite number, got "0"'),
        ('{"hash_ids": [1, 2', "invalid JSON"),
        ("[" * 100_000, "JSON nested too deeply"),
    ],
)
def test_each_bad_trace_line_exits_2_naming_file_line_and_field(tmp_path, capsys, line, problem):
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]}\n' + line + "\n")
    assert main(["replay", str(trace), "--metadata-only", "--capacity", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvtier replay: {trace}:2: not a Mooncake trace line: ") and problem in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(b'{"hash_ids": [1]}\n{"hash_ids": [2], "note": "\xff"}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:2: not a Mooncake trace line: invalid JSON \('utf-8' codec"):
        load_trace(trace)


def test_optional_fields_and_an_empty_request_are_valid(tmp_path, capsys):
    # A request shorter than one block has no ids; left-out fields are 0; a float timestamp is a time.
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"hash_ids": [1, 2]}\n{"timestamp": 2.5, "hash_ids": []}\n{"hash_ids": [1, 3], "extra": 1}\n')
    requests = load_trace(trace)
    assert [(r.timestamp, r.input_length, r.output_length, r.hash_ids) for r in requests] == [
        (0, 0, 0, (1, 2)),
        (2.5, 0, 0, ()),
        (0, 0, 0, (1, 3)),
    ]
    assert main(["replay", str(trace), "--json"]) == 0  # through a real stack as well
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["requests"], summary["references"], summary["hits"]) == (3, 4, 1)


# --- capacities the machine cannot provide -----------------------------------------------------


def test_block_bytes_of_100gib_exits_2_naming_the_tier(capsys):
    # The embedded stack's GPU tier holds 256 blocks: 25 TiB, on CUDA or on CPU stand-ins.
    assert main(["replay", "--conversations", "2", "--block-bytes", "100GiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier replay: tiers[0] (gpu): 256 blocks of 100GiB (25TiB in all) cannot be allocated: ")
    assert err.rstrip().endswith("lower its capacity or block_bytes")
    assert err.count("\n") == 1 and "Traceback" not in err


def test_replay_buffers_past_the_address_space_exit_2(tmp_path, capsys):
    # Tiers of 2 blocks fit, but a request of 2**20 blocks of 128 MiB needs a 128 TiB staging buffer:
    # refused by the kernel's overcommit heuristic, and past a 47-bit address space in any mode.
    config = tmp_path / "stack.yaml"
    config.write_text("block_bytes: 4KiB\ntiers:\n  - medium: host\n    capacity_blocks: 2\n")
    trace = write(tmp_path / "t.jsonl", [list(range(2**20))])
    assert main(["replay", str(trace), "--config", str(config), "--block-bytes", "128MiB"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier replay: out of memory (") and "lower --block-bytes" in err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "tiers, message",
    [
        # A GPU tier on CUDA is refused by the device (out of memory), on CPU stand-ins by the RAM check.
        (
            [{"medium": "gpu", "capacity": 2**60}],
            "tiers[0] (gpu): 281474976710656 blocks of 4KiB (1048576TiB in all) cannot be allocated: ",
        ),
        (
            [{"medium": "gpu", "capacity_blocks": 2}, {"medium": "host", "name": "dram", "capacity": 2**60}],
            "tiers[1] (dram): 281474976710656 blocks of 4KiB (1048576TiB in all) cannot be allocated: more than the ",
        ),
        (
            [{"medium": "host", "capacity_blocks": 2**80}],
            "tiers[0] (host): 1208925819614629174706176 blocks of 4KiB (4503599627370496TiB in all) cannot be "
            "allocated: more than the ",
        ),
    ],
)
def test_a_huge_capacity_names_the_tier(tiers, message):
    with pytest.raises(ConfigError) as info:
        build_stack(load_config({"block_bytes": "4KiB", "tiers": tiers}))
    assert str(info.value).startswith(message)


@pytest.mark.skipif(physical_memory() is None, reason="the OS does not say how much memory it has")
def test_a_host_tier_larger_than_the_machine_is_refused_before_mapping():
    # Anonymous memory is mapped lazily: without the check this tier would be built, and the process
    # killed when it filled. Just over the machine's RAM is refused, naming the tier and the RAM.
    blocks = physical_memory() // 4096 + 1
    with pytest.raises(ConfigError) as info:
        build_stack(load_config({"block_bytes": "4KiB", "tiers": [{"medium": "host", "capacity_blocks": blocks}]}))
    gib = f"{physical_memory() / 2**30:.1f} GiB"
    assert str(info.value).startswith(f"tiers[0] (host): {blocks} blocks of 4KiB")
    assert f"more than the {gib} of memory this machine has; lower its capacity or block_bytes" in str(info.value)


def test_tiers_built_before_a_failing_one_are_released(tmp_path):
    # The disk tier is opened (and locked) first; the host tier after it cannot be had. The error names
    # the host tier, and the disk tier was closed: the same directory opens again in this process.
    disk = {"medium": "disk", "path": str(tmp_path / "disk"), "capacity_blocks": 4}
    with pytest.raises(ConfigError, match=r"^tiers\[1\] \(host\): 281474976710656 blocks of 4KiB"):
        build_stack(load_config({"block_bytes": "4KiB", "tiers": [disk, {"medium": "host", "capacity": 2**60}]}))
    stack = build_stack(load_config({"block_bytes": "4KiB", "tiers": [disk]}))
    try:
        assert stack.tiers[0].capacity == 4 and os.path.isdir(tmp_path / "disk")
    finally:
        stack.close()
