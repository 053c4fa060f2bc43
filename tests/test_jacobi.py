"""Jacobi decoding: exact equivalence with stock greedy generate, and its edges."""

from __future__ import annotations

import pytest
import torch
from models import PAD, ForwardRecorder, RecordingStreamer, enabled, prompts, reference, tiny_model, word_tokenizer
from transformers import StoppingCriteria, StoppingCriteriaList

import hf_paralleldecode as hfpd

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)


def assert_jacobi_matches_greedy(model, block_size, **kwargs):
    """Run stock greedy and Jacobi with the same arguments; assert identical tokens; return Jacobi's."""
    ref = model.generate(**kwargs)
    out = model.generate(**kwargs, decoding="jacobi", block_size=block_size)
    assert torch.equal(out, ref)
    return out


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
@pytest.mark.parametrize("init", ["random_context", "repeat"])
def test_eager_attention_and_inits(arch, init):
    model = enabled(arch, "eager")
    ids, mask = prompts(3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                         decoding="jacobi", block_size=7, jacobi_init=init)
    assert torch.equal(out, reference(arch, 3, 40, "eager"))


def test_custom_generate_on_stock_model_without_enable():
    model = tiny_model("qwen2")
    ids, mask = prompts(3)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                         custom_generate=hfpd.jacobi, block_size=5)
    assert torch.equal(out, ref)


def _eos_in_the_middle(model, ids, mask, position=6):
    """A token the greedy output of row 0 produces at ``position`` (used as EOS)."""
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None)
    token = int(ref[0, ids.shape[1] + position])
    assert token != PAD
    return token


@pytest.mark.parametrize("block_size", [2, 7, 16])
@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_eos_inside_a_block_pads_like_stock(arch, block_size):
    model = enabled(arch)
    ids, mask = prompts(3)
    eos = _eos_in_the_middle(model, ids, mask)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    out = assert_jacobi_matches_greedy(model, block_size, **kwargs)
    assert (out[0, ids.shape[1]:] == eos).any()  # the EOS really is produced mid-generation
    assert out.shape[1] < ids.shape[1] + 30 or (out == PAD).any()  # a row finished early


def test_eos_stops_all_rows_early():
    model = enabled("llama")
    ids, mask = prompts(1)
    eos = _eos_in_the_middle(model, ids, mask, position=3)
    out = model.generate(input_ids=ids, max_new_tokens=30, do_sample=False, eos_token_id=eos,
                         decoding="jacobi", block_size=16, return_dict_in_generate=True)
    ref = model.generate(input_ids=ids, max_new_tokens=30, do_sample=False, eos_token_id=eos)
    assert torch.equal(out.sequences, ref)
    assert out.sequences.shape[1] == ids.shape[1] + 4


@pytest.mark.parametrize(
    "processor_kwargs",
    [
        dict(repetition_penalty=1.3),
        dict(no_repeat_ngram_size=2),
        dict(min_new_tokens=12, eos_token_id=None),
        dict(bad_words_ids=[[5], [7, 8]]),
        dict(suppress_tokens=[3, 4, 9]),
        dict(sequence_bias={(11,): 2.0}),
    ],
    ids=["repetition_penalty", "no_repeat_ngram", "min_new_tokens", "bad_words", "suppress", "sequence_bias"],
)
def test_logits_processors_are_applied_per_position(processor_kwargs):
    model = enabled("llama")
    ids, mask = prompts(3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=25, do_sample=False, **processor_kwargs)
    if kwargs.get("eos_token_id", 0) is None:  # min_new_tokens: make the EOS likely to be suppressed
        kwargs["eos_token_id"] = _eos_in_the_middle(model, ids, mask, position=4)
    assert_jacobi_matches_greedy(model, 6, **kwargs)


def test_scores_and_logits_match_stock_for_unfinished_rows():
    model = enabled("llama")
    ids, mask = prompts(3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                  return_dict_in_generate=True, output_scores=True, output_logits=True, repetition_penalty=1.2)
    ref = model.generate(**kwargs)
    out = model.generate(**kwargs, decoding="jacobi", block_size=5)
    assert torch.equal(out.sequences, ref.sequences)
    assert len(out.scores) == len(ref.scores) == 12
    for a, b in zip(out.scores, ref.scores):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    for a, b in zip(out.logits, ref.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_stopping_criteria_see_the_same_batches_as_stock():
    class Recorder(StoppingCriteria):
        def __init__(self):
            self.seen = []

        def __call__(self, input_ids, scores, **kwargs):
            self.seen.append(input_ids.clone())
            return input_ids[:, -1] == 50  # an arbitrary per-row stop

    model = enabled("qwen3")
    ids, mask = prompts(3)
    rec_ref, rec_out = Recorder(), Recorder()
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                         stopping_criteria=StoppingCriteriaList([rec_ref]))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                         stopping_criteria=StoppingCriteriaList([rec_out]), decoding="jacobi", block_size=8)
    assert torch.equal(out, ref)
    assert len(rec_ref.seen) == len(rec_out.seen)
    assert all(torch.equal(a, b) for a, b in zip(rec_ref.seen, rec_out.seen))


