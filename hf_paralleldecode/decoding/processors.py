"""Apply the user's ``LogitsProcessorList`` to many positions of one forward, exactly as ``_sample`` would.

What it is for
    A verifier scores ``width`` positions per row in one forward. Stock generation would have
    called each processor once per token with that row's ids so far (padded prompt + generated
    tokens). :func:`process_block` reproduces that: position ``j`` of row ``b`` is processed with
    the row's own prefix ``history[b] + fed[b, 1 : j + 1]``.

Two paths
    * fast: when every processor ignores ``input_ids`` (the stateless warpers such as temperature,
      top-k, top-p, min-p and token suppression) all positions go through in one flattened call;
    * exact: otherwise one call per distinct prefix length, each row at its own batch index. This is
      what makes repetition penalty, no-repeat-n-gram, bad words, min length, forced EOS and
      sequence bias lossless. A processor must score a row from that row's ids (and its index in
      the batch) alone, which every stock processor does.

What it deliberately does not know
    How tokens are chosen from the scores (greedy argmax or rejection sampling).
"""

from __future__ import annotations

import torch
from transformers.generation import logits_process as lp

__all__ = ["process_block", "PREFIX_INDEPENDENT_PROCESSORS", "MODEL_CALLING_PROCESSORS"]

# Processors that run the model themselves, once per generated token (refused by every strategy).
MODEL_CALLING_PROCESSORS: tuple[type, ...] = tuple(
    getattr(lp, name)
    for name in ("UnbatchedClassifierFreeGuidanceLogitsProcessor", "ClassifierFreeGuidanceLogitsProcessor")
    if hasattr(lp, name)
)

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

def process_block(
    logits_processor,
    logits: torch.Tensor,  # [active, width, vocab] raw logits, fp32
    fed: torch.Tensor,  # [active, width] tokens fed; fed[:, 0] is each row's last committed token
    widths: torch.Tensor,  # [active] number of real (non-filler) positions per row
    histories: list[torch.Tensor],  # per active row: padded prompt + committed tokens (ends with fed[i, 0])
    rows: torch.Tensor,  # [active] index of each active row in the original batch
    batch_size: int,  # rows of the original batch (what processors were built for)
) -> torch.Tensor:
    """Return processed scores ``[active, width, vocab]``; filler positions are left unprocessed.

    Exact path: positions are grouped by prefix length; each group is one processor call on a
    full-size batch ``[batch_size, length]`` in which every participating row sits at its own index
    (the other rows are placeholders whose output is discarded). Processors thus see exactly the
    batch layout stock generation gives them, batch-indexed state included.
    """
    if not logits_processor:
        return logits
    active, width, vocab = logits.shape
    if all(isinstance(p, PREFIX_INDEPENDENT_PROCESSORS) for p in logits_processor):
        flat = logits.reshape(active * width, vocab)
        dummy = fed.reshape(active * width, 1)
        return logits_processor(dummy, flat).reshape(active, width, vocab)
    out = logits.clone()
    prefixes = [torch.cat([histories[i], fed[i, 1:]]) for i in range(active)]
    groups: dict[int, list[tuple[int, int]]] = {}
    for i in range(active):
        base = histories[i].shape[0]
        for j in range(int(widths[i])):
            groups.setdefault(base + j, []).append((i, j))
    row_ids = rows.tolist()
    for length, members in groups.items():
        i0, j0 = members[0]
        ids = prefixes[i0][:length].expand(batch_size, length).clone()
        scores = logits[i0, j0].expand(batch_size, vocab).clone()
        for i, j in members:
            ids[row_ids[i]] = prefixes[i][:length]
            scores[row_ids[i]] = logits[i, j]
        processed = logits_processor(ids, scores)
        for i, j in members:
            out[i, j] = processed[row_ids[i]]
    return out
