"""The package CLIs' parsing (mlx_qwen_fast/_cli_parser.py): usage errors on
one line with exit code 2, typed values, and the package's flags taken out
of mlx-lm's argv."""

import argparse

import pytest

from mlx_qwen_fast import _cli_parser


def test_the_parsers_error_is_one_line(capsys):
    """The package CLIs' parser prints a message of several lines (an
    exception's text) as one line, exit code 2."""
    parser = _cli_parser.ArgumentParser(prog="prog")
    with pytest.raises(SystemExit) as e:
        parser.error("could not load:\n  first\n\tsecond ")
    assert e.value.code == 2
    assert capsys.readouterr().err == "prog: error: could not load: first second\n"


def test_typed_values_name_what_they_expect():
    """whole_number and finite_number return the value, or raise argparse's
    type error saying what was expected (argparse puts the flag in front)."""
    assert _cli_parser.whole_number(1)("3") == 3
    assert _cli_parser.finite_number(0.0)("0") == 0.0
    for convert, text, expect in ((_cli_parser.whole_number(1), "0", "expected a whole number >= 1, got 0"),
                                  (_cli_parser.whole_number(1), "x", "expected a whole number >= 1, got 'x'"),
                                  (_cli_parser.finite_number(0.0, inclusive=False), "0",
                                   "expected a finite number > 0, got 0"),
                                  (_cli_parser.finite_number(0.0), "nan", "expected a finite number >= 0, got nan")):
        with pytest.raises(argparse.ArgumentTypeError, match=expect):
            convert(text)


def test_take_flag_in_both_spellings(capsys):
    """take_flag takes ``FLAG VALUE`` or ``FLAG=VALUE`` out of argv and
    leaves the rest in order; absent, the value is None; without a value or
    twice, a one-line usage error with exit code 2."""
    assert _cli_parser.take_flag(["-m", "2", "--dtype", "float32", "--x"], "--dtype", "a dtype") == \
        (["-m", "2", "--x"], "float32")
    assert _cli_parser.take_flag(["--dtype=float16", "-m", "2"], "--dtype", "a dtype") == (["-m", "2"], "float16")
    assert _cli_parser.take_flag(["-m", "2"], "--dtype", "a dtype") == (["-m", "2"], None)
    for argv, expect in ((["--dtype"], "--dtype: expected a dtype after it"),
                         (["--dtype", "--stock"], "--dtype: expected a dtype after it"),
                         (["--dtype=a", "--dtype", "b"], "--dtype given 2 times: expected one")):
        with pytest.raises(SystemExit) as e:
            _cli_parser.take_flag(argv, "--dtype", "a dtype")
        assert e.value.code == 2
        assert capsys.readouterr().err == f"mlx_qwen_fast: error: {expect}\n"
