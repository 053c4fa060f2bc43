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

Corpus-text ablation
    ``response_column="continuation"`` (CLI ``--response-column``) writes the dataset's own text
    continuation of each prompt (tokenized, cut at ``max_new_tokens``) instead of generating one,
    in the same format, so a head trained on it differs only in its data (JetSpec Table 6). The
    teacher is still the target: the trainer runs it over ``prompt + text``.
"""

from __future__ import annotations

import os

import torch

from ..prompts import chat_prompts
from .trajectories import (
    check_data_folder,
    check_ints,
    encode_prompts,
    load_shards,
    plain_generation,
    plain_generation_config,
    read_prompts,
    run_sharded,
    split_responses,
)

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
    response_column: str | None = None,
    chat_template: bool | None = None,
):
    """Write the target's continuations of ``prompts`` to ``output_dir`` (resumable); return the dataset.

    ``prompts`` may hold conversations (message lists); ``chat_template`` decides whether the tokenizer's
    chat template is applied with the generation prompt (:func:`~hf_paralleldecode.prompts.chat_prompts`:
    by default for conversations, with a warning for plain text and a chat tokenizer). The choice is
    recorded as ``prompt_format`` in the collection config.

    Sampling is reproducible: each chunk seeds torch with ``seed + its first prompt id``, so a rerun
    with the same ``batch_size`` and number of processes (a resumed run included: a lost shard's
    prompts form the same chunk again) draws the same continuations.
    """
    check_ints(max_new_tokens=(max_new_tokens, 1), batch_size=(batch_size, 1))
    if not do_sample and sampling_given(temperature, top_p, top_k):
        raise ValueError("temperature / top_p / top_k are sampling settings: pass do_sample=True with them.")
    texts, prompt_format = chat_prompts(tokenizer, read_prompts(prompts, prompt_column, conversations=True),
                                        chat_template)
    if response_column is not None:
        if do_sample or sampling_given(temperature, top_p, top_k):
            raise ValueError("response_column takes the continuations from the data: sampling settings do not apply.")
        if isinstance(prompts, list):
            raise ValueError("response_column needs a dataset or a file with that column, not a list of prompts.")
        responses = read_prompts(prompts, response_column)
    sampling = {k: v for k, v in dict(temperature=temperature, top_p=top_p, top_k=top_k).items() if v is not None}
    generation, ignored = plain_generation_config(model, do_sample=do_sample, **sampling)
    config = dict(kind="regenerated", ignored_generation_config=ignored, max_new_tokens=max_new_tokens, do_sample=do_sample, seed=seed,
                  num_prompts=len(texts), model=getattr(model.config, "name_or_path", "") or type(model).__name__,
                  response_source=f"text:{response_column}" if response_column else "model",
                  prompt_format=prompt_format, **sampling)

    def text_rows(ids):
        rows = []
        for pid in ids:
            prompt_ids = encode_prompts(tokenizer, [texts[pid]], prompt_format)["input_ids"][0]
            response = tokenizer(responses[pid], add_special_tokens=False)["input_ids"][:max_new_tokens]
            rows.append(dict(prompt_id=pid, prompt=texts[pid], prompt_ids=prompt_ids, response_ids=response,
                             input_ids=prompt_ids + response))
        return rows

    def make_rows(ids):
        enc = encode_prompts(tokenizer, [texts[i] for i in ids], prompt_format, return_tensors="pt",
                             padding=True).to(model.device)
        torch.manual_seed(seed + ids[0])
        with torch.no_grad(), plain_generation(model, generation):
            seqs = model.generate(**enc, max_new_tokens=max_new_tokens)
        return [dict(prompt_id=pid, prompt=texts[pid], prompt_ids=prompt_ids, response_ids=response,
                     input_ids=prompt_ids + response)
                for pid, (prompt_ids, response) in zip(ids, split_responses(model, enc, seqs))]

    out = run_sharded(texts, output_dir, config, batch_size, progress, "regenerate",
                      text_rows if response_column else make_rows, tokenizer)
    return load_regenerated(out)


def sampling_given(*values) -> bool:
    return any(v is not None for v in values)


def load_regenerated(output_dir: str | os.PathLike, tokenizer=None):
    """The regenerated continuations as a ``datasets.Dataset`` sorted by ``prompt_id`` (checked against
    ``tokenizer`` when given: see :func:`~hf_paralleldecode.training.trajectories.load_shards`)."""
    return load_shards(output_dir, "regenerated", tokenizer=tokenizer)


def check_regenerated_data(script, args, tokenizer) -> None:
    """The drafter methods' data checks that read no rows (``TrainingMethod.check_data``): continuations (what
    ``regenerate`` writes: ``input_ids`` and ``prompt_ids``) with the tokenizer's fingerprint."""
    check_data_folder(script.trajectories, "regenerated", ("input_ids", "prompt_ids"), "regenerate", tokenizer)
