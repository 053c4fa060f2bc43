"""Issue classes: what ``generate`` does not hand a custom decoding, generation modes, models that cannot
take a custom 4D mask / explicit positions, and checkpoint defaults stepping aside for all of them.

The full audit of every ``generate`` argument and generation-config field is in docs/generate-arguments.md.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from models import BOS, EOS, PAD, enabled, prompts, tiny_model

import hf_paralleldecode as hfpd
from hf_paralleldecode.compat import GENERATE_CACHE_KEY
from hf_paralleldecode.loading import default_model_path, load_tokenizer

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)

STRATEGIES = {"jacobi": dict(block_size=4), "jacobi_forcing": dict(block_size=4), "lookahead": dict()}


@pytest.mark.parametrize("decoding", list(STRATEGIES))
@pytest.mark.parametrize("source", ["kwarg", "generation_config"])
def test_stop_strings_with_tokenizer_stop_like_stock(decoding, source):
    model = enabled("llama")
    tok = load_tokenizer(default_model_path())  # byte-level BPE: stop strings match inside tokens too
    ids, mask = prompts(3)
    free = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None,
                          decoding="stock")
    stop = tok.decode(free[0, ids.shape[1] + 4 : ids.shape[1] + 6])  # two words row 0 really produces
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, tokenizer=tok)
    if source == "kwarg":
        kwargs["stop_strings"] = [stop]
    else:
        kwargs["generation_config"] = transformers.GenerationConfig(stop_strings=[stop], pad_token_id=PAD,
                                                                    eos_token_id=EOS, bos_token_id=BOS)
    ref = model.generate(**kwargs, decoding="stock")
    assert ref.shape[1] < ids.shape[1] + 20 or (ref[0] == PAD).any()  # the stop string really stopped row 0
    assert torch.equal(model.generate(**kwargs, decoding=decoding, **STRATEGIES[decoding]), ref)


def test_stop_strings_without_tokenizer_is_a_clear_error():
    with pytest.raises(ValueError, match="tokenizer"):
        enabled("llama").generate(input_ids=torch.tensor([[5, 6]]), max_new_tokens=4, stop_strings=["t7"],
                                  decoding="jacobi")


REFUSED_CALLS = {
    "dola": (dict(dola_layers="high"), "dola"),
    "constrained": (dict(force_words_ids=[[7]]), "constrained"),
    "contrastive": (dict(penalty_alpha=0.6, top_k=4), "contrastive"),
    "assistant_early_exit": (dict(assistant_early_exit=1), "assisted"),
    "paged_cache": (dict(cache_implementation="paged"), "paged"),
    "static_cache": (dict(cache_implementation="static"), "static"),
    "prefill_chunks": (dict(prefill_chunk_size=2), "prefill_chunk_size"),
    "token_healing": (dict(token_healing=True), "token_healing"),
    "guidance": (dict(guidance_scale=1.5), "guidance"),
    "offloaded_cache": ({GENERATE_CACHE_KEY: transformers.DynamicCache(offloading=True)}, "offloaded"),
}


@pytest.mark.parametrize("case", list(REFUSED_CALLS))
def test_calls_a_strategy_cannot_serve_are_refused_before_any_forward(case):
    model = enabled("llama")
    call, match = REFUSED_CALLS[case]
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=match):
            model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=4, decoding="jacobi", **call)
    finally:
        hook.remove()
    assert not calls


@pytest.mark.parametrize("case", [*REFUSED_CALLS, "stop_strings", "alibi_model"])
def test_checkpoint_defaults_step_aside_where_stock_serves_the_call(case, caplog, monkeypatch):
    model = hfpd.enable(tiny_model("bloom") if case == "alibi_model" else tiny_model("llama"))
    model.parallel_decoding_config = hfpd.ParallelDecodingConfig("jacobi", {"block_size": 4})
    call = {"stop_strings": ["e"], "tokenizer": load_tokenizer(default_model_path())} if case == "stop_strings" else \
        {} if case == "alibi_model" else REFUSED_CALLS[case][0]
    ids = torch.tensor([[5, 6, 7]])
    # what reaches transformers' generate: the default's custom_generate, or nothing (stepped aside)
    seen = []
    stock_generate = transformers.GenerationMixin.generate

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("custom_generate"))
        if case in ("dola", "constrained", "contrastive", "paged_cache", "token_healing", "assistant_early_exit",
                    "offloaded_cache"):
            return "stock"  # stock itself needs Hub code / tokenizer files / a GPU for these on this tiny model
        return stock_generate(self, *args, **kwargs)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", spy)
    with caplog.at_level(logging.INFO, logger="hf_paralleldecode"):
        out = model.generate(input_ids=ids, max_new_tokens=5, **call)
    if case == "stop_strings":  # served by the parallel decoding itself
        assert seen == [hfpd.jacobi]
    else:
        assert seen == [None] and "steps aside" in caplog.text
    if isinstance(out, torch.Tensor):
        monkeypatch.setattr(transformers.GenerationMixin, "generate", stock_generate)
        assert torch.equal(out, model.generate(input_ids=ids, max_new_tokens=5, decoding="stock", **call))


def test_models_without_explicit_positions_are_refused_up_front():
    """ALiBi models (Bloom) compute positions from the 2D mask: no custom 4D mask / position ids."""
    model = hfpd.enable(tiny_model("bloom"))
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(ValueError, match=r'BloomForCausalLM.*decoding="stock"'):
        model.generate(input_ids=ids, max_new_tokens=4, decoding="jacobi")
    assert model.generate(input_ids=ids, max_new_tokens=4, decoding="stock").shape == (1, 8)


def test_synced_gpus_is_refused_when_transformers_would_turn_it_on(monkeypatch):
    import transformers.generation.utils as gen_utils

    model = enabled("llama")
    monkeypatch.setattr(gen_utils, "is_deepspeed_zero3_enabled", lambda: True, raising=False)
    monkeypatch.setattr(gen_utils, "_get_torch_distributed_world_size", lambda: 2)
    with pytest.raises(ValueError, match="ZeRO-3|FSDP"):
        model.generate(input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=4, decoding="jacobi")


@pytest.mark.parametrize("decoding", [*STRATEGIES, "speculative"])
def test_prefix_allowed_tokens_fn_only_ever_sees_its_own_rows_prefixes(decoding):
    """Placeholder rows of a processor call carry their own row's prefix, never another row's."""
    model = enabled("llama")
    ids, mask = prompts(3)
    owners = {tuple(ids[b][mask[b].bool()].tolist()): b for b in range(3)}

    def allowed(batch_id, sent):  # a per-row constraint that refuses a prefix of another row
        real = sent[sent != PAD].tolist() if (sent != PAD).any() else []
        for prompt, row in owners.items():
            if tuple(real[: len(prompt)]) == prompt and row != batch_id:
                return []  # transformers raises on an empty list
        return list(range(10 + 20 * batch_id, 30 + 20 * batch_id))

    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                  prefix_allowed_tokens_fn=allowed)
    ref = model.generate(**kwargs, decoding="stock")
    settings = dict(STRATEGIES.get(decoding, {}))
    if decoding == "speculative":
        torch.manual_seed(0)
        settings = dict(drafter=hfpd.DraftHead.for_target(model, num_hidden_layers=1, block_size=3), tree_budget=5)
    assert torch.equal(model.generate(**kwargs, decoding=decoding, **settings), ref)


@pytest.mark.parametrize("decoding", ["jacobi", "jacobi_forcing", "lookahead"])
def test_a_streamer_given_with_custom_generate_is_fed_like_stock(decoding):
    """transformers keeps ``streamer`` from a custom_generate callable (after putting the prompt in it);
    the strategy finds it and streams the same puts and one end() as stock."""
    from models import RecordingStreamer

    model = tiny_model("llama")  # not enabled: the plain custom_generate route
    ids, mask = prompts(2)
    stock, ours = RecordingStreamer(), RecordingStreamer()
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
    model.generate(**kwargs, streamer=stock)
    strategy = getattr(hfpd, decoding)
    model.generate(**kwargs, streamer=ours, custom_generate=strategy, **STRATEGIES[decoding])
    assert ours.ended == stock.ended == 1
    assert len(ours.values) == len(stock.values)
    assert all(torch.equal(a, b) for a, b in zip(ours.values, stock.values))


# ---- generate() without a prompt: stock starts from one BOS token per row -----------------------------------------
def _no_prompt_settings(decoding, model):
    """A strategy's settings for the no-prompt table (``speculative``: a random draft head or EAGLE-3 drafter)."""
    if decoding == "speculative":
        torch.manual_seed(0)
        return dict(drafter=hfpd.DraftHead.for_target(model, num_hidden_layers=1, block_size=3), tree_budget=5)
    if decoding == "speculative_eagle3":
        torch.manual_seed(0)
        return dict(drafter=hfpd.Eagle3Drafter.for_target(model), tree_budget=5)
    return dict(STRATEGIES.get(decoding, {}))


