"""Jacobi trajectory collection: every intermediate Jacobi state of every block, resumably, as parquet shards.

What it does
    Generates each prompt's greedy response block by block (``block_size`` = n) with the
    library's Jacobi decoding (KV-cached, batched, lossless) and records, per block, every state
    the block went through (from its initial guess to its fixed point) and the fixed point. In fp32
    the states are those of cache-free Jacobi iteration (each position's update depends only on the
    tokens before it; in half precision up to rounding), so they are the CLLM / Jacobi Forcing
    training data. Collection decodes plain greedy, whatever the checkpoint's generation config
    says (see :func:`plain_generation_config`).

Output (``output_dir``)
    * ``shard-XXXXXXXX.parquet``: one row per prompt, columns
      ``prompt_id`` (int, index in the input), ``prompt`` (str), ``prompt_ids`` (list[int]),
      ``response_ids`` (list[int], the greedy response up to and including EOS),
      ``trajectories`` (list over complete blocks of list over states of list[int], each state n
      tokens, the last one the fixed point), ``fixed_points`` (list[list[int]]),
      ``degenerate`` (bool: the response repeats one token ``max_repeat`` times in a row).
      Every block inside the response is recorded; a block cut short by EOS or by ``max_new_tokens``
      is not (its states are not n long).
    * ``collection_config.json``: the settings; a restart with different settings is refused.
    Load with :func:`load_trajectories` (or ``datasets.load_dataset("parquet", data_files=...)``).

Resumable
    Prompts are processed in chunks; each chunk is written to a temporary file and renamed into
    place (atomic), so a run killed at any point (SIGKILL included) leaves only complete shards.
    Rerunning the same command skips the prompts already in shards: every prompt ends up in
    exactly one shard.
"""

from __future__ import annotations

import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path

import torch

from ..compat import GENERATION_CONFIG_BOOKKEEPING
from ..decoding.jacobi import JacobiProposer
from ..engine.run import decode
from ..prompts import chat_prompts, read_prompts

logger = logging.getLogger(__name__)

__all__ = ["collect_trajectories", "load_trajectories", "read_prompts", "run_sharded", "load_shards", "check_ints",
           "split_responses", "tokenizer_fingerprint", "check_data_folder"]

CONFIG_FILE = "collection_config.json"


class _RecordingJacobi(JacobiProposer):
    """Jacobi proposer that records each block's states per original row."""

    def __init__(self, run, block_size, seed, sink):
        super().__init__(run, block_size, "random_context", seed)
        self.sink = sink  # original row -> list of (states, fixed_point)
        self.block_start = {int(r): 0 for r in run.rows}
        self.states = {int(r): [] for r in run.rows}

    def propose(self):
        log = self.run.log
        for i, r in enumerate(self.run.row_ids):
            count, start, left = int(log.count[r]), self.block_start[r], int(self.block_left[i])
            state = log.tokens[r, start : count - 1].tolist() + self.draft[i, :left].tolist()
            if len(state) == self.n:  # blocks cut by the token budget are not recorded
                self.states[r].append(state)
        return super().propose()

    def update(self, tree, verdict):
        super().update(tree, verdict)
        log = self.run.log
        for r in self.run.row_ids:
            count = int(log.count[r])
            # complete: the bonus starts the next block, or EOS is the block's last token
            end = self.block_start[r] + self.n
            complete = count - 1 >= end or (count == end and int(log.first_eos[r]) == end - 1)
            if complete:
                fixed = log.tokens[r, self.block_start[r] : self.block_start[r] + self.n].tolist()
                states = self.states[r]
                if states and states[-1] != fixed:
                    states.append(fixed)
                if states:
                    self.sink[r].append((states, fixed))
                self.states[r], self.block_start[r] = [], count - 1


