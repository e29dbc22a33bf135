"""The README and docs/ say only what works: commands that run, links that resolve (issue 30).

Documentation rots silently: a flag is renamed, a page moves, a make target goes away, and the page
still reads well. So every command the README and ``docs/*.md`` show is checked against the real thing:

- ``kvtier ...`` against kvtier's own parser (``kvtier.cli.build_parser``), ``make TARGET`` against the
  Makefile, ``python bench/X.py --flag`` against the flags that script's argparse calls declare (read
  from its source, since most bench scripts import vLLM, SGLang or CUDA at the top);
- commands that are not kvtier's (``vllm serve``, SGLang's launcher) for their JSON arguments and the
  kvtier modules those name;
- fenced blocks marked ``sh runnable`` or ``python runnable`` by running them, as written, in an empty
  directory (docs/README.md states the convention);
- every relative link for a file of the repository, and its ``#anchor`` for a heading there.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from kvtier.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINKED_PAGES = [*PAGES, *sorted((ROOT / "bench" / "results").glob("*.md"))]
README_MAX_LINES = 250  # issue 30: a front page read in five minutes
HANG_LIMIT_S = 120  # runnable blocks take seconds; this only stops a hung one from holding the suite

FENCE = re.compile(r"^(`{3,}|~{3,})(.*)$")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
INLINE_CODE = re.compile(r"`([^`]+)`")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
PYTHON = re.compile(r"(^|/)python(3(\.\d+)?)?$")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")"}
REDIRECTS = {">", ">>", "<", "&>"}


@dataclass(frozen=True)
class Block:
    """A fenced code block of a page; ``runnable`` when its info string says so."""

    page: Path
    line: int
    language: str
    runnable: bool
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Page:
    """A page split into its fenced blocks and its prose (the text outside them, where links and inline code live)."""

    blocks: tuple[Block, ...]
    prose: tuple[tuple[int, str], ...]  # (line number, line)

    def paragraphs(self) -> list[tuple[int, str]]:
        """Prose lines joined up to each blank line: inline code and links may wrap onto the next line."""
        found: list[tuple[int, str]] = []
        previous = None
        for number, line in self.prose:
            if line.strip() and previous == number - 1 and found:
                found[-1] = (found[-1][0], f"{found[-1][1]}\n{line}")
            elif line.strip():
                found.append((number, line))
            previous = number if line.strip() else None
        return found


@cache
def read_page(path: Path) -> Page:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    prose: list[tuple[int, str]] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            prose.append((i + 1, lines[i]))
            i += 1
            continue
        fence, info = opening.group(1), opening.group(2).split()
        end = i + 1
        while end < len(lines) and not lines[end].startswith(fence):
            end += 1
        language = info[0] if info else ""
        body = "\n".join(lines[i + 1 : end]) + "\n"
        blocks.append(Block(path, i + 1, language, "runnable" in info[1:], body))
        i = end + 1
    return Page(tuple(blocks), tuple(prose))


def logical_lines(text: str) -> list[str]:
    """Shell lines joined across backslash continuations and quotes that span lines (a JSON argument)."""
    joined: list[str] = []
    pending = ""
    for line in text.splitlines():
        pending = f"{pending}\n{line}" if pending else line
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the argument goes on on the next line
            continue
        joined.append(pending)
        pending = ""
    assert not pending, f"unterminated shell line: {pending!r}"
    return joined


def simple_commands(line: str) -> list[list[str]]:
    """The simple commands of one shell line: split at separators, without redirections or VAR=value prefixes."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    skip_next = False
    for token in lexer:
        if skip_next:
            skip_next = False
        elif token in SEPARATORS:
            commands.append([])
        elif token in REDIRECTS:
            skip_next = True
        elif commands[-1] or not ENV_ASSIGNMENT.match(token):
            commands[-1].append(token)
    return [command for command in commands if command]


def sh_commands() -> list[tuple[str, list[str], bool]]:
    """Every simple command of every ``sh`` block, with where it stands."""
    found = []
    for page in PAGES:
        for block in read_page(page).blocks:
            if block.language in ("sh", "bash", "shell"):
                for line in logical_lines(block.text):
                    found += [(block.where, command, True) for command in simple_commands(line)]
    return found


