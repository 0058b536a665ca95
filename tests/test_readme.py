"""What the README states about results and timings agrees with its sources:
the bf16 bound with the test that checks it, the first-use figures with the
benchmark section it cites."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _section(text: str, heading: str) -> str:
    """The text under the markdown heading ``heading`` up to the next heading of any level."""
    start = text.index(heading)
    rest = text[start + len(heading):]
    end = re.search(r"^#{1,6} ", rest, flags=re.M)
    return rest[: end.start() if end else len(rest)]


def test_the_bf16_claim_is_the_tests_bound():
    """The README claims no more for bf16 than tests/test_patch.py checks:
    within its rounding bound of stock (twice stock's error against fp32
    plus four times bf16's unit roundoff)."""
    text = " ".join(README.split())
    assert "in bf16 the patched results are within the tests' rounding bound of stock" in text
    assert "at most twice stock's plus four times bf16's unit roundoff, 2^-8" in text
    assert "no further from the fp32 logits than stock" not in text
    source = (ROOT / "tests" / "test_patch.py").read_text()
    assert "assert err_fast <= 2 * err_stock + 4 * BF16_EPS" in source
    assert "BF16_EPS = UNIT_ROUNDOFF[mx.bfloat16]" in (ROOT / "tests" / "compare.py").read_text()


def test_the_first_use_timings_say_what_they_consist_of():
    """The first run's figures with and without the compile workers, and the
    second run's 16-18 s with its parts, import (~11 s, mostly mlx-lm
    importing transformers/PyTorch) and loading the checkpoint (~8 s), as the
    cited section of bench/results/package-figures.md has them."""
    readme = " ".join(_section(README, "## First use on a machine").split())
    assert "on a fresh machine waited 145 s (H200) to 152 s (H100) for its first token" in readme
    assert "the second 16-18 s, of which ~11 s importing" in readme
    assert "mlx-lm importing transformers, and through it PyTorch" in readme
    assert "~8 s loading the 19.5 GB checkpoint" in readme
    assert "reached its first token at 56 s instead of 152 s" in readme
    cited = " ".join(_section((ROOT / "bench" / "results" / "package-figures.md").read_text(),
                              "## First use").split())
    for figure in ("first token at 144.5 s", "first token at 16.4 s", "first token at 18.0 s", "import ~11 s with PyTorch",
                   "load of the 19.5 GB checkpoint ~8 s", "**first token at 56.4 s**", "**151.7 s**"):
        assert figure in cited, figure
