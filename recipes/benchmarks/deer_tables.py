"""Tables and the acceptance-by-depth chart of a DEER bench report (recipes/benchmarks/deer.sh).

    python recipes/benchmarks/deer_tables.py bench_out/deer/openings/bench.json --chart acceptance.png

Prints a markdown table (tau, longest accepted block, TPF, tokens/s, ratio to transformers' prompt
lookup and to AR, exactness) and plots, for every chain entry (``tree_width=1``), the conditional
acceptance rate at each depth: the share of steps that reached depth d - 1 whose draft at depth d was
accepted. An AR drafter's rate decays along the block (its own guesses feed its next ones); DEER's
claim is that a diffusion drafter's does not.
"""

from __future__ import annotations

import argparse
import json


def label(name: str) -> str:
    return (name.replace("speculative(", "").rstrip(")").replace("drafter=", "").replace("tree_", "")
            .replace("runs/deer/", "").replace("default-", ""))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("report")
    parser.add_argument("--chart", default=None)
    args = parser.parse_args()
    report = json.loads(open(args.report).read())
    res = report["results"]
    peer = res.get("transformers_prompt_lookup")
    print("| entry | tau | max block | TPF | tok/s | vs PL | vs AR | exact | drafter ms / fwd | drafter tokens / fwd |\n"
          "|---|---|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        vs_pl = r["tokens_per_second"] / peer["tokens_per_second"] if peer else float("nan")
        tau = f"{r['tau']:.2f}" if "tau" in r else "-"
        longest = str(r.get("max_accepted_length", "-"))
        print(f"| {label(name)} | {tau} | {longest} | {r['tpf']:.2f} | {r['tokens_per_second']:.1f} | "
              f"{vs_pl:.2f}x | {r['speedup_vs_ar']:.2f}x | {r['exact_match_vs_ar']:.0%} | "
              f"{r.get('drafter_ms_per_forward', float('nan')):.2f} | {r.get('drafter_tokens_per_forward', float('nan')):.1f} |")
    if args.chart:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, r in res.items():
            if "tree_width=1" not in name or "context" in name or not r.get("acceptance_by_depth"):
                continue
            if "stage" in name:
                continue
            rates = r["acceptance_by_depth"]
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=label(name))
        ax.set_xlabel("depth d in the block")
        ax.set_ylabel("P(accept d | accepted d - 1)")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
        ax.set_title("conditional acceptance along the drafted block (chains, greedy)")
        fig.savefig(args.chart, dpi=110, bbox_inches="tight")
        print(f"chart: {args.chart}")


if __name__ == "__main__":
    main()
