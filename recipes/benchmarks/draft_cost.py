"""Drafting cost of draft heads on the embedded model (JetSpec Appendix G), measured on the device at hand.

For a 1-layer and a 3-layer head of each kind (randomly initialised: the cost does not depend on
the weights) and tree budgets 16..256, runs ``decoding="speculative"`` on the shipped held-out
prompts and reports per step: the target's verification forward ``T_verify``, the head's forwards
``T_draft`` (and how many), c = (T_draft / N) / T_verify with N the drafted nodes, the host time
outside the two (tree building, masks, bookkeeping), and tau. Medians over prompts; greedy output
is checked against stock greedy on every run.

    python recipes/benchmarks/draft_cost.py --threads 2 --num-prompts 4 --max-new-tokens 64 --output draft_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hf_paralleldecode as hfpd
from hf_paralleldecode.bench import load_prompts
from hf_paralleldecode.loading import default_model_path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--kinds", nargs="+", default=["block_bidirectional", "tree_causal"])
    parser.add_argument("--tree-width", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = hfpd.load_default_model(args.model)
    prompts = load_prompts(default_model_path("default").parent / "prompts" / "stdlib_test.jsonl")[: args.num_prompts]
    encoded = [tokenizer(p, return_tensors="pt") for p in prompts]
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)
    refs = [model.generate(**e, **gen, decoding="stock") for e in encoded]
    rows = []
    for kind in args.kinds:
        for layers in args.layers:
            torch.manual_seed(0)
            head = hfpd.DraftHead.for_target(model, attention=kind, num_hidden_layers=layers, block_size=16)
            for budget in args.budgets:
                per = []
                for enc, ref in zip(encoded, refs):
                    t0 = time.perf_counter()
                    out = model.generate(**enc, **gen, decoding="speculative", drafter=head, tree_budget=budget,
                                         tree_width=args.tree_width, return_dict_in_generate=True)
                    wall = time.perf_counter() - t0
                    assert torch.equal(out.sequences, ref), "speculative output differs from greedy"
                    s, steps = out.stats, out.num_forward_passes - 1
                    verify = s["model_seconds"] / out.num_forward_passes
                    per.append(dict(
                        c=s["drafting_cost"], head_forwards=s["head_forwards_per_step"], tau=s["mean_accepted_length"],
                        t_verify_ms=1e3 * verify, t_draft_ms=1e3 * s["head_seconds"] / steps,
                        host_ms=1e3 * (wall - s["model_seconds"] - s["head_seconds"]) / steps,
                        tree_host_ms=1e3 * s["draft_host_seconds"] / steps,
                    ))
                row = dict(kind=kind, layers=layers, budget=budget,
                           **{k: statistics.median(p[k] for p in per) for k in per[0]})
                rows.append(row)
                print(f"{kind:<20} L={layers} B={budget:<4} c={row['c']:.4f} head_fwd/step={row['head_forwards']:.2f} "
                      f"T_verify={row['t_verify_ms']:.2f}ms T_draft={row['t_draft_ms']:.2f}ms "
                      f"host={row['host_ms']:.2f}ms (tree {row['tree_host_ms']:.2f}ms) tau={row['tau']:.2f}", flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(dict(args=vars(args), torch=torch.__version__, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
