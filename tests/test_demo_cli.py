"""The demo through the command line: ``flashdsa demo --json`` prints one JSON object that says ok.

Only the stable contract is checked (exit code, one JSON object, ok, the device); the report's other
keys belong to the demo and change with it.
"""

from __future__ import annotations

import json

from flashdsa.cli import main


def test_demo_json(capsys):
    rc = main(["demo", "--json"])
    out = capsys.readouterr().out
    report = json.loads(out)  # exactly one JSON object, nothing else on stdout
    assert isinstance(report, dict)
    assert report["ok"] is True
    assert rc == 0
    assert report["device"] == "cpu"


def test_demo_bad_next_n_exits_2(capsys):
    rc = main(["demo", "--json", "--next-n", "0"])
    captured = capsys.readouterr()
    assert rc == 2
    assert "next_n" in captured.err
