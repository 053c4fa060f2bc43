"""The batch policy's regret, paired: stock greedy ``generate``, the default (the batch policy on), each chain the
policy chooses from run alone and the plain step alone (``max_step_tokens=1``: stock's work in the library's loop),
interleaved per batch of prompts in a rotating order, for several rounds in one process, each timed run after a
garbage collection (as bench's); per round each entry's speed is stock's total seconds over its own, and the report
keeps every round and the median over rounds. The regret is against the best of the fixed shapes. A ``bench`` run
interleaves too, but its median over two repeats is their mean, and one burst of another process on this shared
machine moves a whole column; here one round's burst is outvoted.

Each entry learns from its own calls only, in its own ``memory_scope`` (``hf_paralleldecode.decoding.policy.memory``,
as bench does): the plain-steps entry (``max_step_tokens=1``) has the default's memory key, so shared, its plain steps
would keep the default's plain-step window fresh, which a process running the default alone does not have.

The first rounds hold the policy's exploration (it starts from nothing in the process, as a server's first calls
do); the report keeps them, and also gives the medians of the rounds after the first.

    python scripts/policy_regret.py --model default-trained --batch-size 16 --num-prompts 64 --rounds 4 \
        --output docs/assets/twins/cpu/regret/default-trained-8m_b16.json
    python scripts/policy_regret.py --model default-1b --dtype bfloat16 --batch-size 16 --num-prompts 32 --rounds 3 \
        --chains 4 2 --output ...

Two regrets: ``regret`` compares the medians over rounds (the policy's against the best fixed shape's), and
``paired_regret`` is the median over rounds of each round's own regret against that shape, which a round that moved
one entry more than the other cannot swing. ``--resummarize FILE ...`` recomputes both summaries of earlier reports
from the seconds they hold.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

PROMPTS = ["stdlib_test_midfile.jsonl", "stdlib_test.jsonl"]  # held-out mid-file windows, then function openings


def speeds(seconds: dict, name: str, skip: int = 0) -> list[float]:
    """Per round from ``skip`` on: stock's seconds over ``name``'s."""
    return [s / t for s, t in zip(seconds["stock"][skip:], seconds[name][skip:])]


def summarize(seconds: dict, skip: int = 0) -> dict | None:
    """Medians over the rounds from ``skip`` on, the best fixed shape (every entry but stock and the default) by its
    median, the regret of the medians and the paired regret (the median of each round's own); ``None`` without
    such rounds."""
    if len(seconds["stock"]) <= skip:
        return None
    names = list(seconds)
    fixed = [n for n in names if n not in ("stock", "default")]
    med = {n: statistics.median(speeds(seconds, n, skip)) for n in names}
    best = max(fixed, key=med.get)
    per_round = [1.0 - d / b for d, b in zip(speeds(seconds, "default", skip), speeds(seconds, best, skip))]
    return {"speed_vs_stock": med, "best_fixed": best, "best_fixed_speed": med[best],
            "regret": 1.0 - med["default"] / med[best], "paired_regret": statistics.median(per_round)}


def resummarize(paths: list[str]) -> int:
    """Recompute the summaries of earlier reports from their seconds (written back in place)."""
    for path in paths:
        report = json.loads(Path(path).read_text())
        report["all_rounds"], report["after_first_round"] = summarize(report["seconds"]), summarize(report["seconds"], 1)
        Path(path).write_text(json.dumps(report, indent=1) + "\n")
        s = report["all_rounds"]
        print(f"{path}: regret {s['regret']:.1%}, paired {s['paired_regret']:.1%}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--resummarize", nargs="+", metavar="FILE", default=None,
                    help="recompute the summaries of earlier reports from their seconds, and nothing else")
    ap.add_argument("--model", help="as bench's --model: default, default-trained-1b, ... (required for a run)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--chains", type=int, nargs="+", default=[8, 4, 2], help="chain depths run alone")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default=None)
    args = ap.parse_args(argv)
    if args.resummarize:
        return resummarize(args.resummarize)
    if args.model is None or args.batch_size is None or args.output is None:
        raise SystemExit("A run needs --model, --batch-size and --output (or --resummarize FILE ...).")
    if args.batch_size < 1 or args.rounds < 1 or args.num_prompts < args.batch_size:
        raise SystemExit("--batch-size and --rounds must be >= 1 and --num-prompts at least the batch size.")
    from hf_paralleldecode.cli import _load
    from hf_paralleldecode.decoding.policy import memory_scope
    from hf_paralleldecode.integration import enable
    from hf_paralleldecode.prompts import read_prompts

    model, tok, _ = _load(args)  # (--threads applied there; twins built as bench builds them)
    enable(model)
    root = Path(__file__).resolve().parents[1] / "hf_paralleldecode" / "assets" / "prompts"
    texts = [t for name in PROMPTS for t in read_prompts(str(root / name))][: args.num_prompts]
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    batches = [tok(texts[i : i + args.batch_size], return_tensors="pt", padding=True)
               for i in range(0, len(texts), args.batch_size)]
    common = dict(do_sample=False)
    entries = {"stock": {}, "default": dict(decoding="speculative")}
    for d in args.chains:
        entries[f"chain of {d}"] = dict(decoding="speculative", adaptive=False, tree_width=1, tree_depth=d,
                                        tree_budget=d, context_matches=0)
    entries["plain steps"] = dict(decoding="speculative", max_step_tokens=1)
    for enc in batches:  # warm-up, untimed, short (as bench's)
        for name, settings in entries.items():
            with memory_scope(name):
                model.generate(**enc, max_new_tokens=min(8, args.max_new_tokens), **common, **settings)
    seconds = {name: [] for name in entries}
    names = list(entries)
    for r in range(args.rounds):
        total = dict.fromkeys(names, 0.0)
        for j, enc in enumerate(batches):
            k = (r + j) % len(names)
            for name in names[k:] + names[:k]:
                gc.collect()  # (untimed: each run pays for its own garbage only)
                t0 = time.perf_counter()
                with memory_scope(name):
                    model.generate(**enc, max_new_tokens=args.max_new_tokens, **common, **entries[name])
                total[name] += time.perf_counter() - t0
        for name in names:
            seconds[name].append(total[name])
        print(f"round {r}: " + " ".join(f"{n} {total['stock'] / total[n]:.3f}x" for n in names), flush=True)

    report = {"model": args.model, "dtype": args.dtype, "batch_size": args.batch_size, "prompts": len(texts),
              "rounds": args.rounds, "max_new_tokens": args.max_new_tokens, "threads": args.threads,
              "torch": torch.__version__, "memory": "one scope per entry", "seconds": seconds,
              "speed_vs_stock_by_round": {n: speeds(seconds, n) for n in names},
              "all_rounds": summarize(seconds), "after_first_round": summarize(seconds, 1)}
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    s = report["all_rounds"]
    print(f"median over rounds: default {s['speed_vs_stock']['default']:.3f}x, best fixed {s['best_fixed']} "
          f"{s['best_fixed_speed']:.3f}x, regret {s['regret']:.1%} (paired {s['paired_regret']:.1%}); wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
