"""Greedy steps take the target's argmax without [active, nodes, vocab] logits (TargetForward.greedy)."""

from __future__ import annotations

import pytest
import torch
import transformers
from models import _COMMON, _LLAMA_LIKE, enabled, prompts, reference

import hf_paralleldecode as hfpd
from hf_paralleldecode.engine.target import GreedyHead

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)

STRATEGIES = [
    dict(decoding="jacobi", block_size=8),
    dict(decoding="jacobi_forcing", block_size=8, num_blocks=2, pool_size=4),
    dict(decoding="lookahead"),
    dict(decoding="prompt_lookup"),
]


def _lm_head_rows(model):
    """Positions fed to the model's LM head per call, recorded by a forward hook."""
    rows = []
    handle = model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0]))
    return rows, handle


@pytest.mark.parametrize("settings", STRATEGIES, ids=lambda s: s["decoding"])
@pytest.mark.parametrize("batch", [1, 3])
def test_chunked_argmax_matches_stock_and_never_builds_every_nodes_logits(monkeypatch, batch, settings):
    """Greedy steps whose logits span more than two chunks apply the head chunk by chunk, never to every node."""
    model = enabled("llama")
    vocab = model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(GreedyHead, "_chunk_bytes", lambda self, device: 3 * vocab * 4)  # 3 positions per chunk
    ids, mask = prompts(batch)
    rows, handle = _lm_head_rows(model)
    try:
        # the configured tree every step (adaptive=False): the chunked path must run
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                             return_dict_in_generate=True, adaptive=False, **settings)
        head = GreedyHead.of(model)  # the head of the structure the call ran with (the recording hook is part of it)
    finally:
        handle.remove()
    torch.testing.assert_close(out.sequences, reference("llama", batch, 24), rtol=0, atol=0)
    assert head is not None and head.checked
    # the prefill feeds one position per row; the model's first greedy step (the check) feeds every node twice
    # (its forward, the check); every other head call is a chunk of <= 3 positions, the forward's empty one, or
    # a step of at most two chunks' positions, which keeps the plain forward (worth_it)
    assert sum(r > 6 for r in rows) <= 2
    if settings["decoding"] != "prompt_lookup":  # trees of 9+ nodes per step: the chunked path ran
        assert 0 in rows and rows.count(3) >= 3


class NegatedLogitsLlama(transformers.LlamaForCausalLM):
    """A model whose logits are not lm_head(hidden): the greedy head must not be used for it."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, use_cache=None,
                logits_to_keep=0, **kwargs):  # the cache arrives in kwargs, under whatever name this release uses
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              inputs_embeds=inputs_embeds, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
        out.logits = -out.logits
        return out


@pytest.mark.parametrize("settings", STRATEGIES[:3], ids=lambda s: s["decoding"])
def test_a_model_whose_logits_are_not_its_heads_output_keeps_the_plain_argmax(settings):
    torch.manual_seed(0)
    model = hfpd.enable(NegatedLogitsLlama(transformers.LlamaConfig(**{**_COMMON, **_LLAMA_LIKE})).eval())
    ids, mask = prompts(3)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, decoding="stock")
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, **settings)
    assert torch.equal(out, ref)
    assert GreedyHead.of(model) is None  # refused on its first step, for good


def test_values_that_need_the_logits_keep_the_full_forward():
    """Processors, output_scores and sampling read the values: no greedy head there."""
    model = enabled("qwen2")
    ids, mask = prompts(2)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    for extra in (dict(repetition_penalty=1.2), dict(output_scores=True, return_dict_in_generate=True)):
        rows, handle = _lm_head_rows(model)
        try:
            out = model.generate(**gen, decoding="jacobi", block_size=6, **extra)
        finally:
            handle.remove()
        ref = model.generate(**gen, decoding="stock", **extra)
        if isinstance(out, torch.Tensor):
            assert torch.equal(out, ref)
        else:
            assert torch.equal(out.sequences, ref.sequences) and len(out.scores) == len(ref.scores)
        assert 0 not in rows  # every forward computed its logits


@pytest.mark.parametrize("vocab", [97, 256, 8192, 8193, 50257])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_argmax_equals_argmax_with_ties_and_nans(vocab, dtype):
    from hf_paralleldecode.engine.verify import greedy_argmax

    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(3, 5, vocab, generator=g).to(dtype)
    x[0, 0, 7] = x[0, 0, vocab - 1] = 50.0  # a tie across blocks and the tail: the first wins
    x[0, 1, 64] = x[0, 1, 65] = 50.0  # a tie inside a block
    x[1, 2, vocab // 2] = float("nan")  # a NaN counts as the maximum
    x[1, 3, vocab - 1] = float("nan")  # in the tail
    x[1, 4, 3] = x[1, 4, vocab - 2] = float("nan")  # two: the first
    x[2, 0] = -float("inf")
    x[2, 0, vocab - 1] = 0.0
    x[2, 1] = 1.0  # all equal: index 0
    assert torch.equal(greedy_argmax(x), x.argmax(-1))
    assert greedy_argmax(x[0, 0]).shape == ()


def test_the_greedy_heads_time_counts_as_model_time_in_stats_and_bench(monkeypatch):
    from hf_paralleldecode.bench import StrategySpec

    model = enabled("llama")
    vocab = model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(GreedyHead, "_chunk_bytes", lambda self, device: 3 * vocab * 4)  # the chunked path runs
    ids, mask = prompts(3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, decoding="jacobi",
                         block_size=8, adaptive=False, return_dict_in_generate=True)
    assert 0 < out.stats["greedy_head_seconds"] < out.stats["model_seconds"] < out.stats["wall_seconds"]

    from hf_paralleldecode.bench import _ForwardTimer, _one_run

    timer = _ForwardTimer(model)
    try:
        run = _one_run(model, dict(input_ids=ids, attention_mask=mask), StrategySpec("jacobi", {"block_size": 8, "adaptive": False}), 16,
                       timer)
        hooked = timer.seconds  # the model's own forward calls only
    finally:
        timer.remove()
    assert run["forward_seconds"] > hooked and run["forward_seconds"] < run["seconds"]


def test_small_steps_keep_the_plain_forward_and_chunks_cover_the_heads_weight():
    model = enabled("llama")
    head = GreedyHead.of(model)
    weight = head.lm_head.weight
    chunk = head._chunk_bytes(weight.device)
    assert chunk >= weight.numel() * weight.element_size() and chunk >= GreedyHead.CHUNK_BYTES["cpu"]
    per_position = weight.shape[0] * weight.element_size()
    assert not head.worth_it(2 * chunk // per_position) and head.worth_it(2 * chunk // per_position + 1)
