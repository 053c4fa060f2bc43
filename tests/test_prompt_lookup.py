"""decoding="prompt_lookup": context n-gram drafting, batched, lossless; its matcher against a brute force."""

from __future__ import annotations

import pytest
import torch
from models import ForwardRecorder, RecordingStreamer, enabled, prompts, tiny_model

import hf_paralleldecode as hfpd
from hf_paralleldecode.decoding.prompt_lookup import context_candidates

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)


def _brute(context: list[int], num_tokens, max_ngram, max_matches):
    out = []
    for n in range(min(max_ngram, len(context) - 1), 0, -1):
        suffix = context[-n:]
        for p in range(len(context) - n - 1, -1, -1):
            if context[p : p + n] == suffix:
                cont = context[p + n : p + n + num_tokens]
                if cont not in out:
                    out.append(cont)
    return out[:max_matches]


@pytest.mark.parametrize("seed", range(6))
def test_matches_are_the_brute_force_ones_in_order(seed):
    g = torch.Generator().manual_seed(seed)
    context = torch.randint(0, 4, (40,), generator=g)
    for num, ngram, matches in ((3, 3, 4), (1, 1, 2), (10, 5, 50)):
        assert context_candidates(context, num, ngram, matches) == _brute(context.tolist(), num, ngram, matches)
    assert context_candidates(torch.tensor([7]), 3, 3, 4) == []  # nothing before the suffix


def test_repetitive_text_is_drafted_and_accepted():
    """A prompt that repeats: the continuation is found in it and several tokens pass per forward."""
    model = enabled("llama")
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12] * 3 + [5, 6]])
    # make the target continue the cycle, so drafts from the prompt are right
    free = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, eos_token_id=None, decoding="stock")
    out = model.generate(input_ids=ids, max_new_tokens=12, do_sample=False, eos_token_id=None,
                         decoding="prompt_lookup", adaptive=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, free)
    assert out.stats["context_matched_step_share"] > 0


def test_batch_streamer_and_one_forward_per_step():
    model = enabled("qwen2")
    ids, mask = prompts(3)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    rec, streamer = ForwardRecorder(model), RecordingStreamer()
    try:
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                             decoding="prompt_lookup", streamer=streamer, return_dict_in_generate=True)
    finally:
        rec.restore()
    assert torch.equal(out.sequences, ref)
    assert out.num_forward_passes == len(rec.calls)
    assert streamer.ended == 1 and torch.equal(torch.cat([v.reshape(3, -1) for v in streamer.values], 1), ref)


@pytest.mark.parametrize("settings, match", [
    (dict(num_tokens=0), "num_tokens"), (dict(max_ngram_size=0), "max_ngram_size"),
    (dict(max_matches=0), "max_matches"), (dict(tree_budget=1.5), "tree_budget"),
])
def test_bad_settings_are_refused_before_any_forward(settings, match):
    model = hfpd.enable(tiny_model("llama"))
    with pytest.raises(ValueError, match=match):
        model.generate(input_ids=torch.tensor([[5, 6]]), max_new_tokens=4, decoding="prompt_lookup", **settings)
    with pytest.raises(ValueError, match=match):
        hfpd.ParallelDecodingConfig("prompt_lookup", settings)


@pytest.mark.parametrize("seed", range(4))
def test_the_incremental_ngram_index_answers_like_the_scan(seed):
    """ContextNgrams keeps an NgramIndex per row, fed in chunks as tokens are committed; after every chunk its
    answer equals the brute force over the whole context (same matches, same order)."""
    import random

    from hf_paralleldecode.decoding.prompt_lookup import NgramIndex

    rng = random.Random(seed)
    tokens = [rng.randrange(4) for _ in range(60)]
    for ngram, first in ((1, 5), (3, 5), (5, 5), (3, 0), (4, 1)):
        index = NgramIndex(tokens[:first], ngram)
        fed = first
        while fed < len(tokens):
            step = rng.randint(0, 6)  # empty chunks too
            index.extend(tokens[fed: fed + step])
            fed = min(fed + step, len(tokens))
            for num, matches in ((3, 4), (1, 2), (10, 50), (0, 3)):
                assert index.candidates(num, matches) == _brute(tokens[:fed], num, ngram, matches)
        # every n-gram's start positions, each once, increasing
        assert all(starts == sorted(set(starts)) for starts in index.starts.values())
        assert sum(map(len, index.starts.values())) == sum(len(tokens) - n + 1 for n in range(1, ngram + 1))
    assert NgramIndex([7], 3).candidates(3, 4) == []


def test_a_rows_context_index_is_built_at_its_first_lookup_not_for_calls_that_never_look_up(monkeypatch):
    """Indexing a prompt costs host time per row; at a large batch the batch policy may run plain steps only, so
    the index is built when a row is first looked up (once), never for a call that does not draft from context."""
    from hf_paralleldecode.decoding import prompt_lookup as module

    built = []
    original = module.NgramIndex.__init__

    def spy(self, tokens, max_ngram_size):
        built.append(len(tokens))
        original(self, tokens, max_ngram_size)

    monkeypatch.setattr(module.NgramIndex, "__init__", spy)
    model = enabled("llama")
    ids, mask = prompts(3)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                         decoding="prompt_lookup", max_step_tokens=1)  # plain steps only
    assert torch.equal(out, ref) and built == []
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                         decoding="prompt_lookup", adaptive=False)
    assert torch.equal(out, ref) and sorted(built) == sorted(int(m.sum()) for m in mask)  # once per row
