"""How closely a cost twin computes its source: logits and stock greedy text, per shape and dtype.

``python scripts/twin_check.py --models default default-trained --shapes 1b --dtypes float32 bfloat16
--output docs/assets/twins/twin_check_cpu.json``

For each embedded model, shape and dtype: the largest absolute logit difference between the twin and the source
(both in that dtype) over the held-out prompts, and stock greedy generation (batched, left-padded) of both: the share
of rows whose new tokens are identical and the mean share of new tokens before the first difference. In fp32 the
twin matches to rounding; in bf16 near-ties flip as they do between any two bf16 kernels (docs: Numerics).
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main(argv=None) -> int:
    from hf_paralleldecode.loading import load_default_model
    from hf_paralleldecode.prompts import read_prompts
    from hf_paralleldecode.twins import TWIN_SHAPES, cost_twin

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["default", "default-trained"])
    p.add_argument("--shapes", nargs="+", default=["1b"], choices=sorted(TWIN_SHAPES))
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--prompts", default="hf_paralleldecode/assets/prompts/stdlib_test_midfile.jsonl")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--output", required=True)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    prompts = read_prompts(args.prompts)[: args.num_prompts]
    rows = []
    for name in args.models:
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            source, tokenizer = load_default_model(name)
            source.to(device=device, dtype=dtype)
            tokenizer.padding_side = "left"
            ref_tokens, ref_logits = _greedy(source, tokenizer, prompts, args)
            for shape in args.shapes:
                t0 = time.perf_counter()
                twin = cost_twin(source, shape, dtype=dtype, device=device)
                built = time.perf_counter() - t0
                tokens, logits = _greedy(twin, tokenizer, prompts, args)
                same = [a == b for a, b in zip(tokens, ref_tokens)]
                prefix = [_prefix(a, b) / max(len(b), 1) for a, b in zip(tokens, ref_tokens)]
                diff = max((a - b).abs().max().item() for a, b in zip(logits, ref_logits))
                row = dict(model=name, shape=shape, like=TWIN_SHAPES[shape].like, dtype=dtype_name,
                           params=sum(t.numel() for t in twin.parameters()), build_seconds=round(built, 2),
                           prompts=len(prompts), max_new_tokens=args.max_new_tokens,
                           max_abs_logit_diff=diff, identical_rows=sum(same), prefix_agreement=sum(prefix) / len(prefix))
                rows.append(row)
                print(json.dumps(row), flush=True)
                del twin
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    report = dict(device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  torch=torch.__version__, rows=rows)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
    return 0


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@torch.no_grad()
def _greedy(model, tokenizer, prompts, args):
    """Stock greedy new tokens per prompt, and the prompt's last-position logits (float32)."""
    device = next(model.parameters()).device
    tokens, logits = [], []
    for i in range(0, len(prompts), args.batch_size):
        enc = tokenizer(prompts[i: i + args.batch_size], return_tensors="pt", padding=True).to(device)
        logits.extend(model(**enc).logits[:, -1].float().cpu())
        out = model.generate(**enc, max_new_tokens=args.max_new_tokens, do_sample=False, decoding="stock",
                             pad_token_id=tokenizer.pad_token_id)
        for row in out[:, enc.input_ids.shape[1]:].tolist():
            tokens.append([t for t in row if t != tokenizer.pad_token_id])
    return tokens, logits


if __name__ == "__main__":
    raise SystemExit(main())
