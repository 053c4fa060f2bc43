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


def test_cuda_decoding_calls_put_cudnn_attention_last_and_restore_torch_order(monkeypatch, record_property):
    """On a GPU where torch tries cuDNN's attention first (Hopper / Blackwell, cuDNN >= 9.15), every attention call
    of a decoding call sees it last, stock generate keeps torch's order, and the order is torch's again afterwards;
    elsewhere, and under attention priority "torch", the order is never touched."""
    from torch.nn.attention import SDPBackend

    model = hfpd.enable(tiny_model("llama").to("cuda", torch.bfloat16))
    ids, mask = prompts(3)
    kwargs = dict(input_ids=ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=12, do_sample=False)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    seen = []

    def spy(*args, **kw):
        seen.append(torch._C._get_sdp_priority_order()[:4])
        return sdpa(*args, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model.generate(**kwargs)  # stock: torch settles its order on its first attention call
    torch_order = torch._C._get_sdp_priority_order()
    stock, seen[:] = list(seen), []
    model.generate(**kwargs, decoding="jacobi", block_size=4)
    decoding, seen[:] = list(seen), []
    with hfpd.attention_priority("torch"):
        model.generate(**kwargs, decoding="jacobi", block_size=4)
    cudnn, flash = int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.FLASH_ATTENTION)
    record_property("torch_sdpa_order", torch_order)
    assert stock and decoding and seen
    assert torch._C._get_sdp_priority_order() == torch_order
    assert all(o == torch_order[:4] for o in stock + seen)
    if torch_order.index(cudnn) < torch_order.index(flash):  # torch tries cuDNN first on this GPU
        assert all(o[-1] == cudnn and o[0] == flash for o in decoding)
    else:
        assert all(o == torch_order[:4] for o in decoding)
