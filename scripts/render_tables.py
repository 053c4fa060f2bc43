"""Render the docs' measured tables from their JSON under ``docs/assets/`` (one source for every figure).

A generated table sits between two markers in a Markdown page; the first holds its spec (JSON)::

    <!-- table {"kind": "bench", "file": "twins/cpu/b1_default-1b/bench.json"} -->
    | ... generated ... |
    <!-- /table -->

``python scripts/render_tables.py`` rewrites every such block from its JSON; ``--check`` exits 1 and names each block
whose text differs (the docs test runs it). Kinds:

* ``bench``: one row per strategy of a ``bench`` report (``file``; ``strategies``: labels to keep, in order,
  optionally renamed with ``names``), columns ``columns`` (default: TPF, tok/s, vs stock, vs prompt lookup, exact).
* ``policy``: per batch size of a multi-batch bench (``dir`` holding ``batch<N>/bench.json``, or ``files``), the
  policy's speed against stock, the best fixed shape run alone and the policy's regret against it.
* ``roofline``: forward milliseconds by batch (rows) and tokens per row (columns) of ``scripts/gpu_roofline.py``
  reports (``files``: one table, a row per file and batch).
* ``twins``: the rows of ``scripts/twin_check.py`` reports (``files``).
* ``vllm``: the rows of a ``scripts/vllm_check.py --out`` report (``file``; optional ``models`` / ``concurrency``).
* ``grid``: any table: ``files`` names JSON files by alias, ``header`` the column titles and ``rows`` each row's
  cells, as text in which ``{expression:format}`` is replaced by its value. An expression is arithmetic
  (``+ - * /``, parentheses, numbers) over references ``alias/key/key...`` (``a/results/ar/tokens_per_second``);
  keys are percent-decoded, so a key holding ``/`` or a space, or ``-`` or parentheses other than a reference's
  one ``(...)``, is written ``%2F``, ``%20``, ``%2D``, ``%28``/``%29``. ``{expression}`` alone formats as
  ``str``. With a ``template`` (a list of cells), a row may be a dict: ``$name`` in the template's cells is
  replaced by the row's ``name`` first. ``bold_best``: column indices; in each row the one whose leading figure is
  largest is set in bold. An empty cell is written ``| |``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from urllib.parse import unquote

DOCS = Path(__file__).resolve().parent.parent / "docs"
ASSETS = DOCS / "assets"
BLOCK = re.compile(r"(<!-- table (\{.*?\}) -->\n)(.*?)(<!-- /table -->)", re.S)

AR, PL = "ar", "transformers_prompt_lookup"


def _load(rel: str) -> dict:
    with open(ASSETS / rel) as f:
        return json.load(f)


def _fmt(value, spec: str) -> str:
    if value is None:
        return "n/a"
    if spec == "":
        return str(value)
    if spec == "x":
        return f"{value:.2f}x"
    if spec == "%":
        return f"{100 * value:.0f}%"
    return format(value, spec)


def _pl_ratio(results: dict, row: dict):
    pl = results.get(PL)
    return row["tokens_per_second"] / pl["tokens_per_second"] if pl and pl.get("tokens_per_second") else None


#: bench columns: header, value of a strategy's row (results, row), format
BENCH_COLUMNS = {
    "tpf": ("TPF", lambda res, r: r.get("tpf"), ".2f"),
    "tok_s": ("tok/s", lambda res, r: r.get("tokens_per_second"), ".1f"),
    "vs_stock": ("vs stock", lambda res, r: r.get("speedup_vs_ar"), "x"),
    "vs_pl": ("vs prompt lookup (tok/s)", _pl_ratio, "x"),
    "exact": ("identical to stock", lambda res, r: r.get("exact_match_vs_ar"), "%"),
    "spec_rows": ("speculating rows", lambda res, r: r.get("speculated_row_share"), "%"),
    "tail": ("tail", lambda res, r: r.get("tail_time_share"), "%"),
    "host_ms": ("host ms a step (outside the target's forwards)", lambda res, r: r.get("host_ms_per_step"), ".1f"),
    "drafter_ms": ("drafter ms a forward", lambda res, r: r.get("drafter_ms_per_forward"), ".1f"),
}


def _settings(strategy: str) -> dict:
    if "(" not in strategy:
        return {}
    return dict(kv.split("=", 1) for kv in strategy[strategy.index("(") + 1:-1].split(","))


def _label(strategy: str) -> str:
    """A reader's name for a bench entry: the shapes of the batch policy by what they are."""
    if strategy == AR:
        return "stock generate"
    if strategy == PL:
        return "transformers' prompt lookup"
    name = strategy.split("(")[0]
    settings = _settings(strategy)
    if name == "speculative" and set(settings) <= {"adaptive", "tree_width", "tree_depth", "tree_budget",
                                                  "context_matches"}:
        if not settings:
            return "**default** (batch policy on)"
        if settings.get("tree_width") == "1":
            return f"chain of {settings['tree_depth']} alone"
        if settings == {"adaptive": "False"}:
            return "configured tree alone (`adaptive=False`)"
    if _plain(strategy):
        return "plain steps alone (`max_step_tokens=1`)"
    return f"`{strategy}`"


