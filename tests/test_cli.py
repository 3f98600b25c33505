"""What every ``flashdsa`` command shares: ``python -m flashdsa``, ``--version``, help that shows the defaults,
and one meaning of ``--json`` (alone: the JSON object on stdout instead of the text; ``--json PATH``: written
there). The commands themselves: tests/test_demo_cli.py, tests/test_plan.py, tests/test_bench.py,
tests/test_report.py."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

import flashdsa
from flashdsa.cli import _subparser, build_parser, main

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ("demo", "plan", "bench", "report")


def test_python_dash_m_flashdsa_prints_the_version():
    from importlib.metadata import version

    proc = subprocess.run([sys.executable, "-m", "flashdsa", "--version"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"flashdsa {flashdsa.__version__}" == f"flashdsa {version('flashdsa')}"
    # one source of truth: pyproject.toml reads flashdsa.__version__
    assert 'version = { attr = "flashdsa.__version__" }' in (REPO / "pyproject.toml").read_text()


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_shows_every_default(cmd, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([cmd, "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for action in _subparser(build_parser(), cmd)._actions:
        if action.default not in (None, False, argparse.SUPPRESS) and action.help != argparse.SUPPRESS:
            assert f"(default: {action.default})" in text, (cmd, action.option_strings)


@pytest.mark.parametrize("cmd", COMMANDS)
def test_json_means_the_same_everywhere(cmd):
    (action,) = [a for a in _subparser(build_parser(), cmd)._actions if "--json" in a.option_strings]
    assert (action.nargs, action.const, action.default) == ("?", "-", None), cmd


def test_plan_json_alone_and_with_a_path(capsys, tmp_path):
    assert main(["plan", "--preset", "tiny", "--json"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out)  # only the JSON object
    path = tmp_path / "plan.json"
    assert main(["plan", "--preset", "tiny", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    assert json.loads(path.read_text()) == report
    assert "{" not in captured.out and captured.out.strip() and f"wrote {path}" in captured.err


@pytest.mark.parametrize("cmd", ["demo", "plan"])
def test_json_path_in_a_missing_folder_is_refused_first(cmd, capsys):
    assert main([cmd, "--json", "/no/such/folder/out.json"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"flashdsa {cmd}: --json: the folder of /no/such/folder/out.json does not exist")
    assert captured.out == ""
