"""The README's examples run as written, so they cannot rot.

Every ```python block runs on the CPU in a fresh namespace, the Hugging Face one (which needs transformers)
included, and a line printing a value named in its comment must print it. Every ``flashdsa ...`` command
in a ```bash block parses with the real command line, every ``--flag`` the README mentions exists,
every ``make`` target it names is in the Makefile, and every local file it links exists.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest
import torch

from flashdsa.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.M | re.S)


PYTHON = _blocks("python")
HF_BLOCK = "flashdsa.hf.apply("


def test_readme_has_the_examples():
    assert len(PYTHON) >= 3
    assert sum(HF_BLOCK in b for b in PYTHON) == 1


@pytest.mark.parametrize("code", PYTHON, ids=[f"block{i}" for i in range(len(PYTHON))])
def test_python_block_runs(code):
    if HF_BLOCK in code:
        pytest.importorskip("transformers")
    with contextlib.redirect_stdout(io.StringIO()) as out:
        exec(compile(code, "README.md", "exec"), {})
    # A printed line with an expected value in its comment must print that value.
    for line in code.splitlines():
        m = re.match(r"print\((.*)\)\s+# (torch\.Size\(\[[\d, ]+\]\)(?: torch\.Size\(\[[\d, ]+\]\))*|True)", line)
        if m:
            assert m[2] in out.getvalue(), (line, out.getvalue())


def _flashdsa_commands() -> list[list[str]]:
    cmds = []
    for block in _blocks("bash"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0].endswith("flashdsa"):
                cmds.append(words[1:])
            elif words and words[0] == "torchrun" and "-m" in words:  # one process per rank
                module = words.index("-m") + 1
                assert words[module] in ("flashdsa", "flashdsa.cli"), line
                cmds.append(words[module + 1:])
    return cmds


@pytest.mark.parametrize("argv", _flashdsa_commands(), ids=" ".join)
def test_bash_command_parses(argv):
    build_parser().parse_args(argv)  # a stale flag or value raises UsageError


TORCHRUN_FLAGS = {"--standalone", "--nproc-per-node"}  # torchrun's own, in the launch lines


def _options(parser) -> set[str]:
    opts = set(parser._option_string_actions)
    for action in parser._actions:
        for sub in getattr(action, "choices", None) or {}:
            if isinstance(action.choices, dict):
                opts |= _options(action.choices[sub])
    return opts


def test_every_flag_mentioned_exists():
    known = _options(build_parser())
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", README)) - TORCHRUN_FLAGS
    assert mentioned and mentioned <= known, sorted(mentioned - known)


def test_make_targets_and_links_exist():
    makefile = (REPO / "Makefile").read_text()
    for target in re.findall(r"(?<![\w/.-])make (\w+)", README):
        assert re.search(rf"^{target}:", makefile, flags=re.M), f"make {target}"
    for link in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" not in link:
            assert (REPO / link).is_file(), link