def _jacobi_recording(sink, block_size, seed):
    def strategy(model, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                 streamer=None, **model_kwargs):
        return decode(model, "jacobi", lambda run: _RecordingJacobi(run, block_size, seed, sink), input_ids,
                      logits_processor, stopping_criteria, generation_config, None, model_kwargs,
                      dict(block_size=block_size))

    return strategy


def _max_run(tokens: list[int]) -> int:
    best = run = 0
    prev = None
    for t in tokens:
        run = run + 1 if t == prev else 1
        prev, best = t, max(best, run)
    return best


def collect_trajectories(
    model,
    tokenizer,
    prompts,
    output_dir: str | os.PathLike,
    block_size: int = 16,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    prompt_column: str = "prompt",
    max_repeat: int | None = 10,
    seed: int = 0,
    progress: bool = True,
    chat_template: bool | None = None,
):
    """Collect Jacobi trajectories for ``prompts`` into ``output_dir`` (resumable, data-parallel under
    ``accelerate launch``: see :func:`run_sharded`); return the dataset.

    ``prompts`` may hold conversations (message lists); ``chat_template`` decides whether the tokenizer's
    chat template is applied (:func:`~hf_paralleldecode.prompts.chat_prompts`); the choice is recorded
    as ``prompt_format`` in the collection config."""
    check_ints(block_size=(block_size, 2), max_new_tokens=(max_new_tokens, 1), batch_size=(batch_size, 1))
    texts, prompt_format = chat_prompts(tokenizer, read_prompts(prompts, prompt_column, conversations=True),
                                        chat_template)
    generation, ignored = plain_generation_config(model, do_sample=False)
    config = dict(block_size=block_size, max_new_tokens=max_new_tokens, seed=seed, num_prompts=len(texts),
                  model=getattr(model.config, "name_or_path", "") or type(model).__name__,
                  ignored_generation_config=ignored, prompt_format=prompt_format)
    out = run_sharded(
        texts, output_dir, config, batch_size, progress, "trajectories",
        lambda ids: _collect_chunk(model, tokenizer, texts, ids, block_size, max_new_tokens, max_repeat, seed,
                                   generation, prompt_format),
        tokenizer,
    )
    return load_trajectories(out, drop_degenerate=False)


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of ``tokenizer``'s vocabulary and special tokens: data written with one tokenizer is
    refused by training with another (token ids would silently mean other tokens)."""
    import hashlib

    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted((k, str(v)) for k, v in tokenizer.special_tokens_map.items())
    return hashlib.sha256(json.dumps([vocab, special], ensure_ascii=False).encode()).hexdigest()[:16]


#: generation-config fields that do not change which tokens are generated
_SPECIAL = {"eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id", *GENERATION_CONFIG_BOOKKEEPING,
            "max_length", "max_new_tokens", "use_cache", "output_attentions",
            "output_hidden_states", "output_scores", "output_logits", "return_dict_in_generate"}


def plain_generation_config(model, **settings):
    """``(config, ignored)``: a generation config with only the model's special tokens plus ``settings``,
    and the checkpoint's other generation settings it leaves out.

    Training data must come from the decoding the trainers assume (plain greedy for trajectories;
    the requested sampling for regenerated text), not from whatever a checkpoint ships in its
    ``generation_config.json`` (Qwen2.5: ``repetition_penalty=1.05``, ``do_sample=True``). What was
    left out is recorded in ``collection_config.json`` as ``ignored_generation_config``. Use it
    through :func:`plain_generation` (transformers fills a passed config's unset fields from the
    model's own, so passing it is not enough).
    """
    from transformers import GenerationConfig

    own = model.generation_config
    eos = own.eos_token_id
    pad = own.pad_token_id if own.pad_token_id is not None else (eos[0] if isinstance(eos, list) else eos)
    config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=own.bos_token_id, **settings)
    ignored = {k: v for k, v in sorted(own.to_diff_dict().items()) if k not in _SPECIAL and not k.startswith("_")}
    return config, ignored


@contextmanager
def plain_generation(model, config):
    """Within the block, ``model.generation_config`` is ``config`` (restored after, also on errors)."""
    own = model.generation_config
    model.generation_config = config
    try:
        yield model
    finally:
        model.generation_config = own


def check_ints(**settings) -> None:
    """``name=(value, minimum)``: ``ValueError`` unless each value is an integer (not a bool) >= its minimum."""
    for name, (value, low) in settings.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"`{name}` must be an integer >= {low}, got {value!r}.")


def split_responses(model, enc, seqs) -> list[tuple[list[int], list[int]]]:
    """Per row of a left-padded ``generate`` call: the prompt without padding and the response up to its EOS."""
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    out = []
    for b in range(seqs.shape[0]):
        prompt_ids = enc["input_ids"][b][enc["attention_mask"][b].bool()].tolist()
        response = seqs[b, enc["input_ids"].shape[1] :].tolist()
        out.append((prompt_ids, response[: next((k + 1 for k, t in enumerate(response) if t in eos), len(response))]))
    return out


def process_share() -> tuple[int, int]:
    """``(rank, world_size)`` of this process under ``accelerate launch`` / ``torchrun`` (``(0, 1)`` alone)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if not 0 <= rank < world:
        raise ValueError(f"Inconsistent RANK={rank} / WORLD_SIZE={world}.")
    return rank, world


def run_sharded(texts, output_dir, config: dict, batch_size: int, progress: bool, desc: str, make_rows, tokenizer):
    """Process ``texts`` in chunks written as atomic parquet shards; resumable and data-parallel.

    ``make_rows(prompt_ids)`` returns one row (a dict with ``prompt_id``) per prompt of a chunk.
    Rerunning skips the prompts already in shards (every prompt ends in exactly one shard, also
    after a SIGKILL). Under ``accelerate launch`` each process takes the prompts with
    ``prompt_id % world_size == rank``; shards are named by their first prompt id, so processes
    never write the same file, and a killed multi-process run resumes exactly. A restart with other
    settings (``config``) is refused. Rows are matched to prompts by content: prompts appended to the
    file are collected on a rerun; a reordered, edited or shortened file is refused.
    """
    from tqdm.auto import tqdm

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    rank, world = process_share()
    config = {**config, "tokenizer": tokenizer_fingerprint(tokenizer), "vocab_size": len(tokenizer)}
    config_path = out / CONFIG_FILE
    # the number of prompts may grow (appending to a collection); every other setting must match
    config = {**config, "num_prompts": len(texts)}
    if config_path.exists():
        previous = json.loads(config_path.read_text())
        diff = {k: (previous.get(k), v) for k, v in config.items() if previous.get(k) != v and k != "num_prompts"}
        if diff:
            raise ValueError(f"{out} holds a collection with other settings {diff} (old, new); use a new output_dir.")
    if not config_path.exists() or json.loads(config_path.read_text()).get("num_prompts") != len(texts):
        # every process may get here: each writes the same content atomically
        tmp = config_path.with_name(f"{CONFIG_FILE}.{rank}.tmp")
        tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, config_path)
    for tmp in out.glob(f"*.{rank}.tmp"):
        tmp.unlink()  # this process's leftovers of a killed run
    done = {}
    for shard in sorted(out.glob("shard-*.parquet")):
        done.update(_read_prompts(shard))
    # rows are matched to the prompts by content: a reordered or edited prompts file is refused, not
    # silently "resumed" with rows that belong to other prompts
    stale = sorted(i for i, text in done.items() if i >= len(texts) or texts[i] != text)
    if stale:
        shown = ", ".join(map(str, stale[:5])) + (" ..." if len(stale) > 5 else "")
        raise ValueError(
            f"{out} holds rows for {len(stale)} prompt(s) that are not the same prompts at the same positions of "
            f"this prompts file (prompt_id {shown}): the file was reordered, edited or shortened. Use a new "
            "output_dir, or restore the file (appending new prompts at its end is fine)."
        )
    mine = [i for i in range(len(texts)) if i % world == rank]
    todo = [i for i in mine if i not in done]
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    bar = tqdm(total=len(mine), initial=len(mine) - len(todo), disable=not progress or rank != 0, desc=desc)
    for start in range(0, len(todo), batch_size):
        ids = todo[start : start + batch_size]
        _write_shard(make_rows(ids), out, ids[0], rank)
        bar.update(len(ids))
    bar.close()
    return out