def _plain(strategy: str) -> bool:
    """The library's plain step run alone: ``speculative`` with one token a row per forward (no speculation)."""
    return strategy.split("(")[0] == "speculative" and _settings(strategy) == {"max_step_tokens": "1"}


def _order(strategy: str) -> tuple:
    """Stock first, then the default, the configured tree, chains from the deepest, other entries, prompt lookup."""
    settings = _settings(strategy)
    rank = 5 if strategy == PL else 0 if strategy == AR else 1 if not settings else 2 if settings == {
        "adaptive": "False"} else 3 if settings.get("tree_width") == "1" else 4
    return rank, -int(settings.get("tree_depth", 0)), strategy


def render_bench(spec: dict) -> str:
    report = _load(spec["file"])
    results = report["results"]
    keep = spec.get("strategies") or sorted(results, key=_order)
    names = spec.get("names") or [_label(s) for s in keep]
    columns = spec.get("columns") or ["tpf", "tok_s", "vs_stock", "vs_pl", "exact"]
    if report.get("sampling") is not None and "exact" in columns:
        columns = [c for c in columns if c != "exact"]
    lines = ["| decoding | " + " | ".join(BENCH_COLUMNS[c][0] for c in columns) + " |",
             "| --- |" + " --- |" * len(columns)]
    for strategy, name in zip(keep, names):
        if strategy not in results:
            raise KeyError(f"{spec['file']}: no strategy {strategy!r} (has {sorted(results)})")
        row = results[strategy]
        cells = [_fmt(BENCH_COLUMNS[c][1](results, row), BENCH_COLUMNS[c][2]) for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _shape_name(strategy: str) -> str:
    if _plain(strategy):
        return "plain steps"
    settings = _settings(strategy)
    if settings.get("tree_width") == "1":
        return f"chain of {settings['tree_depth']}"
    return "configured tree"


def policy_rows(report: dict, policy: str = "speculative") -> dict:
    """``{policy speed, best fixed shape, its speed, regret}`` of one bench report: the fixed shapes are its
    ``adaptive=False`` strategies and the plain step alone (``max_step_tokens=1``) where it ran."""
    results = report["results"]
    fixed = {s: r["speedup_vs_ar"] for s, r in results.items() if "adaptive=False" in s or _plain(s)}
    best = max(fixed, key=fixed.get)
    mine = results[policy]["speedup_vs_ar"]
    return dict(policy=mine, best=_shape_name(best), best_speed=fixed[best], regret=1 - mine / fixed[best],
                stock=results[AR]["tokens_per_second"], spec=results[policy].get("speculated_row_share"))


def render_policy(spec: dict) -> str:
    files = spec.get("files") or sorted(
        (str(p.relative_to(ASSETS)) for p in (ASSETS / spec["dir"]).glob("batch*/bench.json")),
        key=lambda s: int(re.search(r"batch(\d+)", s).group(1)))
    lines = ["| batch | stock (tok/s) | default (batch policy) vs stock | its speculating rows | best fixed shape run "
             "alone | its speed vs stock | regret (negative: the policy was faster) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for rel in files:
        report = _load(rel)
        row = policy_rows(report)
        regret = round(100 * row["regret"]) + 0  # (+ 0: no "-0%")
        lines.append(f"| {report['batch_size']} | {row['stock']:.1f} | {row['policy']:.2f}x | {_fmt(row['spec'], '%')} | "
                     f"{row['best']} | {row['best_speed']:.2f}x | {regret}% |")
    return "\n".join(lines) + "\n"


def render_roofline(spec: dict) -> str:
    reports = [(rel, _load(rel)) for rel in spec["files"]]
    tokens = sorted({p["tokens_per_row"] for _, r in reports for p in r["points"]})
    lines = ["| model | dtype | batch | " + " | ".join(f"{k} tok/row" for k in tokens) + " |",
             "| --- | --- | --- |" + " --- |" * len(tokens)]
    for rel, r in reports:
        label = spec.get("names", {}).get(rel, r["model"])
        for b in sorted({p["batch"] for p in r["points"]}):
            ms = {p["tokens_per_row"]: p["ms"] for p in r["points"] if p["batch"] == b}
            cells = [f"{ms[k]:.1f}" if k in ms else "" for k in tokens]
            lines.append(f"| {label} | {r['dtype']} | {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_twins(spec: dict) -> str:
    lines = ["| model | twin of | dtype | parameters | max logit difference | identical greedy rows | "
             "agreeing tokens before the first difference |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for rel in spec["files"]:
        for r in _load(rel)["rows"]:
            model = {"default": "base", "default-trained": "JF model"}.get(r["model"], r["model"])
            lines.append(f"| {model} | {r['like']} ({r['shape']}) | {r['dtype']} | {r['params'] / 1e9:.2f}B | "
                         f"{r['max_abs_logit_diff']:.1e} | {r['identical_rows']}/{r['prompts']} | "
                         f"{100 * r['prefix_agreement']:.0f}% |")
    return "\n".join(lines) + "\n"


_REF = re.compile(r"([A-Za-z_]\w*)/([^\s()*+\-:}]+(?:\([^)]*\))?[^\s()*+:}]*)")
_CELL = re.compile(r"\{([^{}:]+)(?::([^{}]*))?\}")


def _lookup(files: dict, alias: str, path: str):
    value = files[alias]
    for key in path.split("/"):
        key = unquote(key)
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value


def _evaluate(expression: str, files: dict):
    import ast

    names: dict[str, object] = {}

    def ref(m):
        name = f"_v{len(names)}"
        names[name] = _lookup(files, m.group(1), m.group(2))
        return name

    tree = ast.parse(_REF.sub(ref, expression.strip()), mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Add, ast.Sub, ast.Mult, ast.Div, ast.USub, ast.Constant,
               ast.Name, ast.Load)
    bad = [type(n).__name__ for n in ast.walk(tree) if not isinstance(n, allowed)]
    if bad:
        raise ValueError(f"table expression {expression!r}: only arithmetic over references (found {bad})")
    return eval(compile(tree, "<table>", "eval"), {"__builtins__": {}}, names)  # noqa: S307 - checked above


def render_grid(spec: dict) -> str:
    files = {alias: _load(rel) for alias, rel in spec["files"].items()}

    def cell(text: str) -> str:
        return _CELL.sub(lambda m: _fmt(_evaluate(m.group(1), files), m.group(2) or ""), text)

    lines = ["| " + " | ".join(spec["header"]) + " |", "|" + " --- |" * len(spec["header"])]
    for row in spec["rows"]:
        if isinstance(row, dict):  # a row of the spec's "template": "$name" in its cells is the row's "name"
            row = [re.sub(r"\$(\w+)", lambda m, names=row: str(names[m.group(1)]), cell) for cell in spec["template"]]
        if len(row) != len(spec["header"]):
            raise ValueError(f"grid row {row!r} has {len(row)} cells, the header {len(spec['header'])}")
        cells = [cell(c) for c in row]
        best = spec.get("bold_best")  # columns whose largest leading figure is set in bold, per row
        if best:
            lead = {i: float(re.match(r"[\d.]+", cells[i]).group()) for i in best}
            top = max(lead, key=lead.get)
            cells[top] = re.sub(r"^([\d.]+x?)", r"**\1**", cells[top])
        lines.append(re.sub(r"\|  (?=\|)", "| ", "| " + " | ".join(cells) + " |"))  # an empty cell is "| |"
    return "\n".join(lines) + "\n"


def render_vllm(spec: dict) -> str:
    """The rows of a ``scripts/vllm_check.py --out`` report (``file``; ``models`` / ``concurrency`` to keep)."""
    report = _load(spec["file"])
    keep_models, keep_c = spec.get("models"), spec.get("concurrency")
    lines = ["| model | method | requests at once | identical to vLLM plain / stock | mean acceptance length | "
             "tokens/s | vs vLLM plain | vs vLLM ngram |", "|" + " --- |" * 8]
    for r in report["rows"]:
        if "error" in r or (keep_models and r["model"] not in keep_models) or \
                (keep_c and r["concurrency"] not in keep_c):
            continue
        n = r["prompts"]
        plain = "-" if r["identical_to_vllm_plain"] is None else f"{r['identical_to_vllm_plain']}/{n}"
        lines.append(f"| {r['model']} | {r['method']} | {r['concurrency']} | {plain} / {r['identical_to_stock']}/{n} | "
                     f"{_fmt(r['mean_acceptance_length'], '.2f')} | {_fmt(r['tokens_per_second'], '.0f')} | "
                     f"{_fmt(r['vs_plain'], 'x')} | {_fmt(r['vs_ngram'], 'x')} |")
    return "\n".join(lines) + "\n"


RENDERERS = {"grid": render_grid, "bench": render_bench, "policy": render_policy, "roofline": render_roofline,
             "twins": render_twins, "vllm": render_vllm}


def render_text(text: str) -> tuple[str, list[str]]:
    """``(new text, specs of the blocks that changed)``."""
    changed = []

    def sub(m):
        spec = json.loads(m.group(2))
        kind = spec.get("kind")
        if kind not in RENDERERS:
            raise ValueError(f"Unknown table kind {kind!r} in {m.group(2)}; known: {sorted(RENDERERS)}")
        body = RENDERERS[kind](spec)
        if body != m.group(3):
            changed.append(m.group(2))
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(sub, text), changed


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a table differs from its JSON")
    p.add_argument("pages", nargs="*", help="Markdown pages (default: every page under docs/)")
    args = p.parse_args(argv)
    pages = [Path(x) for x in args.pages] or sorted(DOCS.rglob("*.md"))
    stale = []
    for page in pages:
        text = page.read_text()
        new, changed = render_text(text)
        stale += [f"{page}: {spec}" for spec in changed]
        if changed and not args.check:
            page.write_text(new)
    if args.check and stale:
        print("Tables that differ from their JSON (run python scripts/render_tables.py):\n" + "\n".join(stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
