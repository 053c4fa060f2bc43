"""Record, or check, what every decoding produces on the held-out prompts: a refactor's witness.

Runs each strategy (and each shipped drafter, and each embedded model's saved default decoding) on both
embedded models, greedy and sampled (a fixed seed), at batch 1 and batch 3 (left-padded), and records the
generated tokens and, with the batch policy off (``adaptive=False``, the only setting whose counts do not
depend on the clock), the target's forward passes (batch and per row). With the policy on only greedy tokens are
recorded: the shapes it picks follow the clock, which changes a sampled run's draws and the counts, never greedy
tokens. ``--save FILE`` writes them; ``--check
FILE`` compares a fresh run against a saved one and exits non-zero on any difference.

    python scripts/outputs_digest.py --save /tmp/before.json      # before the change
    python scripts/outputs_digest.py --check /tmp/before.json     # after it

fp32 on the CPU, 4 prompts of ``stdlib_test_midfile.jsonl``, 32 new tokens: under a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing it

import hf_paralleldecode as hfpd  # noqa: E402
from hf_paralleldecode.prompts import read_prompts  # noqa: E402

PROMPTS = Path(hfpd.__file__).parent / "assets" / "prompts" / "stdlib_test_midfile.jsonl"

#: (label, generate() keywords); greedy with the policy on and off, sampled with it off
CASES = [
    ("jacobi", dict(decoding="jacobi")),
    ("jacobi_forcing", dict(decoding="jacobi_forcing")),
    ("lookahead", dict(decoding="lookahead")),
    ("prompt_lookup", dict(decoding="prompt_lookup")),
    ("deer", dict(decoding="speculative", drafter="default-deer")),
    ("deer+context", dict(decoding="speculative", drafter="default-deer", context_matches=2)),
    ("jetspec", dict(decoding="speculative", drafter="default-jetspec")),
    ("dflash", dict(decoding="speculative", drafter="default-dflash")),
    ("eagle3", dict(decoding="speculative", drafter="default-eagle3")),
    ("checkpoint default", dict()),
]


def run(max_new_tokens: int = 32, num_prompts: int = 4) -> dict:
    torch.set_num_threads(2)
    prompts = read_prompts(PROMPTS)[:num_prompts]
    out = {}
    for model_name in ("default", "default-trained"):
        model, tok = hfpd.load_default_model(model_name)
        tok.padding_side = "left"
        batches = {"b1": prompts[:1], "b3": prompts[1:4]}
        for label, kwargs in CASES:
            for sample in (False, True):
                for adaptive in ((False,) if sample else (False, True)):  # a sampled draw depends on the shapes
                    for bname, group in batches.items():
                        enc = tok(group, return_tensors="pt", padding=True)
                        call = dict(kwargs, max_new_tokens=max_new_tokens, do_sample=sample, adaptive=adaptive,
                                    return_dict_in_generate=True)
                        if sample:
                            call.update(temperature=0.8, top_k=0)
                            torch.manual_seed(1234)
                        res = model.generate(**enc, **call)
                        key = f"{model_name}|{label}|{'sample' if sample else 'greedy'}|adaptive={adaptive}|{bname}"
                        record = {"tokens": res.sequences[:, enc["input_ids"].shape[1]:].tolist()}
                        if not adaptive:
                            record["forward_passes"] = getattr(res, "num_forward_passes", None)
                            record["row_forwards"] = (getattr(res, "stats", None) or {}).get("row_forwards")
                        out[key] = record
                        print(key, record.get("forward_passes"), flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--save", type=Path)
    g.add_argument("--check", type=Path)
    args = p.parse_args(argv)
    got = run()
    if args.save:
        args.save.write_text(json.dumps(got, indent=0))
        print(f"saved {len(got)} cases to {args.save}")
        return 0
    want = json.loads(args.check.read_text())
    bad = [k for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)]
    for k in bad:
        print(f"DIFFERS: {k}\n  before: {want.get(k)}\n  now:    {got.get(k)}")
    print(f"{len(got) - len(bad)} of {len(set(want) | set(got))} cases identical")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
