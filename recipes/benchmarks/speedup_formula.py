"""JetSpec's speed-up formula (Eq. 2 / 3) with measured per-depth acceptance and drafting cost, against measurement.

For each trained head and tree budget, on the shipped held-out prompts (batch 1, greedy), one run
measures per decoding step:

* the per-depth acceptance ``alpha_d = P(L >= d | L >= d-1)`` (``L`` = drafted tokens accepted in a
  step) and the pooled acceptance rate ``alpha`` (accepted positions / positions reached);
* ``c = (T_draft / N) / T_verify`` (N drafted nodes), ``T_verify / T_AR`` (a forward over the
  tree vs one AR forward) and the host time outside both forwards;
* tau (tokens per target forward) and the wall-clock speed-up against stock greedy, same run.

and prints Eq. 2 ``E = (1 - alpha^(D+1)) / (1 - alpha)`` (i.i.d. acceptance over depth D), the exact
product form ``1 + sum_k prod_{d<=k} alpha_d``, Eq. 3 ``E / (1 + N c)`` (the seed's assumptions:
verification costs one AR forward, no host time), and the same with the measured verification
and host costs, next to the measured speed-up. Greedy output is checked against stock greedy.

    python recipes/benchmarks/speedup_formula.py --threads 2 --num-prompts 16 --max-new-tokens 64 \
        --output docs/assets/speedup_formula_cpu.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

import hf_paralleldecode as hfpd
from hf_paralleldecode.bench import load_prompts
from hf_paralleldecode.loading import default_model_path


def per_depth_acceptance(lengths: list[int], depth: int) -> list[float]:
    """``alpha_d`` for d = 1..depth from per-step accepted lengths (accepted drafted tokens + 1)."""
    drafted = [n - 1 for n in lengths]
    out = []
    for d in range(1, depth + 1):
        reached = sum(1 for x in drafted if x >= d - 1)
        out.append(sum(1 for x in drafted if x >= d) / reached if reached else 0.0)
    return out


def eq2(alpha: float, depth: int) -> float:
    return depth + 1.0 if alpha >= 1.0 else (1 - alpha ** (depth + 1)) / (1 - alpha)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", nargs="+", default=["default-jetspec", "default-dflash"])
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--tree-width", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = hfpd.load_default_model("default")
    prompts = load_prompts(default_model_path("default").parent / "prompts" / "stdlib_test.jsonl")[: args.num_prompts]
    encoded = [tokenizer(p, return_tensors="pt") for p in prompts]
    gen = dict(max_new_tokens=args.max_new_tokens, do_sample=False)

    def timed(**kw):
        t0 = time.perf_counter()
        out = [model.generate(**e, **gen, return_dict_in_generate=True, **kw) for e in encoded]
        return out, time.perf_counter() - t0

    for e in encoded[:2]:  # warm-up
        model.generate(**e, max_new_tokens=8, do_sample=False, decoding="stock")
    ar, ar_seconds = timed(decoding="stock")
    refs = [o.sequences for o in ar]
    ar_tokens = sum(r.shape[1] - e["input_ids"].shape[1] for r, e in zip(refs, encoded))
    t_ar = ar_seconds / ar_tokens  # one AR forward (prefill amortised in)
    rows = []
    for name in args.heads:
        head = hfpd.DraftHead.from_pretrained(name, use_safetensors=True)
        depth = head.config.block_size
        for budget in args.budgets:
            out, seconds = timed(decoding="speculative", drafter=head, tree_budget=budget, tree_width=args.tree_width)
            for o, ref in zip(out, refs):
                assert torch.equal(o.sequences, ref), "speculative output differs from greedy"
            lengths = [n for o in out for step in o.stats["accepted_lengths"] for n in step]
            steps = len(lengths)
            alpha_d = per_depth_acceptance(lengths, depth)
            reached = sum(min(n - 1, depth - 1) + 1 for n in lengths)  # positions whose acceptance was decided
            alpha = sum(n - 1 for n in lengths) / reached
            tau = sum(lengths) / steps
            model_s = sum(o.stats["model_seconds"] for o in out)
            head_s = sum(o.stats["drafter_seconds"] for o in out)
            forwards = sum(o.num_forward_passes for o in out)
            t_verify = model_s / forwards
            c = (head_s / steps / budget) / t_verify
            host = (seconds - model_s - head_s) / steps
            product = 1.0
            exact = 1.0
            for a in alpha_d:
                product *= a
                exact += product
            eq3 = eq2(alpha, depth) / (1 + budget * c)
            measured_costs = tau * t_ar / (t_verify + head_s / steps + host)
            row = dict(head=name, attention=head.config.attention, budget=budget, depth=depth, steps=steps,
                       alpha_d=[round(a, 4) for a in alpha_d], alpha=alpha, tau=tau, eq2=eq2(alpha, depth),
                       product_form=exact, c=c, verify_over_ar=t_verify / t_ar, host_ms=1e3 * host,
                       draft_ms=1e3 * head_s / steps, verify_ms=1e3 * t_verify, ar_ms=1e3 * t_ar, eq3_speedup=eq3,
                       speedup_with_measured_costs=measured_costs, measured_speedup=ar_seconds / seconds)
            rows.append(row)
            print(f"{name:<16} B={budget:<4} tau={tau:.2f} Eq2={row['eq2']:.2f} (alpha={alpha:.3f}) "
                  f"prod={exact:.2f} c={c:.4f} Tv/Tar={row['verify_over_ar']:.2f} host={row['host_ms']:.1f}ms "
                  f"Eq3={eq3:.2f}x with-costs={measured_costs:.2f}x measured={row['measured_speedup']:.2f}x",
                  flush=True)
            print("    alpha_d:", " ".join(f"{a:.2f}" for a in alpha_d), flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(dict(args=vars(args), torch=torch.__version__, ar_ms_per_token=1e3 * t_ar, rows=rows), f,
                      indent=2)


if __name__ == "__main__":
    main()
