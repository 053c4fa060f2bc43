"""Apply the user's ``LogitsProcessorList`` to many positions of one forward, exactly as stock sampling would.

What it is for
    A verifier scores ``width`` positions per row in one forward. Stock generation would have
    called each processor once per token with that row's ids so far (padded prompt + generated
    tokens). :func:`process_block` reproduces that: position ``j`` of row ``b`` is processed with
    the row's own prefix: its history plus the tokens on the path from the tree's root to ``j``.

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

from ..compat import logits_process as lp

__all__ = ["process_block", "process_prefixes", "prefix_independent", "PREFIX_INDEPENDENT_PROCESSORS",
           "ONE_CALL_PER_TOKEN_PROCESSORS"]

# Processors that assume exactly one call per generated token, in order (they run the model
# themselves, or keep state across calls): refused by every strategy, with the reason.
ONE_CALL_PER_TOKEN_PROCESSORS: dict[str, str] = {
    "UnbatchedClassifierFreeGuidanceLogitsProcessor": "guidance_scale / classifier-free guidance runs the model",
    "ClassifierFreeGuidanceLogitsProcessor": "guidance_scale / classifier-free guidance runs the model",
    "SynthIDTextWatermarkLogitsProcessor": "SynthID watermarking keeps state",
}

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
    logits: torch.Tensor,  # [active, nodes, vocab] raw logits, fp32
    tree,  # PackedTree that was fed (node 0 = each row's last committed token)
    histories: list[torch.Tensor],  # per active row: padded prompt + committed tokens (ends with the root)
    rows: torch.Tensor,  # [active] index of each active row in the original batch
    batch_size: int,  # rows of the original batch (what processors were built for)
    placeholder,  # (row, length) -> that row's own prefix of that length, for the rows not in a call
) -> torch.Tensor:
    """Return processed scores ``[active, nodes, vocab]``; filler nodes are left unprocessed.

    Node ``j`` of row ``i`` is processed with the prefix ``histories[i]`` + the tokens on the path
    from the root down to ``j``. Exact path: nodes are grouped by prefix length; each group is one
    processor call on a full-size batch ``[batch_size, length]`` in which every participating row
    sits at its own index (the other rows are placeholders whose output is discarded), so
    processors see exactly the layout stock generation gives them, batch-indexed state included.
    (see :func:`process_prefixes`).
    """
    if not logits_processor:
        return logits
    active, width, vocab = logits.shape
    if prefix_independent(logits_processor):
        flat = logits.reshape(active * width, vocab)
        return logits_processor(tree.tokens.reshape(active * width, 1), flat).reshape(active, width, vocab)
    num_nodes = tree.num_nodes.tolist()
    index, prefixes, owners = [], [], []
    row_ids = rows.tolist()
    for i in range(active):
        for j in range(num_nodes[i]):
            if tree.is_chain:
                suffix = tree.tokens[i, 1 : j + 1]
            else:
                suffix = torch.tensor(tree.path_tokens(i, j), dtype=torch.long, device=logits.device)
            index.append((i, j))
            prefixes.append(torch.cat([histories[i], suffix]))
            owners.append(row_ids[i])
    out = logits.clone()
    if index:
        ii = torch.tensor([a for a, _ in index], device=logits.device)
        jj = torch.tensor([b for _, b in index], device=logits.device)
        out[ii, jj] = process_prefixes(logits_processor, logits[ii, jj], prefixes, owners, batch_size, placeholder)
    return out


def prefix_independent(logits_processor) -> bool:
    """True when every processor scores from the logits alone (one flattened call is exact)."""
    return all(isinstance(p, PREFIX_INDEPENDENT_PROCESSORS) for p in logits_processor)


def process_prefixes(
    logits_processor,
    logits: torch.Tensor,  # [n, vocab] raw logits of n positions
    prefixes: list[torch.Tensor],  # per position: the ids stock generation would pass (padded prompt + tokens)
    rows: list[int],  # per position: its row in the original batch
    batch_size: int,  # rows of the original batch (what processors were built for)
    placeholder,  # (row, length) -> that row's own prefix of that length (see below)
) -> torch.Tensor:
    """Processed ``[n, vocab]``: each position as stock would score it, given its own prefix.

    Positions are grouped by prefix length; each group is one processor call on a full-size batch
    ``[batch_size, length]`` in which every participating row sits at its own index (the other
    rows are placeholders whose output is discarded), so processors see exactly the layout stock
    generation gives them, batch-indexed state included. A placeholder row carries
    ``placeholder(row, length)``, its own prefix (a processor such as ``prefix_allowed_tokens_fn``
    may refuse another row's). Two positions of one row
    with the same prefix length go to separate calls.
    """
    if not logits_processor:
        return logits
    if prefix_independent(logits_processor):
        return logits_processor(torch.zeros(logits.shape[0], 1, dtype=torch.long, device=logits.device), logits)
    vocab = logits.shape[-1]
    out = logits.clone()
    calls: list[dict[int, int]] = []  # per call: original row -> position
    by_length: dict[int, list[int]] = {}  # prefix length -> indices into calls
    for k, (prefix, row) in enumerate(zip(prefixes, rows)):
        slot = next((c for c in by_length.get(prefix.shape[0], []) if row not in calls[c]), None)
        if slot is None:
            slot = len(calls)
            calls.append({})
            by_length.setdefault(prefix.shape[0], []).append(slot)
        calls[slot][row] = k
    for call in calls:
        k0 = next(iter(call.values()))
        length = prefixes[k0].shape[0]
        ids = torch.stack([prefixes[call[r]] if r in call else placeholder(r, length) for r in range(batch_size)])
        scores = logits[k0].expand(batch_size, vocab).clone()
        for row, k in call.items():
            ids[row] = prefixes[k]
            scores[row] = logits[k]
        processed = logits_processor(ids, scores)
        for row, k in call.items():
            out[k] = processed[row]
    return out
