"""Regenerated training data for draft heads: the target's own continuations of prompts, as parquet shards.

Why
    A draft head must predict what *the target* writes, not what a corpus says (JetSpec Table 6:
    8.78x vs 3.66x at budget 256). :func:`regenerate` lets the target continue each prompt (greedy
    by default; sampling settings optional) and stores the result; the distillation trainer then
    runs the frozen target over ``prompt + response`` for teacher logits and hidden states.

Output (``output_dir``)
    ``shard-XXXXXXXX.parquet`` rows: ``prompt_id`` (index in the input), ``prompt`` (str),
    ``prompt_ids``, ``response_ids`` (up to and including EOS), ``input_ids`` (their
    concatenation); ``collection_config.json``: the settings (a restart with others is refused).
    Resumable after a kill and data-parallel under ``accelerate launch`` (each process takes
    every ``world_size``-th prompt), exactly like trajectory collection (``run_sharded``).
    Load with :func:`load_regenerated` or ``datasets.load_dataset("parquet", data_files=...)``.
"""

from __future__ import annotations

import os

import torch

from .trajectories import check_ints, load_shards, read_prompts, run_sharded, split_responses

__all__ = ["regenerate", "load_regenerated"]


def regenerate(
    model,
    tokenizer,
    prompts,
    output_dir: str | os.PathLike,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    prompt_column: str = "prompt",
    do_sample: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int = 0,
    progress: bool = True,
):
    """Write the target's continuations of ``prompts`` to ``output_dir`` (resumable); return the dataset.

    Sampling is reproducible: each chunk seeds torch with ``seed + its first prompt id``, so a rerun
    with the same ``batch_size`` and number of processes (a resumed run included: a lost shard's
    prompts form the same chunk again) draws the same continuations.
    """
    check_ints(max_new_tokens=(max_new_tokens, 1), batch_size=(batch_size, 1))
    if not do_sample and any(v is not None for v in (temperature, top_p, top_k)):
        raise ValueError("temperature / top_p / top_k are sampling settings: pass do_sample=True with them.")
    texts = read_prompts(prompts, prompt_column)
    sampling = {k: v for k, v in dict(temperature=temperature, top_p=top_p, top_k=top_k).items() if v is not None}
    config = dict(kind="regenerated", max_new_tokens=max_new_tokens, do_sample=do_sample, seed=seed,
                  num_prompts=len(texts), model=getattr(model.config, "_name_or_path", "") or type(model).__name__,
                  **sampling)

    def make_rows(ids):
        enc = tokenizer([texts[i] for i in ids], return_tensors="pt", padding=True).to(model.device)
        torch.manual_seed(seed + ids[0])
        with torch.no_grad():
            seqs = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=do_sample, **sampling)
        return [dict(prompt_id=pid, prompt=texts[pid], prompt_ids=prompt_ids, response_ids=response,
                     input_ids=prompt_ids + response)
                for pid, (prompt_ids, response) in zip(ids, split_responses(model, enc, seqs))]

    out = run_sharded(texts, output_dir, config, batch_size, progress, "regenerate", make_rows, tokenizer)
    return load_regenerated(out)


def load_regenerated(output_dir: str | os.PathLike):
    """The regenerated continuations as a ``datasets.Dataset`` sorted by ``prompt_id``."""
    return load_shards(output_dir, "regenerated")
