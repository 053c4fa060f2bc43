"""Losses of consistency distillation (CLLM) and progressive consistency (Jacobi Forcing), as pure functions.

Notation: ``p`` is the teacher (target) distribution, ``q`` the student's. Teachers are always
detached (stop-gradient, ``theta^-`` in the CLLM paper). Every loss takes a boolean ``mask`` of the
positions that count (padding, prompt and ignored labels are False) and reduces as

* ``sum over counted positions / num_items_in_batch`` when ``num_items_in_batch`` is given (what
  ``transformers.Trainer`` passes, so gradient accumulation stays exact), else
* the mean over counted positions (0 when nothing counts).

Shapes: logits ``[..., vocab]``; ``mask`` is the logits' shape without ``vocab``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["DISTANCES", "DISTILLATION_OBJECTIVES", "divergence", "consistency_loss", "progressive_consistency_loss",
           "ar_loss", "position_weights", "draft_distillation_loss"]

DISTANCES = ("forward_kl", "reverse_kl", "jsd")


def _reduce(per_position: torch.Tensor, mask: torch.Tensor, num_items_in_batch) -> torch.Tensor:
    total = (per_position * mask).sum()
    if num_items_in_batch is not None:
        return total / num_items_in_batch
    return total / mask.sum().clamp(min=1)


def divergence(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    distance: str = "forward_kl",
    beta: float = 0.5,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-position divergence between teacher ``p`` and student ``q`` (summed over the vocabulary).

    * ``"forward_kl"``: KL(p || q) (mode-covering; CLLM's choice),
    * ``"reverse_kl"``: KL(q || p) (mode-seeking),
    * ``"jsd"``: generalised Jensen-Shannon, ``beta * KL(p || m) + (1 - beta) * KL(q || m)`` with
      ``m = beta * p + (1 - beta) * q``, ``beta`` in (0, 1) (0.5 = the symmetric JSD).
    """
    if distance not in DISTANCES:
        raise ValueError(f"distance must be one of {DISTANCES}, got {distance!r}.")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}.")
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    log_p = F.log_softmax(teacher_logits.detach().float() / temperature, dim=-1)
    if distance == "forward_kl":
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if distance == "reverse_kl":
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    if not 0.0 < beta < 1.0:
        raise ValueError(f"beta must be in (0, 1) for the generalised JSD, got {beta}.")
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0)
    kl_pm = (log_p.exp() * (log_p - log_m)).sum(-1)
    kl_qm = (log_q.exp() * (log_q - log_m)).sum(-1)
    return beta * kl_pm + (1 - beta) * kl_qm


def consistency_loss(
    student_logits: torch.Tensor,  # [batch, n, vocab] on a noisy Jacobi state y (global) or y^(j) (local)
    teacher_logits: torch.Tensor,  # [batch, n, vocab] on the fixed point y* (global) or y^(j+1) (local)
    mask: torch.Tensor,  # [batch, n] positions that count
    distance: str = "forward_kl",
    beta: float = 0.5,
    num_items_in_batch=None,
) -> torch.Tensor:
    """CLLM consistency loss: drive the prediction on a noisy state to the teacher state's prediction.

    Global consistency (GC) uses the fixed point's logits as teacher, local consistency (LC) the
    next state's; both are this function, the caller picks the pair.
    """
    return _reduce(divergence(student_logits, teacher_logits, distance, beta), mask, num_items_in_batch)


def progressive_consistency_loss(
    logits: torch.Tensor,  # [batch, seq, vocab] one forward over a packed noisy/clean sequence
    noisy_index: torch.Tensor,  # [batch, k] positions of noisy-block tokens (students)
    clean_index: torch.Tensor,  # [batch, k] matching positions of their clean blocks (teachers)
    mask: torch.Tensor,  # [batch, k] which pairs count
    distance: str = "forward_kl",
    beta: float = 0.5,
    num_items_in_batch=None,
) -> torch.Tensor:
    """Jacobi Forcing L_pc: each noisy block's predictions follow its clean block's, from ONE forward.

    The packed sequence holds noisy blocks and their fixed points with shared position ids; the
    noise-conditioned mask makes the clean block's logits the AR teacher for that block.
    """
    vocab = logits.shape[-1]
    student = logits.gather(1, noisy_index[..., None].expand(-1, -1, vocab))
    teacher = logits.gather(1, clean_index[..., None].expand(-1, -1, vocab))
    return consistency_loss(student, teacher, mask, distance, beta, num_items_in_batch)


