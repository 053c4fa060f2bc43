"""Forward time against tokens fed, by batch size: the device's roofline for a model (scripts/gpu_check.sh).

``python scripts/gpu_roofline.py --model random-1b --dtype bfloat16 --output roofline.json``
``python scripts/gpu_roofline.py --plot a.json b.json --output roofline.png``: a chart of reports.
Each point: a ``[batch, k]`` forward after a ``--context``-token prefix held in the cache, median of
``--repeats`` timed forwards after two warm-ups (``decoding.policy.forward_cost``: device sync around each, a fresh
cache per forward).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's package, installed or not


def plot(paths: list[str], output: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(paths), figsize=(5.5 * len(paths), 4.2), squeeze=False)
    for ax, path in zip(axes[0], paths):
        with open(path) as f:
            report = json.load(f)
        for b in sorted({p["batch"] for p in report["points"]}):
            pts = [p for p in report["points"] if p["batch"] == b]
            ax.plot([p["tokens"] for p in pts], [p["ms"] for p in pts], marker="o", label=f"batch {b}")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("tokens per forward (batch x tokens per row)")
        ax.set_ylabel("forward time (ms)")
        ax.set_title(f"{report['model']}, {report['dtype']}\n{report['device']}, context {report['context']}",
                     fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(output, dpi=110)


def main() -> None:
    import sys

    if "--plot" in sys.argv:
        args = sys.argv[sys.argv.index("--plot") + 1:]
        out = args.index("--output")
        plot(args[:out], args[out + 1])
        return
    from hf_paralleldecode.cli import _load
    from hf_paralleldecode.decoding.policy import forward_cost

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="random-1b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default=None)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--max-fed", type=int, default=None,
                   help="skip points feeding more than this many tokens (batch x tokens per row): CPU budgets")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", required=True)
    args = p.parse_args()
    model, _, name = _load(args)
    device = next(model.parameters()).device
    rows = []
    for b in args.batch_sizes:
        tokens = tuple(k for k in args.tokens if args.max_fed is None or b * k <= args.max_fed)
        if len(tokens) < 2:  # a curve needs two points; --max-fed leaves fewer at large batches
            print(f"batch {b}: skipped, --max-fed {args.max_fed} leaves {len(tokens)} of the token counts", flush=True)
            continue
        curve = forward_cost(model, context=args.context, repeats=args.repeats, tokens=tokens, batch=b, warmups=2)
        for k, seconds in curve.points:
            rows.append(dict(batch=b, tokens_per_row=k, tokens=b * k, ms=1e3 * seconds))
            print(f"{name:>30} b={b:<3} k={k:<3} tokens={b * k:<5} {1e3 * seconds:8.2f} ms", flush=True)
    params = sum(t.numel() for t in model.parameters())
    report = dict(model=name, params=params, dtype=args.dtype, device=torch.cuda.get_device_name(device)
                  if device.type == "cuda" else "cpu", context=args.context, repeats=args.repeats,
                  torch=torch.__version__, points=rows)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
