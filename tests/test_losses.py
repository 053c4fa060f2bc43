"""Losses against closed forms."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hf_paralleldecode.training.losses import (
    ar_loss,
    consistency_loss,
    divergence,
    progressive_consistency_loss,
)


def test_identical_distributions_give_zero_for_every_distance():
    logits = torch.randn(2, 3, 7)
    for distance in ("forward_kl", "reverse_kl", "jsd"):
        torch.testing.assert_close(divergence(logits, logits, distance), torch.zeros(2, 3), atol=1e-6, rtol=0)


def test_kl_closed_forms():
    p = torch.tensor([0.5, 0.25, 0.25])
    q = torch.tensor([0.25, 0.25, 0.5])
    forward = (p * (p / q).log()).sum()
    reverse = (q * (q / p).log()).sum()
    torch.testing.assert_close(divergence(q.log(), p.log(), "forward_kl"), forward)
    torch.testing.assert_close(divergence(q.log(), p.log(), "reverse_kl"), reverse)
    m = 0.5 * (p + q)
    jsd = 0.5 * (p * (p / m).log()).sum() + 0.5 * (q * (q / m).log()).sum()
    torch.testing.assert_close(divergence(q.log(), p.log(), "jsd", beta=0.5), jsd)


def test_jsd_is_symmetric_and_bounded_by_log2():
    a, b = torch.randn(5, 11) * 4, torch.randn(5, 11) * 4
    torch.testing.assert_close(divergence(a, b, "jsd"), divergence(b, a, "jsd"))
    disjoint_p = torch.tensor([[0.0, -1e4]])
    disjoint_q = torch.tensor([[-1e4, 0.0]])
    torch.testing.assert_close(divergence(disjoint_q, disjoint_p, "jsd"), torch.tensor([math.log(2)]))


def test_teacher_gets_no_gradient_and_student_does():
    student = torch.randn(2, 4, 5, requires_grad=True)
    teacher = torch.randn(2, 4, 5, requires_grad=True)
    consistency_loss(student, teacher, torch.ones(2, 4, dtype=torch.bool)).backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    assert teacher.grad is None


def test_masking_and_num_items_in_batch():
    student, teacher = torch.randn(2, 4, 5), torch.randn(2, 4, 5)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    per = divergence(student, teacher)
    torch.testing.assert_close(consistency_loss(student, teacher, mask), per[mask].mean())
    torch.testing.assert_close(consistency_loss(student, teacher, mask, num_items_in_batch=10), per[mask].sum() / 10)
    assert consistency_loss(student, teacher, torch.zeros_like(mask)) == 0


def test_gradient_accumulation_with_num_items_matches_one_big_batch():
    student, teacher = torch.randn(4, 3, 6), torch.randn(4, 3, 6)
    mask = torch.rand(4, 3) > 0.3
    full = consistency_loss(student, teacher, mask)
    n = int(mask.sum())
    parts = sum(consistency_loss(student[i : i + 2], teacher[i : i + 2], mask[i : i + 2], num_items_in_batch=n)
                for i in (0, 2))
    torch.testing.assert_close(parts, full)


def test_progressive_consistency_gathers_noisy_and_clean_positions():
    logits = torch.randn(1, 10, 6)
    noisy, clean = torch.tensor([[2, 3, 4]]), torch.tensor([[5, 6, 7]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    expected = divergence(logits[:, 2:5], logits[:, 5:8]).mean()
    torch.testing.assert_close(progressive_consistency_loss(logits, noisy, clean, mask), expected)
    same = progressive_consistency_loss(logits, noisy, noisy, mask)
    assert same.abs() < 1e-6


def test_ar_loss_is_cross_entropy_with_ignore_index():
    logits, labels = torch.randn(2, 5, 9), torch.randint(0, 9, (2, 5))
    labels[0, :2] = -100
    expected = F.cross_entropy(logits.reshape(-1, 9), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(ar_loss(logits, labels), expected)
    uniform = ar_loss(torch.zeros(1, 3, 9), torch.tensor([[1, 2, 3]]))
    torch.testing.assert_close(uniform, torch.tensor(math.log(9)))


@pytest.mark.parametrize("kwargs, match", [(dict(distance="kl"), "distance"), (dict(distance="jsd", beta=0.0), "beta"),
                                           (dict(temperature=0.0), "temperature")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        divergence(torch.zeros(1, 3), torch.zeros(1, 3), **kwargs)


def test_position_weights_decay_and_uniform():
    from hf_paralleldecode.training.losses import position_weights

    w = position_weights(4, gamma=7.0)
    torch.testing.assert_close(w, torch.exp(-torch.arange(4.0) / 7.0))
    assert torch.equal(position_weights(3), torch.ones(3))
    with pytest.raises(ValueError, match="gamma"):
        position_weights(3, gamma=0.0)


def test_draft_distillation_loss_closed_forms():
    from hf_paralleldecode.training.losses import draft_distillation_loss

    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(2, 3, 11, generator=g)
    w = torch.tensor([[1.0, 0.5, 0.0], [1.0, 0.25, 0.125]])
    # a perfect student: both KLs vanish, at any temperature
    for objective in ("forward_kl", "reverse_kl"):
        assert draft_distillation_loss(teacher.clone(), teacher, w, objective, temperature=2.0).abs() < 1e-6
    student = torch.randn(2, 3, 11, generator=g)
    T = 2.0
    p, q = torch.softmax(teacher / T, -1), torch.softmax(student / T, -1)
    fkl = (p * (p.log() - q.log())).sum(-1)
    expected = T**2 * (fkl * w).sum() / w.sum()
    torch.testing.assert_close(draft_distillation_loss(student, teacher, w, "forward_kl", T), expected)
    rkl = (q * (q.log() - p.log())).sum(-1)
    torch.testing.assert_close(draft_distillation_loss(student, teacher, w, "reverse_kl", T), T**2 * (rkl * w).sum() / w.sum())
    # sft: weighted cross-entropy on the teacher's argmax
    ce = torch.nn.functional.cross_entropy(student.reshape(-1, 11), teacher.argmax(-1).reshape(-1), reduction="none")
    torch.testing.assert_close(draft_distillation_loss(student, teacher, w, "sft"), (ce.reshape(2, 3) * w).sum() / w.sum())
    # gradient accumulation: two halves normalised by the step's total weight add up to the whole
    whole = draft_distillation_loss(student, teacher, w, "forward_kl", T)
    halves = sum(draft_distillation_loss(student[i : i + 1], teacher[i : i + 1], w[i : i + 1], "forward_kl", T,
                                         num_items_in_batch=w.sum()) for i in range(2))
    torch.testing.assert_close(halves, whole)
    with pytest.raises(ValueError, match="objective"):
        draft_distillation_loss(student, teacher, w, "jsd")
