"""CUDA checks (skipped without a GPU; never required by CI).

fp32 on CUDA must be exact like on CPU. In bf16 a one-token forward and an n-token forward round
differently, so near-tied argmaxes can flip (docs/index.md, "Numerics"); bf16 is therefore
reported as an agreement rate and only checked loosely.
"""

from __future__ import annotations

import pytest
import torch
from models import ARCHITECTURES, prompts, tiny_model

import hf_paralleldecode as hfpd

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("block_size", [1, 7, 16, 64])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_cuda_fp32_exact(arch, block_size):
    model = hfpd.enable(tiny_model(arch).cuda())
    ids, mask = prompts(3)
    kwargs = dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=40, do_sample=False)
    ref = model.generate(**kwargs)
    out = model.generate(**kwargs, decoding="jacobi", block_size=block_size)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_cuda_bf16_agreement_rate(arch, record_property):
    model = hfpd.enable(tiny_model(arch).to("cuda", torch.bfloat16))
    ids, mask = prompts(3)
    kwargs = dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=40, do_sample=False,
                  eos_token_id=None)
    ref = model.generate(**kwargs)
    out = model.generate(**kwargs, decoding="jacobi", block_size=16)
    prompt_len = ids.shape[1]
    # agreement up to the first divergence, per row (after a flip the continuations differ anyway)
    agree = (out[:, prompt_len:] == ref[:, prompt_len:]).long().cumprod(-1).float().mean().item()
    record_property("bf16_prefix_agreement", agree)
    assert agree > 0.5


@pytest.mark.parametrize("kind", ["tree_causal", "block_bidirectional"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_fp32_speculative_exact(arch, kind):
    model = hfpd.enable(tiny_model(arch).cuda())
    head = hfpd.DraftHead.for_target(model, attention=kind, num_hidden_layers=1, block_size=4)
    ids, mask = prompts(3)
    kwargs = dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=40, do_sample=False)
    ref = model.generate(**kwargs)
    out = model.generate(**kwargs, decoding="speculative", drafter=head, tree_budget=32)
    assert torch.equal(out, ref)
