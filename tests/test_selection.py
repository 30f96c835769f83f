import pytest

from attnviz.errors import UsageError
from attnviz.selection import parse_selection, resolve_index


@pytest.mark.parametrize(("spec", "expected"), [
    (None, [0, 1, 2, 3, 4, 5]),
    ("all", [0, 1, 2, 3, 4, 5]),
    ("0,2-4", [0, 2, 3, 4]),
    ("-1", [5]),
    ("-3--1", [3, 4, 5]),
    ("4, 1 ,1", [1, 4]),
])
def test_parse_selection(spec, expected):
    assert parse_selection(spec, 6, "layer") == expected


@pytest.mark.parametrize(("spec", "fragment"), [
    ("3-1", "start comes after the end"),
    ("a", "is not an index or a range"),
    ("6", "layer 6 is out of range: this model has 6 layers (0..5 or -6..-1)"),
    ("-7", "out of range"),
    ("1,,2", "empty item"),
])
def test_parse_selection_errors(spec, fragment):
    with pytest.raises(UsageError) as info:
        parse_selection(spec, 6, "layer")
    assert fragment in str(info.value)
    assert info.value.exit_code == 2


def test_resolve_index_negative():
    assert resolve_index(-1, 12, "head") == 11
    with pytest.raises(UsageError, match="0..11 or -12..-1"):
        resolve_index(12, 12, "head")
