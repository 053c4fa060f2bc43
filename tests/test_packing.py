"""Jacobi Forcing packing: schedules, state selection, the visibility table, and one-forward teachers."""

from __future__ import annotations

import pytest
import torch
from models import tiny_model

from hf_paralleldecode.training.packing import (
    additive_mask,
    dense_mask,
    noise_ratio,
    noise_schedule,
    pack_sequence,
    select_states,
)


def test_noise_schedules():
    assert noise_schedule("linear", 4, 6) == [0.0, 0.25, 0.5, 0.75, 0.0, 0.25]
    assert noise_schedule("reverse", 4, 5) == [0.75, 0.5, 0.25, 0.0, 0.75]
    rnd = noise_schedule("random", 4, 50, generator=torch.Generator().manual_seed(0))
    assert set(rnd) <= {0.0, 0.25, 0.5, 0.75} and len(set(rnd)) > 1
    with pytest.raises(ValueError, match="schedule"):
        noise_schedule("cosine", 4, 2)
    with pytest.raises(ValueError, match="window"):
        noise_schedule("linear", 0, 2)


def test_noise_ratio_and_state_selection():
    fixed = [1, 2, 3, 4]
    assert noise_ratio(fixed, fixed) == 0.0
    assert noise_ratio([1, 2, 9, 4], fixed) == 0.5  # the 4 after the first disagreement is still noise
    assert noise_ratio([9, 2, 3, 4], fixed) == 1.0
    states = [[9, 9, 9, 9], [1, 9, 9, 9], [1, 2, 3, 9], [1, 2, 3, 4]]  # ratios 1, .75, .25, 0
    assert select_states(states, fixed, 0.3) == [1, 2, 3, 9]
    assert select_states(states, fixed, 0.5) == [1, 9, 9, 9]  # tie .75/.25 -> earliest
    with pytest.raises(ValueError, match="same non-zero length"):
        noise_ratio([1], fixed)


def test_pack_layout_positions_and_labels():
    seq = pack_sequence([10, 11], [[20, 21], [22, 23]], [[30, 31], [32, 33]])
    assert seq.input_ids.tolist() == [10, 11, 20, 21, 30, 31, 22, 23, 32, 33]
    assert seq.position_ids.tolist() == [0, 1, 2, 3, 2, 3, 4, 5, 4, 5]
    assert seq.noisy_index.tolist() == [2, 3, 6, 7] and seq.clean_index.tolist() == [4, 5, 8, 9]
    assert seq.labels.tolist() == [-100, 30, -100, -100, 31, 32, -100, -100, 33, -100]
    with pytest.raises(ValueError, match="tokens"):
        pack_sequence([1], [[1, 2]], [[1]])


def test_visibility_tables():
    seq = pack_sequence([10, 11], [[20, 21], [22, 23]], [[30, 31], [32, 33]])
    nc = dense_mask(seq, "noise_conditioned")
    sees = lambda m, i: m[i].nonzero().flatten().tolist()  # noqa: E731
    assert sees(nc, 1) == [0, 1]
    assert sees(nc, 3) == [0, 1, 2, 3]  # noisy_0: prompt + own block causally
    assert sees(nc, 5) == [0, 1, 4, 5]  # clean_0: prompt + own block
    assert sees(nc, 6) == [0, 1, 2, 3, 6]  # noisy_1: earlier block at its noise level (noisy_0)
    assert sees(nc, 9) == [0, 1, 4, 5, 8, 9]  # clean_1: the clean prefix
    cllm = dense_mask(seq, "cllm")
    assert sees(cllm, 6) == [0, 1, 4, 5, 6]  # noisy_1 conditioned on the clean prefix
    assert torch.equal(cllm[8], nc[8])
    with pytest.raises(ValueError, match="variant"):
        dense_mask(seq, "bidirectional")


@pytest.mark.parametrize("variant", ["noise_conditioned", "cllm"])
def test_one_forward_gives_teacher_and_student_logits_of_separate_forwards(variant):
    model = tiny_model("qwen2")
    prompt, noisy, clean = [5, 6, 7], [[20, 21, 22], [23, 24, 25]], [[30, 31, 32], [33, 34, 35]]
    seq = pack_sequence(prompt, noisy, clean)
    mask = additive_mask(dense_mask(seq, variant)[None], torch.float32)
    with torch.no_grad():
        packed = model(input_ids=seq.input_ids[None], position_ids=seq.position_ids[None], attention_mask=mask).logits[0]
        clean_run = model(input_ids=torch.tensor([prompt + clean[0] + clean[1]])).logits[0]
        torch.testing.assert_close(packed[seq.clean_index], clean_run[3:], rtol=1e-4, atol=1e-4)
        context = noisy[0] if variant == "noise_conditioned" else clean[0]
        student_run = model(input_ids=torch.tensor([prompt + context + noisy[1]])).logits[0]
        torch.testing.assert_close(packed[seq.noisy_index[3:]], student_run[6:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", ["noise_conditioned", "cllm"])
def test_flex_attention_mask_is_the_same_predicate(variant):
    from torch.nn.attention.flex_attention import create_mask

    from hf_paralleldecode.training.packing import flex_block_mask, flex_mask_mod

    seq = pack_sequence([10, 11, 12], [[20, 21], [22, 23], [24, 25]], [[30, 31], [32, 33], [34, 35]])
    args = (seq.kind[None], seq.block[None], seq.position_ids[None], variant)
    n = seq.input_ids.shape[0]
    dense_from_flex = create_mask(flex_mask_mod(*args), 1, 1, n, n, device="cpu")[0, 0]
    assert torch.equal(dense_from_flex, dense_mask(seq, variant))
    assert flex_block_mask(*args).shape == (1, 1, n, n)