NO_PROMPT_DECODINGS = [*STRATEGIES, "prompt_lookup", "speculative", "speculative_eagle3"]
NO_PROMPT_LENGTHS = {"max_new_tokens": dict(max_new_tokens=6), "max_length": dict(max_length=9),
                     "default_length": {}}  # transformers' default: 20 new tokens


@pytest.mark.parametrize("length", list(NO_PROMPT_LENGTHS))
@pytest.mark.parametrize("decoding", NO_PROMPT_DECODINGS)
def test_generate_without_a_prompt_starts_from_bos_like_stock(decoding, length):
    model = enabled("llama")
    kwargs = dict(do_sample=False, **NO_PROMPT_LENGTHS[length])
    ref = model.generate(**kwargs, decoding="stock")
    assert ref[0, 0] == BOS and ref.shape[0] == 1
    out = model.generate(**kwargs, decoding=decoding.removesuffix("_eagle3"), **_no_prompt_settings(decoding, model))
    assert torch.equal(out, ref)


def test_a_checkpoint_default_serves_a_call_without_a_prompt(monkeypatch):
    model = hfpd.enable(tiny_model("llama"))
    model.parallel_decoding_config = hfpd.ParallelDecodingConfig("jacobi", {"block_size": 4})
    seen = []
    stock_generate = transformers.GenerationMixin.generate

    def spy(self, *args, **kwargs):
        seen.append(kwargs.get("custom_generate"))
        return stock_generate(self, *args, **kwargs)

    monkeypatch.setattr(transformers.GenerationMixin, "generate", spy)
    out = model.generate(max_new_tokens=6)
    assert seen == [hfpd.jacobi]
    monkeypatch.setattr(transformers.GenerationMixin, "generate", stock_generate)
    assert torch.equal(out, model.generate(max_new_tokens=6, decoding="stock"))


