"""Apply the user's ``LogitsProcessorList`` to many positions of one forward, exactly as ``_sample`` would.

What it is for
    A verifier scores ``width`` positions per row in one forward. Stock generation would have
    called each processor once per token with that row's ids so far (padded prompt + generated
    tokens). :func:`process_block` reproduces that: position ``j`` of row ``b`` is processed with
    the row's own prefix ``history[b] + fed[b, 1 : j + 1]``.

Two paths
    * fast: when every processor ignores ``input_ids`` (the stateless warpers such as temperature,
      top-k, top-p, min-p and token suppression) all positions go through in one flattened call;
    * exact: otherwise one call per (row, position) with that row's prefix, batch size 1. This is
      what makes repetition penalty, no-repeat-n-gram, bad words, min length, forced EOS and
      sequence bias lossless. A processor must therefore score a row from that row's ids alone;
      :data:`BATCH_DEPENDENT_PROCESSORS` (which read the batch index) are refused for batch > 1.

What it deliberately does not know
    How tokens are chosen from the scores (greedy argmax or rejection sampling).
"""

from __future__ import annotations

import torch
from transformers.generation import logits_process as lp

__all__ = ["process_block", "check_processors", "PREFIX_INDEPENDENT_PROCESSORS", "BATCH_DEPENDENT_PROCESSORS"]

# Processors whose output depends on the scores alone (never on input_ids): safe to batch.
PREFIX_INDEPENDENT_PROCESSORS: tuple[type, ...] = tuple(
    getattr(lp, name)
    for name in (
        "TemperatureLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
        "MinPLogitsWarper",
        "TypicalLogitsWarper",
        "EpsilonLogitsWarper",
        "EtaLogitsWarper",
        "SuppressTokensLogitsProcessor",
        "InfNanRemoveLogitsProcessor",
        "LogitNormalization",
    )
    if hasattr(lp, name)
)

# Processors that read the row's index in the batch: per-row calls would hand them the wrong index.
BATCH_DEPENDENT_PROCESSORS: tuple[type, ...] = tuple(
    getattr(lp, name) for name in ("PrefixConstrainedLogitsProcessor",) if hasattr(lp, name)
)


def check_processors(logits_processor, batch_size: int) -> None:
    """Raise ``ValueError`` for processors the block verifier cannot apply exactly."""
    for proc in logits_processor or []:
        if batch_size > 1 and isinstance(proc, BATCH_DEPENDENT_PROCESSORS):
            raise ValueError(
                f"{type(proc).__name__} (prefix_allowed_tokens_fn) reads the batch index, which parallel decoding "
                "cannot reproduce with batch size > 1. Generate one prompt at a time, or use stock generate()."
            )


def process_block(
    logits_processor,
    logits: torch.Tensor,  # [batch, width, vocab] raw logits, fp32
    fed: torch.Tensor,  # [batch, width] tokens fed; fed[:, 0] is each row's last committed token
    widths: torch.Tensor,  # [batch] number of real (non-filler) positions per row
    histories: list[torch.Tensor],  # per row: padded prompt + committed tokens (ends with fed[b, 0])
) -> torch.Tensor:
    """Return processed scores ``[batch, width, vocab]``; filler positions are left unprocessed."""
    if not logits_processor:
        return logits
    batch, width, vocab = logits.shape
    if all(isinstance(p, PREFIX_INDEPENDENT_PROCESSORS) for p in logits_processor):
        flat = logits.reshape(batch * width, vocab)
        dummy = fed.reshape(batch * width, 1)
        return logits_processor(dummy, flat).reshape(batch, width, vocab)
    out = logits.clone()
    for b in range(batch):
        prefix = torch.cat([histories[b], fed[b, 1:]])  # history ends with fed[b, 0]
        base = histories[b].shape[0]
        for j in range(int(widths[b])):
            ids = prefix[: base + j][None]
            out[b, j] = logits_processor(ids, logits[b, j][None])[0]
    return out
