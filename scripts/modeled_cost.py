"""Bench an embedded 8.4M model as if its forwards cost what its cost twin's cost: a modeled-cost run, in minutes.

A cost twin computes the 8.4M model's function (``hf_paralleldecode.cost_twin``), so its greedy text and every
drafter's acceptance are the 8.4M model's; only the forward's cost differs. This script replays that cost on a
virtual clock: ``time.perf_counter`` of this process becomes the real clock plus an offset, and each forward of the
target model adds to the offset what a forward of its shape (rows x tokens per row) costs on a measured grid, minus
what the 8.4M forward really took. Host work and the drafter's forwards (the twins keep the 8.4M drafter) stay real;
the bench, the batch policy and the forward timers all read the virtual clock. A 1B fp32 cell at 64 rows takes 90
minutes here for real and under two minutes modeled.

It is a development tool for the batch policy (what a policy change does on a cost curve, at every batch size),
not a measurement: the tables of the docs come from real runs (``hf-paralleldecode bench``). On this machine the
modeled run of the JF model's 1B twin at 64 rows gave stock 17.5 decode tok/s, a chain of 2 alone 19.5 and a chain
of 4 alone 17.9, where the real run gave 18.4, 20.1 and 17.4.

    # the grid: forwards of the twin after a 128-token prefix, rows x tokens per row (a prefill is a 128-token row)
    python scripts/modeled_cost.py measure --model default-trained-1b --dtype float32 \
        --output docs/assets/twins/cpu/forward_grid_default-trained-1b_float32.json
    # the bench on the modeled cost (its report is bench's, with --trace-steps' step traces)
    python scripts/modeled_cost.py bench --model default-trained \
        --grid docs/assets/twins/cpu/forward_grid_default-trained-1b_float32.json --batch-size 64 --num-prompts 64 \
        --strategies speculative speculative:adaptive=false,tree_width=1,tree_depth=2,tree_budget=2,context_matches=0
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

_REAL = time.perf_counter
PROMPTS = Path(__file__).resolve().parent.parent / "hf_paralleldecode" / "assets" / "prompts"
ROWS, TOKENS, CONTEXT = (1, 4, 16, 64), (1, 3, 5, 9, 21), 128


class ForwardGrid:
    """The cost in seconds of a forward of ``rows`` x ``tokens`` (tokens per row), read off measured points: linear
    in tokens per row between the points of a row count (beyond the last, along its last segment), then linear in
    rows between the two nearest measured row counts (outside them, the nearest)."""

    def __init__(self, points: list[dict]):
        self.by_rows: dict[int, list[tuple[int, float]]] = {}
        for p in points:
            self.by_rows.setdefault(int(p["batch"]), []).append((int(p["tokens_per_row"]), float(p["ms"]) / 1000))
        for pts in self.by_rows.values():
            pts.sort()
        if not self.by_rows or any(len(p) < 2 for p in self.by_rows.values()):
            raise ValueError("a forward grid needs at least two token counts for each row count.")

    @staticmethod
    def _line(pts: list[tuple[int, float]], x: float) -> float:
        if x <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
        return y1 + (y1 - y0) * (x - x1) / (x1 - x0)

    def __call__(self, rows: int, tokens: int) -> float:
        known = sorted(self.by_rows)
        lo = max([r for r in known if r <= rows], default=known[0])
        hi = min([r for r in known if r >= rows], default=known[-1])
        a, b = self._line(self.by_rows[lo], tokens), self._line(self.by_rows[hi], tokens)
        return a if hi == lo else a + (b - a) * (rows - lo) / (hi - lo)


def install(model, grid: ForwardGrid) -> None:
    """Make ``model``'s forwards cost what ``grid`` says on this process's ``time.perf_counter`` (the hooks go first,
    so a timer hooked on later reads the modeled time)."""
    offset, started = [0.0], {}

    def clock() -> float:
        return _REAL() + offset[0]

    def pre(module, args, kwargs):
        x = kwargs.get("input_ids")
        x = x if x is not None else kwargs.get("inputs_embeds", args[0] if args else None)
        started["shape"], started["t"] = tuple(x.shape[:2]), _REAL()

    def post(module, args, output):
        offset[0] += grid(*started["shape"]) - (_REAL() - started["t"])

    time.perf_counter = clock
    model.register_forward_pre_hook(pre, with_kwargs=True)
    model.register_forward_hook(post)


def measure(args) -> None:
    import torch

    from hf_paralleldecode.decoding.policy import time_forwards
    from hf_paralleldecode.twins import embedded_twin, twin_of

    torch.set_num_threads(args.threads)
    if twin_of(args.model) is None:
        raise ValueError(f"--model takes a cost twin's name (default-1b, default-trained-1b, ...), got {args.model!r}.")
    model = embedded_twin(*twin_of(args.model), dtype=getattr(torch, args.dtype), device="cpu")
    points = []
    for rows in ROWS:  # the prefill of the 128-token prefix (timed), then the forwards after it on one cache
        times = time_forwards(model, context=CONTEXT, tokens=TOKENS, batch=rows, repeats=args.repeats, warmups=0,
                              reuse_prefix=True)
        for k, seconds in [(CONTEXT, times.prefill)] + times.points:
            points.append(dict(batch=rows, tokens_per_row=k, ms=seconds * 1000))
            print(points[-1], flush=True)
    Path(args.output).write_text(json.dumps(dict(model=args.model, dtype=args.dtype, context=CONTEXT,
                                                 threads=args.threads, repeats=args.repeats, torch=torch.__version__,
                                                 points=points), indent=1) + "\n")


def bench(args) -> None:
    import torch

    from hf_paralleldecode.bench import format_report, parse_strategy, run_benchmark
    from hf_paralleldecode.loading import load_default_model
    from hf_paralleldecode.prompts import read_prompts

    torch.set_num_threads(args.threads)
    grid = ForwardGrid(json.loads(Path(args.grid).read_text())["points"])
    model, tokenizer = load_default_model(args.model)
    install(model, grid)
    prompts = [p for f in args.prompts for p in read_prompts(f, "prompt", conversations=True)][: args.num_prompts]
    report = run_benchmark(model, tokenizer, prompts, [parse_strategy(s) for s in args.strategies],
                           max_new_tokens=args.max_new_tokens, repeats=args.repeats, batch_size=args.batch_size,
                           output_dir=args.output_dir, progress=False, model_name=f"{args.model} (modeled cost)",
                           trace_steps=True)
    print(format_report(report))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="measure a model's forward grid (rows x tokens per row after a prefix)")
    m.add_argument("--model", default="default-trained-1b")
    m.add_argument("--dtype", default="float32")
    m.add_argument("--threads", type=int, default=2)
    m.add_argument("--repeats", type=int, default=3)
    m.add_argument("--output", required=True)
    b = sub.add_parser("bench", help="bench an embedded model on a modeled forward cost")
    b.add_argument("--model", default="default-trained", choices=["default", "default-trained"])
    b.add_argument("--grid", required=True)
    b.add_argument("--prompts", nargs="+", default=[str(PROMPTS / "stdlib_test_midfile.jsonl"),
                                                    str(PROMPTS / "stdlib_test.jsonl")])
    b.add_argument("--num-prompts", type=int, default=64)
    b.add_argument("--batch-size", type=int, default=64)
    b.add_argument("--max-new-tokens", type=int, default=64)
    b.add_argument("--repeats", type=int, default=1)
    b.add_argument("--threads", type=int, default=2)
    b.add_argument("--strategies", nargs="+", default=["speculative"])
    b.add_argument("--output-dir", default=None)
    args = parser.parse_args(argv)
    (measure if args.command == "measure" else bench)(args)


if __name__ == "__main__":
    main()