def _write_shard(rows: list[dict], out: Path, first_id: int, rank: int) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    final = out / f"shard-{first_id:08d}.parquet"
    tmp = out / f"shard-{first_id:08d}.parquet.{rank}.tmp"
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, final)


def _read_prompts(shard: Path) -> dict[int, str]:
    """``{prompt_id: prompt}`` of a shard."""
    import pyarrow.parquet as pq

    table = pq.read_table(shard, columns=["prompt_id", "prompt"])
    return dict(zip(table.column("prompt_id").to_pylist(), table.column("prompt").to_pylist()))


def encode_prompts(tokenizer, texts: list[str], prompt_format: str, **kwargs):
    """Tokenize prompts; templated text already holds its special tokens (no second BOS)."""
    return tokenizer(texts, add_special_tokens=prompt_format != "chat_template", **kwargs)


def _collect_chunk(model, tokenizer, texts, ids, block_size, max_new_tokens, max_repeat, seed, generation,
                   prompt_format="raw"):
    enc = encode_prompts(tokenizer, [texts[i] for i in ids], prompt_format, return_tensors="pt",
                         padding=True).to(model.device)
    sink: dict[int, list] = {b: [] for b in range(len(ids))}
    # one token more: the last block is iterated at full width and completed by its bonus
    with torch.no_grad(), plain_generation(model, generation):
        seqs = model.generate(**enc, max_new_tokens=max_new_tokens + 1,
                              custom_generate=_jacobi_recording(sink, block_size, seed))
    seqs = seqs[:, : enc["input_ids"].shape[1] + max_new_tokens]
    rows = []
    for b, (pid, (prompt_ids, response)) in enumerate(zip(ids, split_responses(model, enc, seqs))):
        blocks = sink[b]
        rows.append(dict(
            prompt_id=pid, prompt=texts[pid], prompt_ids=prompt_ids, response_ids=response,
            trajectories=[states for states, _ in blocks], fixed_points=[fixed for _, fixed in blocks],
            degenerate=bool(max_repeat) and _max_run(response) >= max_repeat,
        ))
    return rows


