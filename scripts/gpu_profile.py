"""Where a speculative step's time goes, per model and dtype: the drafter's forwards split into the wait for work
already queued on the device and the forward itself, and a profiler table of one call.

Made for the H200 run in which the DEER drafter's forward cost 45-74 ms beside the 1B / 8B twins in bf16 against
2.0-2.5 ms beside the 8.4M model in fp32 on the same kind of GPU (docs/benchmark.md, "On an H200"): each
configuration runs the same call (one held-out window, batch 1, the configured tree) so the rows isolate the target
(8.4M or twin) from the dtype.

    python scripts/gpu_profile.py --device cuda --configs default-trained:float32 default-trained:bfloat16 \
        default-trained-1b:bfloat16 default-trained-1b:float32 --output-dir /tmp/profile

Each configuration runs under each ``--sdpa-variants`` entry: ``torch`` (the decoding call keeps torch's attention
order: recent torch puts cuDNN's attention first on Hopper in bf16, and it builds a graph per new shape), ``auto``
(the library's default: cuDNN's attention after the others in decoding calls, hf_paralleldecode.attention), or
backend names joined by commas (only those, for the whole call). Writes
``summary.json`` (per configuration and variant: the call's seconds, drafter forwards, mean drafter wait and forward
in ms, the attention ops the profiler saw) and ``<model>_<dtype>_<variant>.txt`` (torch.profiler's tables of one
call, by self CPU time and by device time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_one(model, tokenizer, name: str, tag: str, dtype: str, settings: dict, max_new_tokens: int,
                out_dir: Path, prompt: str) -> dict:
    from hf_paralleldecode.drafters import diffusion

    dev = next(model.parameters()).device
    enc = tokenizer(prompt, return_tensors="pt").to(dev)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, decoding="speculative",
                  return_dict_in_generate=True, **settings)
    for _ in range(2):  # warm-up: the device's first kernels of each shape
        model.generate(**enc, **kwargs)

    waits, forwards = [], []
    original = diffusion.DiffusionState._call

    def timed(self, **kw):  # the drafter's forward, with what was queued before it timed apart
        t0 = time.perf_counter()
        _sync(dev)
        t1 = time.perf_counter()
        out = original(self, **kw)
        _sync(dev)
        waits.append(t1 - t0)
        forwards.append(time.perf_counter() - t1)
        return out

    diffusion.DiffusionState._call = timed
    try:
        _sync(dev)
        t0 = time.perf_counter()
        out = model.generate(**enc, **kwargs)
        _sync(dev)
        seconds = time.perf_counter() - t0
    finally:
        diffusion.DiffusionState._call = original
    stats = out.stats
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dev.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        model.generate(**enc, **kwargs)
        _sync(dev)
    table = prof.key_averages()
    text = ["# " + name + f", {dtype}, {dev}", "## by self CPU time",
            table.table(sort_by="self_cpu_time_total", row_limit=35)]
    if dev.type == "cuda":
        text += ["## by device time", table.table(sort_by="self_cuda_time_total", row_limit=25)]
    (out_dir / f"{tag}.txt").write_text("\n".join(text) + "\n")
    attention = {e.key: e.count for e in table if "scaled_dot_product" in e.key or "attention" in e.key}
    generated = int(out.sequences.shape[1] - enc["input_ids"].shape[1])
    row = dict(model=name, dtype=dtype, device=str(dev), seconds=seconds, generated=generated,
               target_forwards=len(stats.get("accepted_lengths", [])) or None,
               model_seconds=stats.get("model_seconds"), drafter_forwards=len(forwards),
               drafter_wait_ms=1e3 * statistics.mean(waits) if waits else None,
               drafter_forward_ms=1e3 * statistics.mean(forwards) if forwards else None,
               drafter_forward_ms_median=1e3 * statistics.median(forwards) if forwards else None,
               drafter_dtype=str(stats.get("drafter_dtype")), attention_ops=attention)
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    from hf_paralleldecode.attention import attention_priority, check_sdpa_backends, sdpa_backends_context
    from hf_paralleldecode.bench import load_prompts
    from hf_paralleldecode.cli import _load

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", default=["default-trained:float32", "default-trained:bfloat16",
                                                     "default-trained-1b:bfloat16", "default-trained-1b:float32"],
                   help="MODEL:DTYPE, each run alone in turn")
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", default="hf_paralleldecode/assets/prompts/stdlib_test_midfile.jsonl")
    p.add_argument("--settings", default='{"adaptive": false}', help="generate() settings, JSON")
    p.add_argument("--sdpa-variants", nargs="+", default=["torch", "auto"],
                   help="attention per run: 'torch' (torch's order), 'auto' (the library's default) or backend names "
                        "joined by commas")
    p.add_argument("--output-dir", required=True)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    out_dir = Path(args.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    prompt = load_prompts(args.prompts)[0]
    env = dict(torch=torch.__version__, cudnn=torch.backends.cudnn.version() if device.startswith("cuda") else None)
    for variant in args.sdpa_variants:  # a bad name fails before any model loads
        if variant not in ("torch", "auto"):
            check_sdpa_backends(variant.split(","))
    rows = []
    for config in args.configs:
        model_name, dtype = config.split(":")
        model, tokenizer, name = _load(SimpleNamespace(model=model_name, dtype=dtype, device=device, threads=None))
        for variant in args.sdpa_variants:
            named = variant in ("torch", "auto")
            with attention_priority(variant if named else "auto"), sdpa_backends_context(
                    None if named else variant.split(",")):
                row = profile_one(model, tokenizer, name, f"{model_name}_{dtype}_{variant.replace(',', '-')}", dtype,
                                  json.loads(args.settings), args.max_new_tokens, out_dir, prompt)
            rows.append(dict(row, sdpa=variant))
            (out_dir / "summary.json").write_text(json.dumps(dict(env, rows=rows), indent=2))
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