def ar_loss(
    logits: torch.Tensor,  # [batch, seq, vocab]
    labels: torch.Tensor,  # [batch, seq] next-token labels aligned with logits (already shifted)
    ignore_index: int = -100,
    num_items_in_batch=None,
) -> torch.Tensor:
    """Cross-entropy on the base model's greedy output (``labels == ignore_index`` positions skipped)."""
    mask = labels != ignore_index
    nll = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.clamp(min=0).reshape(-1), reduction="none"
    ).reshape(labels.shape)
    return _reduce(nll, mask, num_items_in_batch)


DISTILLATION_OBJECTIVES = ("forward_kl", "reverse_kl", "sft")


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """Weights ``w_m`` of draft depths ``m = 1 .. block_size``: ``exp(-(m - 1) / gamma)``, or 1 (``gamma=None``).

    DFlash decays with ``gamma = 7`` for a 16-token block; JetSpec's causal head uses uniform weights.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}.")
    depth = torch.arange(block_size, dtype=torch.float32)
    if gamma is None:
        return torch.ones(block_size)
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0 (or None for uniform weights), got {gamma}.")
    return torch.exp(-depth / gamma)


def draft_distillation_loss(
    student_logits: torch.Tensor,  # [..., vocab] the head's logits at the drafted positions
    teacher_logits: torch.Tensor,  # [..., vocab] the target's logits predicting the same tokens
    weights: torch.Tensor,  # [...] w_m of each position (0 where it does not count)
    objective: str = "forward_kl",
    temperature: float = 1.0,
    labels: torch.Tensor | None = None,  # [...] hard labels for "sft" (default: the teacher's argmax)
    num_items_in_batch=None,  # the sum of weights over the optimizer step (gradient accumulation)
) -> torch.Tensor:
    """Draft-head distillation, JetSpec Eq. 11-14: ``T^2 * sum_m w_m L^(m) / sum_m w_m``.

    * ``"forward_kl"``: ``L^(m) = KL(p~ || q~)`` of the temperature-``T`` softened distributions,
      with the ``T^2`` prefactor so gradients keep their scale across temperatures (default);
    * ``"reverse_kl"``: ``KL(q~ || p~)``, same prefactor (mode-seeking; the JetSpec paper's ablation);
    * ``"sft"``: cross-entropy on hard labels (``labels``, or the teacher's argmax), no temperature.

    Normalised by ``num_items_in_batch`` (the step's total weight) when given, else by this
    batch's total weight, so gradient accumulation is exact.
    """
    if objective not in DISTILLATION_OBJECTIVES:
        raise ValueError(f"objective must be one of {DISTILLATION_OBJECTIVES}, got {objective!r}.")
    weights = weights.float()
    if objective == "sft":
        if labels is None:
            labels = teacher_logits.detach().argmax(-1)
        per = F.cross_entropy(student_logits.float().reshape(-1, student_logits.shape[-1]), labels.reshape(-1),
                              reduction="none").reshape(labels.shape)
        scale = 1.0
    else:
        per = divergence(student_logits, teacher_logits, objective, temperature=temperature)
        scale = temperature**2
    total = (per * weights).sum()
    denom = num_items_in_batch if num_items_in_batch is not None else weights.sum().clamp(min=1e-12)
    return scale * total / denom


def diffusion_alignment_loss(
    student_logits: torch.Tensor,  # [..., vocab] the drafter's logits at the masked positions
    labels: torch.Tensor,  # [...] the tokens behind the masks (the AR target's own answer)
    weights: torch.Tensor,  # [...] w_i of each masked position (0 where it does not count)
    teacher_logits: torch.Tensor | None = None,  # [..., vocab] the target's logits there (KL objectives)
    objective: str = "sft",
    temperature: float = 1.0,
    num_items_in_batch=None,  # the sum of weights over the optimizer step (gradient accumulation)
) -> torch.Tensor:
    """DEER's diffusion-to-AR alignment objective: ``sum_i w_i l_i / sum_i w_i`` over the masked positions.

    ``l_i`` is the cross-entropy of the masked token (``"sft"``: stage I reconstructs the masked
    continuation with ``w_i = 1``, stage II weighs the ``R`` tokens after the prefix with
    ``w_i = exp(-(i - 1) / gamma)``), or ``T^2`` times a KL to the target's softened distribution
    (``"forward_kl"`` / ``"reverse_kl"``, which need ``teacher_logits``). Normalised by
    ``num_items_in_batch`` when given (the step's total weight), else by this batch's total weight.
    """
    if objective not in DISTILLATION_OBJECTIVES:
        raise ValueError(f"objective must be one of {DISTILLATION_OBJECTIVES}, got {objective!r}.")
    if objective != "sft" and teacher_logits is None:
        raise ValueError(f"objective={objective!r} needs teacher_logits (the target's logits at the masked positions).")
    return draft_distillation_loss(student_logits, teacher_logits, weights, objective, temperature, labels=labels,
                                   num_items_in_batch=num_items_in_batch)
