"""Defects found by using the commands as a new user, a hostile user and a domain expert would.

Each test failed before its fix: the compare table outside the zoom window, and the others below.
"""

from __future__ import annotations

import json
from pathlib import Path

TOY = ("--model", "toy")


def test_compare_changes_stay_inside_the_zoom_window(invoke, tmp_path: Path) -> None:
    """--tokens cuts the figure to a window; the listed changes must come from that window too."""
    for a, b in (("The cat sat on the mat", "The dog sat on the rug"),  # positions
                 ("The cat sat on the mat and then slept", "The dog sat on the rug")):  # words
        result = invoke("compare", a, b, *TOY, "--layer", "0", "--head", "0", "--tokens", "0:3",
                        "-k", "50", "-f", "json", "-o", tmp_path / "c.png")
        assert result.exit_code == 0, result.output
        data = json.loads(result.stdout)
        changes = data["changes"]
        assert changes, "no changes listed"
        pairs = data["alignment"]["pairs"]
        for change in changes:
            a_query = change.get("a_query_index", change["query_index"])
            a_key = change.get("a_key_index", change["key_index"])
            assert 0 <= a_query < 3 and 0 <= a_key < 3, change
        # Every cell of the window (3 x 3 aligned pairs) is listed, none outside it.
        inside = [pair for pair in pairs if pair[0] < 3]
        assert len(changes) == len(inside) ** 2


# Text that str.isdigit() calls a number but int() refuses ('²', '--3'): a usage error, not a
# traceback, wherever a position may be typed.
ODD_NUMBERS = ("\u00b2", "--3", "1\u00b2", "-\u00b9")


def _no_traceback(result) -> None:
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output


def test_windows_with_odd_numbers_are_usage_errors(invoke, tmp_path: Path) -> None:
    for odd in ODD_NUMBERS:
        for option, value in (("--tokens", f"{odd}:"), ("--tokens", f"0:{odd}"),
                              ("--queries", odd), ("--keys", f":{odd}")):
            result = invoke("heatmap", "a b c", *TOY, "-l", "0", "--head", "0", option, value,
                            "-o", tmp_path / "h.png")
            _no_traceback(result)
            assert result.exit_code == 2, (option, value, result.output)
            assert option in result.output
            assert not (tmp_path / "h.png").exists()


def test_token_choice_with_odd_numbers_is_a_usage_error(invoke, tmp_path: Path) -> None:
    for odd in ODD_NUMBERS:
        for spec in (odd, f"cat:{odd}"):
            for command in (("rollout", "the cat sat", *TOY, "--token", spec,
                             "-o", tmp_path / "r.png"),
                            ("explain", "the cat sat", "--token", spec)):
                result = invoke(*command)
                _no_traceback(result)
                assert result.exit_code == 2, (command, result.output)
                assert "no token" in result.output

