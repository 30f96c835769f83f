"""Every CSV attnviz writes opens safely in a spreadsheet: no token runs as a formula."""

from __future__ import annotations

import csv
import io

import pytest

from attnviz.csvtext import csv_text, safe_cell

HOSTILE = "=HYPERLINK(x) +cmd -sum @ref plain"
TOY = ["--model", "toy", "--toy-layers", "1", "--toy-heads", "2"]


@pytest.mark.parametrize("value,expected", [
    ("=1+1", "'=1+1"), ("+cmd", "'+cmd"), ("-sum(A1)", "'-sum(A1)"), ("@ref", "'@ref"),
    ("\tx", "'\tx"), ("\rx", "'\rx"), ("plain", "plain"), ("-0.250000", "-0.250000"),
    ("+0.010000", "+0.010000"), (3, 3), ("", ""),
])
def test_safe_cell(value, expected):
    assert safe_cell(value) == expected


def test_csv_text_round_trips_safe_rows():
    text = csv_text(["a", "b"], [["=x", "-1.5"], ["y,z", 'q"uote']])
    assert list(csv.reader(io.StringIO(text))) == [["a", "b"], ["'=x", "-1.5"],
                                                   ["y,z", 'q"uote']]


def _cells(text: str) -> list[str]:
    return [cell for row in csv.reader(io.StringIO(text)) for cell in row]


def _assert_no_formula(text: str) -> None:
    cells = _cells(text)
    assert cells, "no CSV rows"
    for cell in cells:
        if cell[:1] in ("=", "+", "-", "@"):
            float(cell)  # only signed numbers may start that way


@pytest.mark.parametrize("args,has_tokens", [
    (["top-k", HOSTILE, "-l", "0", "--head", "0", "--format", "csv"], True),
    (["heads", HOSTILE, "--format", "csv"], False),
    (["compare", HOSTILE, HOSTILE.replace("plain", "other"), "--layer", "0", "--head", "0",
      "--format", "csv"], True),
])
def test_commands_write_safe_csv(invoke, tmp_path, monkeypatch, args, has_tokens):
    monkeypatch.chdir(tmp_path)
    result = invoke(*args, *TOY)
    assert result.exit_code == 0, result.output
    _assert_no_formula(result.stdout)
    assert ("'=" in result.stdout) is has_tokens


def test_export_topk_csv_is_safe(invoke, tmp_path):
    out = tmp_path / "out"
    result = invoke("export", HOSTILE, *TOY, "-o", out)
    assert result.exit_code == 0, result.output
    files = list(out.rglob("topk.csv"))
    assert files
    text = files[0].read_text("utf-8")
    _assert_no_formula(text)
    assert "'=" in text
