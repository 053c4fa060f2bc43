"""Held-out loss and greedy agreement of trained checkpoints vs the embedded base model.

    python recipes/demo_model/evaluate_trained.py runs/jf_tiny runs/cllm_tiny --num-prompts 16

Held-out loss: the first 200k tokens of the stdlib test/ package in 512-token chunks (as the base
model's training report). On the shipped held-out prompts, against the base model's greedy output:
* greedy prefix agreement: share of generated tokens, up to each prompt's first divergence, equal
  to the base model's (one early divergence ends a prompt's count: a strict measure);
* teacher-forced top-1 agreement: share of positions of the base's greedy continuation where the
  checkpoint's argmax, given the same prefix, is the base's token;
* distinct 4-grams: share of distinct 4-grams among all 4-grams of a model's own greedy outputs,
  pooled over the prompts (lower = more repetitive; repetitive text is also easier to decode in
  parallel).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_demo_model import chunk_ids, held_out_loss, stdlib_files  # noqa: E402


def main(argv=None):
    import hf_paralleldecode as hfpd
    from hf_paralleldecode.bench import load_prompts

    p = argparse.ArgumentParser()
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=96)
    args = p.parse_args(argv)
    base, tok = hfpd.load_default_model()
    chunks = chunk_ids(tok, stdlib_files(held_out=True), 512, max_tokens=200_000)
    prompts = load_prompts(hfpd.default_model_path().parent / "prompts" / "stdlib_test.jsonl")[: args.num_prompts]
    encs = [tok(x, return_tensors="pt") for x in prompts]
    gen = lambda m, e: m.generate(**e, max_new_tokens=args.max_new_tokens, do_sample=False, decoding="stock")[  # noqa: E731
        0, e["input_ids"].shape[1]:]
    base_out = [gen(base, e) for e in encs]

    def distinct_4grams(outs):
        grams = [tuple(o[i : i + 4].tolist()) for o in outs for i in range(len(o) - 3)]
        return len(set(grams)) / max(len(grams), 1) if grams else 1.0

    @torch.no_grad()
    def forced_agreement(model):
        hits = total = 0
        for e, cont in zip(encs, base_out):
            ids = torch.cat([e["input_ids"][0], cont])[None]
            start = e["input_ids"].shape[1]
            pred = model(input_ids=ids).logits[0, start - 1 : -1].argmax(-1)
            hits, total = hits + int((pred == cont).sum()), total + len(cont)
        return hits / total

    report = {"base": {"held_out_loss": round(held_out_loss(base, chunks), 4),
                       "teacher_forced_top1_agreement": round(forced_agreement(base), 4),
                       "distinct_4grams": round(distinct_4grams(base_out), 4)}}
    for ckpt in args.checkpoints:
        model = hfpd.load_model(ckpt)
        outs = [gen(model, e) for e in encs]
        agree = sum(int((a == b).long().cumprod(0).sum()) for a, b in zip(outs, base_out))
        report[ckpt] = {
            "held_out_loss": round(held_out_loss(model, chunks), 4),
            "greedy_prefix_agreement_with_base": round(agree / sum(len(b) for b in base_out), 4),
            "teacher_forced_top1_agreement": round(forced_agreement(model), 4),
            "distinct_4grams": round(distinct_4grams(outs), 4),
            "identical_greedy_outputs": sum(torch.equal(a, b) for a, b in zip(outs, base_out)),
            "prompts": len(prompts),
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
