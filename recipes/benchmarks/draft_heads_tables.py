"""Markdown tables from the bench.json reports written by draft_heads.sh (the figures quoted in the docs).

    python recipes/benchmarks/draft_heads_tables.py bench_out/draft_heads/batch1/bench.json [...]
"""

from __future__ import annotations

import json
import sys


def table(path: str) -> str:
    report = json.loads(open(path).read())
    lines = [f"{report['model']}, batch {report['batch_size']}, {report['prompts']} prompts x "
             f"{report['max_new_tokens']} new tokens, {report['device']} {report['dtype']}, "
             f"{report['torch_threads']} threads, {report['repeats']} repeat(s)", "",
             "| strategy | TPF (tau) | tokens/s | speedup over AR | exact |", "| --- | --- | --- | --- | --- |"]
    for label, r in report["results"].items():
        note = " (row by row)" if r.get("sequential_rows") else ""
        lines.append(f"| `{label}`{note} | {r['tpf']:.2f} | {r['tokens_per_second']:.1f} | "
                     f"{r['speedup_vs_ar']:.2f}x | {r['exact_match_vs_ar']:.0%} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print("\n\n".join(table(p) for p in sys.argv[1:]))
