"""User-facing text speaks to users: no issue numbers, no notes about how the work was done, no files outside the repo."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
USER_TEXT = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.py")])

# Each pattern names a kind of internal wording a user cannot act on (matched in any case).
INTERNAL = {
    "an issue number": r"\bissue\s+#?\d+",
    "the project's work notes ('this session', 'the issue's ...')": r"\bthis (session|stop|task)\b|\bthe issue'?s?\b",
    "whether a GPU was lent": r"\b(was|were|is) lent\b|\bnone was lent\b",
    "a file outside the repository": r"(?<![\w.])shared/[\w-]+\.md|\.\./\.library|\.library/",
}
INTERNAL = {what: re.compile(pattern, re.IGNORECASE) for what, pattern in INTERNAL.items()}


@pytest.mark.parametrize("path", USER_TEXT, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_internal_wording(path):
    found = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        for what, pattern in INTERNAL.items():
            m = pattern.search(line)
            if m:
                found.append(f"{path.name}:{lineno}: {what}: {m.group(0)!r}")
    assert not found, "\n".join(found)


def test_patterns_catch_what_they_name():
    samples = {
        "an issue number": "Issue 10: a trained drafter",
        "the project's work notes ('this session', 'the issue's ...')": "The issue's prototype reached 35%",
        "whether a GPU was lent": "No GPU was lent to this run",
        "a file outside the repository": "see `shared/offline-assets.md`",
    }
    for what, text in samples.items():
        assert INTERNAL[what].search(text), what
    assert not any(p.search("torch.library.custom_op over long sessions") for p in INTERNAL.values())


SUITE_COUNT = re.compile(r"\b\d[\d,]* passed, \d[\d,]* (skipped|failed|xfailed|deselected)", re.IGNORECASE)


@pytest.mark.parametrize("path", USER_TEXT, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_count_of_the_suite_that_goes_stale(path):
    """A count of the suite's tests ("937 passed, 42 skipped") is wrong after the next test is added: the docs say
    that the suite passes, and pytest says how many."""
    found = [f"{path.name}:{lineno}: {m.group(0)!r}" for lineno, line in enumerate(path.read_text().splitlines(), 1)
             if (m := SUITE_COUNT.search(line))]
    assert not found, "\n".join(found)
