"""The docs' runnable examples are executed here (blocks of one page share a namespace)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = ["getting-started.md", "methods/jacobi.md", "methods/lookahead.md", "methods/jacobi_forcing.md", "methods/speculative.md", "methods/deer.md",
         "methods/prompt_lookup.md", "training.md", "drafters.md",
         "tree-budgets.md", "hardware.md", "batch-policy.md", "cost-twins.md"]


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


def test_user_docs_speak_to_users_not_to_the_projects_history():
    """No session, seed-paper, issue-number or commit-hash wording in the user docs (history goes to CHANGELOG.md)."""
    words = re.compile(r"\bsessions?\b|\bthe seeds?\b|\bseed (?:paper|notes?|descriptions?)\b|\bissues? #?\d+", re.I)
    for path in sorted(DOCS.rglob("*.md")):
        prose = re.sub(r"```.*?```|`[^`]*`", "", path.read_text(), flags=re.S)
        assert not words.search(prose), f"{path}: {words.search(prose).group(0)!r}"
        hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", prose) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
        assert not hashes, f"{path}: commit-hash-like words {hashes[:3]}"


def test_readme_opens_with_the_two_commands_and_links_existing_pages():
    readme = (DOCS.parent / "README.md").read_text()
    first = [line for line in readme.splitlines()[:6] if line.startswith("bash ")]
    assert first == ["bash scripts/setup.sh && hf-paralleldecode demo         "
                     "# demo: the embedded model, stock greedy vs every decoding",
                     "bash scripts/setup.sh dev && python3 -m pytest -q        # the test suite (what CI runs)"]
    assert "python3 -m pytest -q" in (DOCS.parent / ".ci" / "run").read_text()
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (DOCS.parent / link).is_file(), link


def _render_tables():
    import importlib.util

    spec = importlib.util.spec_from_file_location("render_tables", DOCS.parent / "scripts" / "render_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_tables_match_their_json():
    """Every generated table (``<!-- table {...} -->`` blocks) equals what its JSON under docs/assets renders."""
    render = _render_tables()
    assert render.main(["--check"]) == 0
    pages = [p for p in DOCS.rglob("*.md") if "<!-- table " in p.read_text()]
    assert (DOCS / "benchmark.md") in pages


def test_table_renderer_detects_an_edited_figure():
    render = _render_tables()
    text = (DOCS / "benchmark.md").read_text()
    block = render.BLOCK.search(text)
    assert block is not None
    body = block.group(3)
    edited = text.replace(body, body.replace("|", "| 9.99 |", 1), 1)
    _, changed = render.render_text(edited)
    assert changed and changed[0] == block.group(2)