def load_shards(output_dir: str | os.PathLike, what: str = "trajectory", tokenizer=None):
    """The shards of ``output_dir`` as one ``datasets.Dataset`` sorted by ``prompt_id``.

    With ``tokenizer``: refuses data written with another tokenizer (the fingerprint in
    ``collection_config.json``) or holding token ids outside its vocabulary.
    """
    import datasets

    shards, config = _data_folder(output_dir, what, tokenizer)
    ds = datasets.load_dataset("parquet", data_files=shards, split="train")
    if tokenizer is not None:
        check_token_ids(ds, len(tokenizer), f"the {what} data in {output_dir}")
    if len(ds) < config.get("num_prompts", 0):
        logger.warning("%s holds %d of %d prompts: the run that wrote it did not finish (rerun it to resume).",
                       output_dir, len(ds), config["num_prompts"])
    return ds.sort("prompt_id")


def _data_folder(output_dir, what: str, tokenizer=None, command: str | None = None) -> tuple[list[str], dict]:
    """``(the shards, the collection config or {})`` of a data folder whose shards are readable and hold rows,
    written with ``tokenizer`` when given (``command``: the one that writes such data, for the messages)."""
    command = command or ("regenerate" if what == "regenerated" else "collect")
    out = Path(output_dir)
    if out.is_file():
        raise ValueError(f"{output_dir} is a file, not a folder of {what} data: write the data with "
                         f"`hf-paralleldecode {command} --prompts FILE --output-dir DIR` and pass DIR "
                         "(the recipe's `trajectories`).")
    shards = sorted(str(p) for p in out.glob("shard-*.parquet"))
    if not shards:
        raise ValueError(f"No {what} shards in {output_dir}: write them with `hf-paralleldecode {command}`.")
    config_path = out / CONFIG_FILE
    try:
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"Could not read {config_path}: {err}. It is written with the data: write the data "
                         "again into a new folder.") from None
    if tokenizer is not None and config.get("tokenizer") not in (None, tokenizer_fingerprint(tokenizer)):
        raise ValueError(
            f"The {what} data in {output_dir} was written with another tokenizer (fingerprint {config['tokenizer']}, "
            f"this one {tokenizer_fingerprint(tokenizer)}): its token ids mean other tokens here. Regenerate it with "
            "the model you train for."
        )
    _check_shard_files(shards, what)
    return shards, config


