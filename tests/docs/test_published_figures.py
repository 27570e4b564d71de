"""Every published table and figure comes from a saved result (benchmarks/results/) and says which.

Two markers in README.md and docs/*.md tie text to a results file:

* a rendered block, ``<!-- rendered: python benchmarks/report.py ARGS -->`` ... ``<!-- /rendered -->``: the text
  between is exactly what the report command prints for ARGS today;
* a prose figure, ``1.23x<!-- figure: FILE PATH -->``: the figure just before the marker is the value at PATH in the
  results file, to the digits it shows. PATH is ``/``-separated: a dict's key, or in a list the one entry whose
  keys have the values of a JSON object (``rows/{"variant": "full head", "depth": 1}/tau``); ``*100`` at its end
  for a share printed as a percentage.

And README's results section prints no table outside a rendered block, and no ratio (``1.23x``) without its
marker or the word "estimate" beside it.
"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"<!-- rendered: python benchmarks/report\.py (?P<args>[^>]*?) -->\n(?P<text>.*?)<!-- /rendered -->",
                   re.DOTALL)
FIGURE = re.compile(r"(?P<figure>-?[\d,]*\.?\d+)(?P<unit>x|%| ms| us)?\s*"
                    r"<!-- figure: (?P<file>\S+) (?P<path>.+?)(?P<scale>\*100)? -->")
SEGMENT = re.compile(r"\{.*?\}|[^/]+")
RATIO = re.compile(r"\b\d+\.\d+x\b")


def _report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "benchmarks" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def blocks() -> list[tuple[str, str, str]]:
    return [(path.name, m["args"], m["text"]) for path in DOCS for m in BLOCK.finditer(path.read_text())]


def figures() -> list[tuple[str, re.Match]]:
    return [(path.name, m) for path in DOCS for m in FIGURE.finditer(path.read_text())]


def value_at(file: str, path: str):
    """The value at ``path`` (see the module's docstring) in a results file."""
    value = json.loads((ROOT / file).read_text())
    for segment in SEGMENT.findall(path):
        if isinstance(value, list):
            where = json.loads(segment)
            found = [e for e in value if all(e.get(k) == v for k, v in where.items())]
            assert len(found) == 1, f"{file} {path}: {len(found)} entries match {segment}, not one"
            value = found[0]
        else:
            value = value[segment]
    return value


@pytest.mark.parametrize("doc,args,text", blocks(), ids=lambda v: v if isinstance(v, str) and len(v) < 60 else "")
def test_rendered_blocks_are_what_the_report_command_prints(doc, args, text):
    printed = _report().main(args.split())
    assert text.strip() == printed.strip(), f"{doc}: the block for `{args}` differs from what report.py prints now"


@pytest.mark.parametrize("doc,m", figures(), ids=lambda v: v if isinstance(v, str) else v["figure"])
def test_prose_figures_are_their_results_entry(doc, m):
    value = value_at(m["file"], m["path"]) * (100 if m["scale"] else 1)
    shown = m["figure"].replace(",", "")
    digits = len(shown.split(".")[1]) if "." in shown else 0
    assert abs(value - float(shown)) <= 10 ** -digits / 2 + 1e-9, (
        f"{doc}: {m['figure']}{m['unit'] or ''} but {m['file']} gives {value} at {m['path']}")


def test_the_documents_publish_rendered_results():
    assert any(doc == "results.md" for doc, _, _ in blocks()), "docs/results.md renders no results file"
    assert figures(), "no prose figure names its results file"


def test_readme_results_print_no_table_or_ratio_without_its_source():
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Results\n")[1].split("\n## ")[0]
    outside = BLOCK.sub("", section)
    tables = [line for line in outside.splitlines() if line.startswith("|")]
    assert not tables, f"README's results print a table that is no rendered block: {tables[0]}"
    for paragraph in FIGURE.sub("", outside).split("\n\n"):
        bare = RATIO.findall(paragraph)
        assert not bare or "estimate" in paragraph, f"README's results print {bare} with no results file named"


def test_the_markers_catch_a_figure_that_differs(tmp_path):
    """The checks above can fail: a figure one digit off, and a block one character off, are caught."""
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"rows": [{"variant": "a", "x": 1.234}]}))
    good, bad = (FIGURE.search(f'{v}%<!-- figure: {results} rows/{{"variant": "a"}}/x*100 -->') for v in ("123.4", "123.5"))
    for m, ok in ((good, True), (bad, False)):
        value = value_at(str(results), m["path"]) * (100 if m["scale"] else 1)
        assert (abs(value - float(m["figure"])) <= 0.05 + 1e-9) is ok
    block = BLOCK.search("<!-- rendered: python benchmarks/report.py X -->\n| a |\n<!-- /rendered -->")
    assert block["args"] == "X" and block["text"].strip() == "| a |"