def test_statistics_in_dict_output():
    model = enabled("llama")
    ids, mask = prompts(3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                         decoding="jacobi", block_size=8, return_dict_in_generate=True, eos_token_id=None)
    assert isinstance(out, hfpd.ParallelDecodingOutput)
    assert out.decoding == "jacobi"
    assert out.num_generated_tokens == 3 * 40
    assert 1 <= out.num_forward_passes <= 40
    assert out.tokens_per_forward >= 1.0
    assert out.stats["block_size"] == 8


def test_block_size_one_is_plain_greedy_with_one_token_per_forward():
    model = enabled("llama")
    ids, _ = prompts(1)
    out = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, eos_token_id=None, adaptive=False,
                         decoding="jacobi", block_size=1, return_dict_in_generate=True)  # counts: fixed shapes
    assert out.num_forward_passes == 10 and out.tokens_per_forward == 1.0


def test_prefix_is_never_recomputed():
    model = hfpd.enable(tiny_model("llama"))
    prompt_len, max_new, block = 9, 60, 8
    ids, _ = prompts(1, length=prompt_len)
    rec = ForwardRecorder(model)
    try:
        out = model.generate(input_ids=ids, max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                             decoding="jacobi", block_size=block, adaptive=False, return_dict_in_generate=True)
    finally:
        rec.restore()
    calls = rec.calls
    assert len(calls) == out.num_forward_passes
    assert calls[0]["fed"] == prompt_len and calls[0]["cached"] == 0  # the prompt is fed once
    for before, after in zip(calls[1:], calls[2:] + [None]):
        # each forward feeds only new tokens, placed right after the committed KV ...
        assert before["first_position"] == before["cached"]
        assert 1 <= before["fed"] <= block
        if after is not None:
            # ... and the cache keeps only what was accepted: it grows by 1..fed slots, never re-adds
            grown = after["cached"] - before["cached"]
            assert 1 <= grown <= before["fed"]
            if grown < before["fed"]:  # block not finished: only its unconverged remainder is fed next
                assert after["fed"] <= before["fed"] - grown
    # every committed token's KV was computed exactly once: the final cache holds prompt + generated - 1
    # at most (the last committed token never needs its KV)
    assert calls[-1]["cached"] + calls[-1]["fed"] <= prompt_len + max_new
    assert out.sequences.shape[1] == prompt_len + max_new


def test_streamer_receives_committed_tokens_in_order_and_end_once():
    model = enabled("llama")
    ids, _ = prompts(1)
    rec = RecordingStreamer()
    out = model.generate(input_ids=ids, max_new_tokens=20, do_sample=False, eos_token_id=None,
                         decoding="jacobi", block_size=6, streamer=rec)
    assert rec.ended == 1
    assert torch.equal(rec.values[0], ids)  # the prompt first, as stock generate does
    streamed = torch.cat([v.reshape(-1) for v in rec.values[1:]])
    assert torch.equal(streamed, out[0, ids.shape[1]:])


def test_text_streamer_prints_the_generation(capsys):
    from transformers import TextStreamer

    tokenizer = word_tokenizer()
    model = enabled("llama")
    ids, _ = prompts(1)
    out = model.generate(input_ids=ids, max_new_tokens=10, do_sample=False, eos_token_id=None,
                         decoding="jacobi", block_size=4, streamer=TextStreamer(tokenizer, skip_prompt=True))
    printed = capsys.readouterr().out.split()
    assert printed == tokenizer.convert_ids_to_tokens(out[0, ids.shape[1]:].tolist())


def test_sliding_window_model_within_window_is_exact_and_beyond_is_refused():
    model = hfpd.enable(tiny_model("mistral", sliding_window=64))
    ids, mask = prompts(3)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                         decoding="jacobi", block_size=8)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="sliding_window"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=80, do_sample=False,
                       decoding="jacobi", block_size=8)


def test_rows_that_accept_different_lengths_compact_the_cache(monkeypatch):
    from hf_paralleldecode.engine.cache import SlotCache

    monkeypatch.setattr(SlotCache, "compact_min_holes", 0)  # compact whenever a row has a hole
    monkeypatch.setattr(SlotCache, "compact_ratio", 0.0)
    model = enabled("llama")
    ids, mask = prompts(3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=200, do_sample=False,
                         eos_token_id=None, decoding="jacobi", block_size=16, adaptive=False,
                         return_dict_in_generate=True)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=200, do_sample=False, eos_token_id=None)
    assert torch.equal(out.sequences, ref)
    assert out.stats["cache_compactions"] >= 1


def test_assistant_model_with_decoding_is_refused():
    model = enabled("llama")
    ids, _ = prompts(1)
    with pytest.raises(ValueError, match="assistant"):
        model.generate(input_ids=ids, max_new_tokens=5, decoding="jacobi", assistant_model=model)
    with pytest.raises(ValueError, match="prompt_lookup"):
        model.generate(input_ids=ids, max_new_tokens=5, decoding="jacobi", prompt_lookup_num_tokens=3)