def test_without_a_prompt_or_bos_token_the_error_is_stocks():
    model = hfpd.enable(tiny_model("llama"))
    model.generation_config.bos_token_id = None
    model.config.bos_token_id = None
    with pytest.raises(ValueError, match="bos_token_id"):
        model.generate(max_new_tokens=4, decoding="stock")
    with pytest.raises(ValueError, match="bos_token_id"):
        model.generate(max_new_tokens=4, decoding="jacobi")


@pytest.mark.parametrize("length", list(NO_PROMPT_LENGTHS))
@pytest.mark.parametrize("prompt", [False, True], ids=["no_prompt", "prompt"])
@pytest.mark.parametrize("positions", [512, 16], ids=["long_table", "short_table"])
def test_the_pre_check_resolves_max_length_as_generate_does(length, prompt, positions):
    """What enable()'s pre-check reads as a call's max_length (rotary, sliding-window and drafter checks) is what
    generate hands the strategy: prompt + max_new_tokens, max_length, or 20 new tokens capped at the position table."""
    import copy

    from hf_paralleldecode.compat import generated_max_length

    model = tiny_model("llama", max_position_embeddings=positions)
    seen = []

    def record(model, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        seen.append(generation_config.max_length)
        return input_ids

    kwargs = dict(NO_PROMPT_LENGTHS[length])
    ids = prompts(2)[0] if prompt else None
    model.generate(input_ids=ids, custom_generate=record, **kwargs)
    gc = copy.deepcopy(model.generation_config)
    gc.update(**kwargs)
    assert seen == [generated_max_length(model, gc, ids.shape[1] if prompt else 1)]