def check_data_folder(output_dir, what: str, columns, command: str, tokenizer=None) -> dict:
    """The checks of a training data folder that read no rows, made by a real ``train`` run before its model loads
    and by ``train --dry-run`` alike: a folder of readable shards holding rows with ``columns`` (the data
    ``hf-paralleldecode {command}`` writes), written with ``tokenizer`` when given (:func:`load_shards` checks the
    same). Returns its collection config (``{}`` without one)."""
    import pyarrow.parquet as pq

    shards, config = _data_folder(output_dir, what, tokenizer, command)
    missing = [c for c in columns if c not in pq.read_schema(shards[0]).names]
    if missing:
        raise ValueError(f"{output_dir} holds no {what} data: its rows lack {missing}. This method trains on what "
                         f"`hf-paralleldecode {command}` writes: run it and name its --output-dir in the recipe's "
                         "`trajectories`.")
    return config


def _check_shard_files(shards: list[str], what: str) -> None:
    """Every shard is a readable parquet file with rows (the writer never leaves an empty one)."""
    import pyarrow.parquet as pq

    for shard in shards:
        try:
            rows = pq.ParquetFile(shard).metadata.num_rows
        except Exception as err:  # truncated or foreign file: name it instead of a pyarrow trace
            raise ValueError(f"Could not read the {what} shard {shard}: {err}. Delete it and rerun the "
                             "collection to redo its prompts.") from None
        if rows == 0:
            raise ValueError(f"The {what} shard {shard} holds no rows: it was not written by this library. "
                             "Delete it and rerun the collection.")


def check_token_ids(dataset, vocab_size: int, where: str, columns=("input_ids", "prompt_ids", "response_ids")):
    """``ValueError`` if a token-id column of ``dataset`` holds an id outside ``[0, vocab_size)``."""
    import pyarrow.compute as pc

    table = dataset.data.table if hasattr(dataset, "data") else None
    for column in columns:
        if table is None or column not in table.column_names:
            continue
        flat = pc.list_flatten(table.column(column))
        if len(flat) == 0:
            continue
        low, high = pc.min_max(flat).values()
        if low.as_py() < 0 or high.as_py() >= vocab_size:
            raise ValueError(
                f"{where} holds token ids in [{low.as_py()}, {high.as_py()}] but the tokenizer / model has "
                f"{vocab_size} tokens: it was written for another tokenizer."
            )


def load_trajectories(output_dir: str | os.PathLike, drop_degenerate: bool = True, tokenizer=None):
    """The collected trajectories as a ``datasets.Dataset`` sorted by ``prompt_id`` (checked against
    ``tokenizer`` when given: see :func:`load_shards`)."""
    ds = load_shards(output_dir, tokenizer=tokenizer)
    return ds.filter(lambda row: not row["degenerate"]) if drop_degenerate else ds