def test_flash_attention_and_static_cache_are_refused_with_the_fix():
    model = hfpd.enable(tiny_model("llama"))
    ids, _ = prompts(1)
    model.config._attn_implementation = "flash_attention_2"  # only the name is read before refusing
    try:
        with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
            model.generate(input_ids=ids, max_new_tokens=5, decoding="jacobi", custom_generate=None)
    finally:
        model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="StaticCache"):
        model.generate(input_ids=ids, max_new_tokens=5, decoding="jacobi", cache_implementation="static")


def test_prefix_constrained_processor_sees_each_rows_batch_index():
    model = enabled("llama")
    ids, mask = prompts(3)

    def allowed(batch_id, sent):  # a different vocabulary slice per row
        return list(range(10 + 20 * batch_id, 30 + 20 * batch_id))

    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=15, do_sample=False, eos_token_id=None,
                  prefix_allowed_tokens_fn=allowed)
    assert_jacobi_matches_greedy(model, 5, **kwargs)


def test_random_context_init_is_seeded_and_drawn_from_context():
    from hf_paralleldecode.engine.run import DecodeRun

    model = enabled("llama")
    ids, mask = prompts(3)
    # The batch policy picks step shapes from measured times, so the forward count is reproducible only with
    # fixed shapes (adaptive=False); the seed makes the context draws themselves reproducible either way.
    a = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, adaptive=False,
                       decoding="jacobi", block_size=8, return_dict_in_generate=True, jacobi_seed=3)
    b = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False, adaptive=False,
                       decoding="jacobi", block_size=8, return_dict_in_generate=True, jacobi_seed=3)
    assert a.num_forward_passes == b.num_forward_passes
    assert torch.equal(a.sequences, b.sequences)

    captured = {}
    orig = DecodeRun.sample_context_lists

    def spy(self, k, generator):
        out = orig(self, k, generator)
        captured.setdefault("draws", []).append((list(self.row_ids), [list(d) for d in out]))
        return out

    DecodeRun.sample_context_lists = spy
    try:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                       decoding="jacobi", block_size=8)
    finally:
        DecodeRun.sample_context_lists = orig
    rows, first_draw = captured["draws"][0]
    first_generated = reference("llama", 3, 40)[:, ids.shape[1]]
    for i, row in enumerate(rows):
        allowed = set(ids[row][mask[row] == 1].tolist()) | {int(first_generated[row])}
        assert set(first_draw[i]) <= allowed  # drawn from the row's context, never padding


def test_right_padding_and_explicit_position_ids_follow_stock_positions():
    model = enabled("llama")
    ids, _ = prompts(3)
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding (stock warns, but still generates)
    mask[2, -1:] = 0
    assert_jacobi_matches_greedy(model, 4, input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    one, _ = prompts(1)
    assert_jacobi_matches_greedy(model, 4, input_ids=one, position_ids=torch.arange(7)[None] + 5,
                                 max_new_tokens=10, do_sample=False)


def test_processors_that_run_the_model_are_refused():
    model = enabled("llama")
    ids, _ = prompts(1)
    with pytest.raises(ValueError, match="guidance"):
        model.generate(input_ids=ids, max_new_tokens=5, decoding="jacobi", guidance_scale=1.5)


def test_direct_call_with_no_room_returns_the_prompt():
    from transformers import GenerationConfig, StoppingCriteriaList
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    model = tiny_model("llama")
    ids, _ = prompts(1)
    config = GenerationConfig(max_length=ids.shape[1], pad_token_id=PAD, do_sample=False)
    config._pad_token_tensor, config._eos_token_tensor = torch.tensor(PAD), None
    out = hfpd.jacobi(model, ids, logits_processor=None, stopping_criteria=StoppingCriteriaList(
        [MaxLengthCriteria(ids.shape[1])]), generation_config=config, block_size=4)
    assert torch.equal(out, ids)


def test_stateful_watermark_processor_is_refused():
    from transformers import SynthIDTextWatermarkingConfig

    model = enabled("llama")
    ids, _ = prompts(1)
    config = SynthIDTextWatermarkingConfig(keys=[1, 2, 3, 4], ngram_len=3)
    with pytest.raises(ValueError, match="SynthID"):
        model.generate(input_ids=ids, max_new_tokens=5, decoding="jacobi", watermarking_config=config)


def test_stopping_criteria_receive_the_scores_tuple_like_stock():
    seen = {}

    class Capture(StoppingCriteria):
        def __init__(self, key):
            self.key = key

        def __call__(self, input_ids, scores, **kwargs):
            seen.setdefault(self.key, []).append(None if scores is None else (type(scores), len(scores)))
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    model = enabled("llama")
    ids, _ = prompts(1)
    for key, extra in (("ref", {}), ("ours", dict(decoding="jacobi", block_size=4))):
        model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, eos_token_id=None,
                       return_dict_in_generate=True, output_scores=True,
                       stopping_criteria=StoppingCriteriaList([Capture(key)]), **extra)
    assert seen["ours"] == seen["ref"]
