"""docs/testing.md's table of ``slow`` tests is the suite's own list, read from what pytest collected in this session:
every test marked ``slow`` is in it, and every name in it is a test marked ``slow``."""
from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "testing.md"
SECTION = "## nanospec's own suite: the `slow` marker"


def documented() -> set[tuple[str, str]]:
    """(file, test function) of every name in the table."""
    section = DOC.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = [re.match(r"\| `(tests/[^`]+\.py)` \| (.+) \|$", line) for line in section.splitlines()]
    return {(row[1], name) for row in rows if row for name in re.findall(r"`(test_\w+)`", row[2])}


def collected(session, root: Path) -> dict[tuple[str, str], bool]:
    """(file, test function) -> whether any of its collected cases is marked ``slow``."""
    found: dict[tuple[str, str], bool] = {}
    for item in session.items:
        key = (Path(item.path).resolve().relative_to(root).as_posix(), getattr(item, "originalname", item.name))
        found[key] = found.get(key, False) or item.get_closest_marker("slow") is not None
    return found


def test_the_docs_list_exactly_the_tests_marked_slow(request):
    tests = collected(request.session, Path(request.config.rootpath).resolve())
    table = documented()
    assert table, f"no table of slow tests found under {SECTION!r} in {DOC}"
    unlisted = sorted(key for key, slow in tests.items() if slow and key not in table)
    assert not unlisted, f"marked slow but missing from docs/testing.md's table: {unlisted}"
    options = request.config.option
    if options.keyword or options.markexpr:  # -k / -m deselected cases: a function's collected cases are not all
        return
    not_slow = sorted(key for key in table if key in tests and not tests[key])
    assert not not_slow, f"listed as slow in docs/testing.md but not marked slow: {not_slow}"
    files = {path for path, _ in tests}  # a listed test of a collected file exists
    gone = sorted(key for key in table if key[0] in files and key not in tests)
    assert not gone, f"listed in docs/testing.md's table but not a test any more: {gone}"
