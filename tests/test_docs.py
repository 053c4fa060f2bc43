"""The docs' runnable examples are executed here (blocks of one page share a namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = ["getting-started.md", "methods/jacobi.md", "methods/lookahead.md", "methods/jacobi_forcing.md", "methods/speculative.md", "methods/deer.md",
         "methods/prompt_lookup.md", "training.md", "drafters.md",
         "tree-budgets.md", "hardware.md"]


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)


@pytest.mark.parametrize("page", PAGES)
def test_doc_examples_run(page, capsys):
    blocks = python_blocks(page)
    assert blocks, f"{page} has no runnable example"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, f"{page}", "exec"), namespace)


def test_docs_have_no_unfilled_placeholders():
    for path in DOCS.rglob("*.md"):
        prose = re.sub(r"```.*?```|`[^`]*`", "", path.read_text(), flags=re.S)  # code may name env variables
        assert not re.search(r"\b[A-Z0-9]{2,}_[A-Z0-9_]{3,}\b|\b(TBD|TODO|XXX)\b", prose), path