def inline_commands() -> list[tuple[str, list[str], bool]]:
    """Inline code in prose that starts like a command kvtier owns (`kvtier ...`, `make ...`, a bench script)."""
    found = []
    for page in PAGES:
        for number, paragraph in read_page(page).paragraphs():
            for span in INLINE_CODE.findall(paragraph):
                words = span.split()
                if words and (words[0] in ("kvtier", "make") or is_python(words[0]) or is_bench(words[0])):
                    found.append((f"{page.relative_to(ROOT)}:{number}", shlex.split(span), False))
    return found


def is_python(word: str) -> bool:
    return bool(PYTHON.search(word))


def is_bench(word: str) -> bool:
    return word.startswith("bench/") and word.endswith(".py")


@cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return frozenset(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, flags=re.MULTILINE))


@cache
def script_flags(script: Path) -> frozenset[str]:
    """The option strings a script's argparse calls declare, read from its source without importing it."""
    flags = {"-h", "--help"}
    for node in ast.walk(ast.parse(script.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags.update(
                arg.value for arg in node.args if isinstance(arg, ast.Constant) and str(arg.value).startswith("-")
            )
    return frozenset(flags)


def check_kvtier(args: list[str], whole: bool) -> None:
    """A whole command line must parse; a mention in prose (`kvtier inspect`) must name a real subcommand and flags."""
    if whole:
        try:
            build_parser().parse_args(args)
        except SystemExit as exc:
            raise AssertionError(f"kvtier's parser refuses: kvtier {shlex.join(args)}") from exc
    elif args:
        options = kvtier_options(args[0])
        assert options is not None, f"kvtier has no subcommand {args[0]!r}"
        unknown = [arg for arg in args[1:] if arg.startswith("-") and arg.split("=")[0] not in options]
        assert not unknown, f"kvtier {args[0]} has no flag {unknown}"


def kvtier_options(subcommand: str) -> frozenset[str] | None:
    """The option strings of one kvtier subcommand (argparse keeps them in attributes it does not document)."""
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction) and subcommand in action.choices:
            return frozenset(action.choices[subcommand]._option_string_actions)
    return None


def check_make(args: list[str]) -> None:
    targets = [arg for arg in args if not arg.startswith("-") and "=" not in arg]
    missing = [target for target in targets if target not in make_targets()]
    assert not missing, f"no such make target: {missing}"


def check_script(script: str, args: list[str]) -> None:
    path = ROOT / script
    assert path.is_file(), f"no such script: {script}"
    unknown = [arg.split("=")[0] for arg in args if arg.startswith("-") and arg.split("=")[0] not in script_flags(path)]
    assert not unknown, f"{script} has no flag {unknown}"


def check_python(args: list[str]) -> None:
    """`python [options] script args` or `python -m module args`: a repository script's flags, a kvtier module."""
    i = 0
    while i < len(args) and args[i].startswith("-"):
        if args[i] == "-c":
            return
        if args[i] == "-m":
            check_modules(args[i + 1 : i + 2])
            return
        i += 2 if args[i] in ("-W", "-X") else 1
    if i < len(args) and (ROOT / args[i]).suffix == ".py":
        check_script(args[i], args[i + 1 :])


def check_modules(modules: list[str]) -> None:
    for module in modules:
        if module.split(".")[0] == "kvtier":
            assert importlib.util.find_spec(module) is not None, f"no such kvtier module: {module}"


def module_paths(value: object) -> list[str]:
    """Every value of a ``*module_path`` key in a JSON argument (where an engine is told to import kvtier)."""
    if isinstance(value, dict):
        found = [v for k, v in value.items() if k.endswith("module_path") and isinstance(v, str)]
        return found + [m for v in value.values() for m in module_paths(v)]
    if isinstance(value, list):
        return [m for v in value for m in module_paths(v)]
    return []


def check_json_arguments(args: list[str]) -> None:
    """JSON arguments (vllm's and SGLang's extra configs) parse, and the kvtier modules they name exist."""
    for arg in args:
        if arg.startswith("{"):
            try:
                value = json.loads(arg)
            except json.JSONDecodeError as exc:
                raise AssertionError(f"not JSON: {arg}") from exc
            check_modules(module_paths(value))


def check_command(command: list[str], whole: bool = True) -> None:
    """``whole``: a line of a code block, run as it stands; else a mention in prose, checked for its names."""
    word, args = command[0], command[1:]
    if word == "kvtier" or word.endswith("/bin/kvtier"):
        check_kvtier(args, whole)
    elif word == "make":
        check_make(args)
    elif is_python(word):
        check_python(args)
    elif is_bench(word):
        check_script(word, args)
    elif word in ("bash", "sh") and args and args[0].startswith("scripts/"):
        assert (ROOT / args[0]).is_file(), f"no such script: {args[0]}"
    check_json_arguments(args)


def test_readme_is_a_front_page():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines, more than {README_MAX_LINES}: move text to docs/"


def test_readme_keeps_the_two_commands_first():
    """.ci/run and CI run "the test command from the README": the section comes first after the intro."""
    headings = [m.group(1) for _, line in read_page(README).prose if (m := HEADING.match(line))]
    assert headings[:2] == ["kvtier", "Two commands"]
    first_block = read_page(README).blocks[0]
    assert [line.split("#")[0].strip() for line in first_block.text.splitlines()] == ["make demo", "make test"]


@pytest.mark.parametrize(("where", "command", "whole"), sh_commands() + inline_commands(), ids=lambda x: str(x)[:60])
def test_command_is_valid(where, command, whole):
    try:
        check_command(command, whole)
    except AssertionError as exc:
        raise AssertionError(f"{where}: {shlex.join(command)}: {exc}") from None


def test_the_checks_find_commands():
    """The checks above would pass vacuously if parsing found nothing: they must see the pages' commands."""
    words = {command[0] for _, command, _ in sh_commands() + inline_commands()}
    assert {"kvtier", "make", "vllm"} <= words


@pytest.mark.parametrize(
    "command",
    [
        ["kvtier", "replay", "--no-such-flag"],
        ["make", "no-such-target"],
        [".venv/bin/python", "bench/disk.py", "--no-such-flag"],
        ["vllm", "serve", "M", '{"kv_connector_module_path": "kvtier.connectors.no_such_module"}'],
        ["vllm", "serve", "M", '{"not json"'],
    ],
    ids=["kvtier flag", "make target", "bench flag", "module path", "json"],
)
def test_a_wrong_command_is_caught(command):
    with pytest.raises(AssertionError):
        check_command(command)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """A page's heading anchors; GitHub numbers repeated ones: #usage, #usage-1, ..."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in read_page(path).prose:
        if match := HEADING.match(line):
            anchor = github_anchor(match.group(1))
            count = counts.get(anchor, 0)
            counts[anchor] = count + 1
            found.add(anchor if count == 0 else f"{anchor}-{count}")
    return frozenset(found)


def relative_links() -> list[tuple[str, Path, str]]:
    found = []
    for page in LINKED_PAGES:
        for number, paragraph in read_page(page).paragraphs():
            for target in LINK.findall(INLINE_CODE.sub("", paragraph)):
                if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not files here
                    found.append((f"{page.relative_to(ROOT)}:{number}", page, target))
    return found


@pytest.mark.parametrize(("where", "page", "target"), relative_links(), ids=lambda x: str(x)[:60])
def test_link_resolves(where, page, target):
    path_part, _, anchor = target.partition("#")
    path = (page.parent / path_part).resolve() if path_part else page
    assert path.is_relative_to(ROOT) and path.is_file(), f"{where}: {target} is not a file of the repository"
    if anchor and path.suffix == ".md":
        assert anchor in anchors(path), f"{where}: {target}: no heading with anchor #{anchor} in {path.name}"


def runnable_blocks() -> list[Block]:
    return [block for page in PAGES for block in read_page(page).blocks if block.runnable]


@pytest.mark.parametrize("block", runnable_blocks(), ids=lambda block: block.where)
def test_runnable_block_runs(block, tmp_path):
    """As a reader would: in an empty directory, with this venv's kvtier and python first on PATH."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    if block.language == "python":
        (tmp_path / "block.py").write_text(block.text, encoding="utf-8")
        argv = [sys.executable, "block.py"]
    else:
        assert block.language in ("sh", "bash"), f"{block.where}: cannot run a {block.language!r} block"
        argv = ["bash", "-euo", "pipefail", "-c", block.text]
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=HANG_LIMIT_S)
    assert done.returncode == 0, (
        f"{block.where} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    )


def test_runnable_blocks_exist():
    """The README's Python quick start at least is run for real."""
    assert any(block.page == README and block.language == "python" for block in runnable_blocks())
