"""Bad input: a clear ValueError naming the fix, raised before any forward pass, for every strategy."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest
from models import ForwardRecorder, prompts, tiny_model

import hf_paralleldecode as hfpd

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)

STRATEGIES = ["jacobi", "lookahead", "jacobi_forcing"]

COMMON = [
    (dict(num_beams=2), "num_beams"),
    (dict(use_cache=False), "use_cache"),
    (dict(num_return_sequences=2), "num_return_sequences"),
    (dict(output_attentions=True, return_dict_in_generate=True), "output_attentions"),
    (dict(guidance_scale=1.5), "guidance"),
]

SPECIFIC = {
    "jacobi": [
        (dict(block_size=0), "block_size"),
        (dict(block_size=-3), "block_size"),
        (dict(block_size=2.5), "block_size"),
        (dict(block_size="8"), "block_size"),
        (dict(block_size=True), "block_size"),
        (dict(jacobi_init="zeros"), "jacobi_init"),
        (dict(jacobi_seed=-1), "jacobi_seed"),
    ],
    "lookahead": [
        (dict(window_size=0), "window_size"),
        (dict(ngram_size=1), "ngram_size"),
        (dict(guess_set_size=-1), "guess_set_size"),
        (dict(window_size=2.0), "window_size"),
        (dict(pool_from_prompt="yes"), "pool_from_prompt"),
    ],
    "jacobi_forcing": [
        (dict(num_blocks=0), "num_blocks"),
        (dict(activation_ratio=0.0), "activation_ratio"),
        (dict(activation_ratio=1.5), "activation_ratio"),
        (dict(activation_ratio="0.8"), "activation_ratio"),
        (dict(pool_size=-1), "pool_size"),
        (dict(ngram_size=1), "ngram_size"),
        (dict(block_size=0), "block_size"),
    ],
}

CASES = [(d, kw, m) for d in STRATEGIES for kw, m in COMMON + SPECIFIC[d]]


@pytest.mark.parametrize("decoding, kwargs, match", CASES,
                         ids=[f"{d}-{'-'.join(map(str, kw.items()))}" for d, kw, _ in CASES])
def test_bad_settings_raise_before_any_forward(decoding, kwargs, match):
    model = hfpd.enable(tiny_model("llama"))
    ids, _ = prompts(1)
    rec = ForwardRecorder(model)
    try:
        with pytest.raises(ValueError, match=match):
            model.generate(input_ids=ids, max_new_tokens=5, decoding=decoding, **kwargs)
    finally:
        rec.restore()
    assert rec.calls == []


# ---- sizes: capped at what the call can use, refused beyond what any call of the model can use (issue 64) ----------
def _refused_before_any_forward(model, match, **kwargs):
    ids, _ = prompts(1)
    rec = ForwardRecorder(model)
    try:
        with pytest.raises(ValueError, match=match) as err:
            model.generate(input_ids=ids, max_new_tokens=5, do_sample=False, **kwargs)
    finally:
        rec.restore()
    assert rec.calls == []
    return str(err.value)


#: (decoding, a size no call of the 512-position tiny model can use): each crashed, hung or ran out of memory after the
#: prefill (jacobi's 24 TB block, lookahead's MemoryError, prompt_lookup's endless n-gram index, ...)
HUGE = [
    ("jacobi", dict(block_size=10**12)),
    ("jacobi_forcing", dict(block_size=10**9)),
    ("jacobi_forcing", dict(num_blocks=10**9)),
    ("jacobi_forcing", dict(pool_size=10**9)),
    ("jacobi_forcing", dict(ngram_size=10**9)),
    ("jacobi_forcing", dict(context_matches=10**9)),
    ("jacobi_forcing", dict(context_tokens=10**9)),
    ("jacobi_forcing", dict(context_ngram_size=10**9)),
    ("jacobi_forcing", dict(tree_budget=10**9)),
    ("lookahead", dict(window_size=10**6)),
    ("lookahead", dict(ngram_size=10**6)),
    ("lookahead", dict(guess_set_size=10**9)),
    ("lookahead", dict(context_matches=10**9)),
    ("lookahead", dict(context_tokens=10**9)),
    ("lookahead", dict(context_ngram_size=10**9)),
    ("lookahead", dict(tree_budget=10**9)),
    ("prompt_lookup", dict(max_ngram_size=10**9)),
    ("prompt_lookup", dict(num_tokens=10**9)),
    ("prompt_lookup", dict(max_matches=10**9)),
    ("prompt_lookup", dict(tree_budget=10**9)),
]


@pytest.mark.parametrize("decoding, kwargs", HUGE, ids=[f"{d}-{next(iter(kw))}" for d, kw in HUGE])
def test_a_size_no_call_of_the_model_can_use_is_refused_before_any_forward(decoding, kwargs):
    (name, value), = kwargs.items()
    text = _refused_before_any_forward(hfpd.enable(tiny_model("llama")), rf"`{name}`={value}", decoding=decoding,
                                       **kwargs)
    assert f"Pass {name} <= " in text and "512 positions" in text, text


@pytest.mark.parametrize("kwargs", [dict(tree_budget=10**9), dict(tree_width=10**9), dict(tree_depth=10**9),
                                    dict(context_matches=10**9), dict(context_tokens=10**9),
                                    dict(context_ngram_size=10**9)], ids=lambda kw: next(iter(kw)))
def test_a_huge_speculative_size_is_refused_before_any_forward(kwargs):
    import torch

    model = hfpd.enable(tiny_model("llama"))
    torch.manual_seed(0)
    head = hfpd.DraftHead.for_target(model, num_hidden_layers=1, block_size=4)
    (name, value), = kwargs.items()
    _refused_before_any_forward(model, rf"`{name}`={value}.*Pass {name} <= ", decoding="speculative", drafter=head,
                                **kwargs)


#: (decoding, a size larger than this call can use but within the model's positions, what the call uses instead:
#: max_new_tokens (5), the call's length (7 + 5), one more than max_new_tokens for an n-gram)
CAPPED = [
    ("jacobi", dict(block_size=300), 5),
    ("jacobi_forcing", dict(block_size=300), 5),
    ("jacobi_forcing", dict(num_blocks=300), 5),
    ("jacobi_forcing", dict(ngram_size=300), 6),
    ("jacobi_forcing", dict(pool_size=300), 12),
    ("jacobi_forcing", dict(context_matches=300), 12),
    ("lookahead", dict(window_size=300), 5),
    ("lookahead", dict(ngram_size=300), 6),
    ("lookahead", dict(guess_set_size=300), 12),
    ("prompt_lookup", dict(max_ngram_size=300), 12),
    ("prompt_lookup", dict(num_tokens=300), 5),
    ("prompt_lookup", dict(max_matches=300), 12),
]


@pytest.mark.parametrize("decoding, kwargs, used", CAPPED, ids=[f"{d}-{next(iter(kw))}" for d, kw, _ in CAPPED])
def test_a_size_larger_than_the_call_can_use_is_capped_there_and_the_output_stays_exact(decoding, kwargs, used):
    model = hfpd.enable(tiny_model("llama"))
    ids, _ = prompts(1)
    gen = dict(input_ids=ids, max_new_tokens=5, do_sample=False, eos_token_id=None)
    out = model.generate(**gen, decoding=decoding, return_dict_in_generate=True, **kwargs)
    (name, _), = kwargs.items()
    assert out.stats[name] == used
    assert out.sequences.tolist() == tiny_model("llama").generate(**gen).tolist()


def test_prompt_lookup_max_ngram_size_is_bounded_by_what_can_match_so_the_call_stays_fast():
    """1000 made a 12-token call 8x slower (the index was built for every length up to 1000); the call's length
    bounds it: a suffix longer than the prompt plus the generation never matches."""
    import time

    model = hfpd.enable(tiny_model("llama"))
    ids, _ = prompts(1)
    gen = dict(input_ids=ids, max_new_tokens=5, do_sample=False, eos_token_id=None, decoding="prompt_lookup")
    model.generate(**gen)
    start = time.perf_counter()
    model.generate(**gen)
    base = time.perf_counter() - start
    start = time.perf_counter()
    out = model.generate(**gen, max_ngram_size=500, return_dict_in_generate=True)
    assert out.stats["max_ngram_size"] == 12 and time.perf_counter() - start < 3 * base + 0.05


@pytest.mark.parametrize("decoding, seed", [("jacobi", "jacobi_seed"), ("lookahead", "lookahead_seed"),
                                            ("jacobi_forcing", "jacobi_seed")])
def test_a_seed_outside_what_torch_generators_take_is_refused_naming_the_range(decoding, seed):
    from hf_paralleldecode import registry

    cls = registry.settings_class(decoding)
    for value in (2**64, 2**70):
        with pytest.raises(ValueError, match=rf"`{seed}` must be <= 18446744073709551615 \(2\*\*64 - 1"):
            cls(**{seed: value})
        _refused_before_any_forward(hfpd.enable(tiny_model("llama")), rf"`{seed}`.*2\*\*64 - 1", decoding=decoding,
                                    **{seed: value})
    cls(**{seed: 2**64 - 1})  # the largest seed torch.Generator.manual_seed takes
    model = hfpd.enable(tiny_model("llama"))
    ids, _ = prompts(1)
    model.generate(input_ids=ids, max_new_tokens=3, decoding=decoding, **{seed: 2**64 - 1})


# ---- the settings classes themselves --------------------------------------------------------------------------------
def test_setting_names_must_be_strings():
    from hf_paralleldecode.config import ParallelDecodingConfig

    with pytest.raises(ValueError, match=r"Setting names are strings.*1 \(int\)"):
        hfpd.JacobiSettings.from_dict({1: 3})
    with pytest.raises(ValueError, match=r"Setting names are strings.*1 \(int\)"):
        ParallelDecodingConfig("jacobi", {1: 4})
    with pytest.raises(ValueError, match=r"Setting names are strings"):
        hfpd.get_decoding("lookahead").check_settings({("window_size",): 4})


def test_the_drafter_setting_takes_a_drafter_a_path_or_none():
    for bad in (5, 2.5, ["default-jetspec"], True):
        with pytest.raises(ValueError, match=r"`drafter` must be a drafter .*folder.*got"):
            hfpd.SpeculativeSettings(drafter=bad)
    for good in (None, "default-jetspec", Path("some/folder"), ("some/repo", "drafter")):
        hfpd.SpeculativeSettings(drafter=good)


def test_a_settings_class_without_dataclass_is_refused_at_registration():
    from dataclasses import dataclass, field

    class Plain(hfpd.StrategySettings):
        width: int = 4

    with pytest.raises(ValueError, match=r"Plain.*@dataclass"):
        hfpd.decoding_strategy("plain_settings", Plain, lambda model, settings, call: None)

    @dataclass
    class Base(hfpd.StrategySettings):
        width: int = field(default=4, metadata={"help": "w"})

    class Child(Base):  # adds a setting without the decorator: it would be silently dropped
        depth = 3

    with pytest.raises(ValueError, match=r"Child.*depth.*@dataclass"):
        hfpd.decoding_strategy("child_settings", Child, lambda model, settings, call: None)

    class Checked(Base):  # only a check across fields: nothing to lose, accepted
        def check(self):
            pass

    hfpd.decoding_strategy("checked_settings", Checked, lambda model, settings, call: None)


def test_every_field_type_is_checked():
    """(The annotations resolve in the module's namespace: ``Path`` and ``Literal`` are imported at its top.)"""
    from dataclasses import dataclass, field

    @dataclass
    class Mine(hfpd.StrategySettings):
        mode: Literal["fast", "exact"] = "fast"
        ratio: float = field(default=0.5, metadata={"minimum": 0.0, "maximum": 1.0})
        where: Path | None = None
        count: int | float = 1
        size: int = 1

    for bad, match in [(dict(mode="slow"), r"`mode` must be one of \('fast', 'exact'\)"),
                       (dict(ratio=1.5), r"`ratio` must be <= 1.0"), (dict(ratio=-1), r"`ratio` must be >= 0.0"),
                       (dict(ratio="0.5"), "`ratio` must be a number"), (dict(where="x"), "`where` must be a Path"),
                       (dict(count=True), "`count` must be an int or a float"),
                       (dict(size=2**63), r"`size` must be <= 9223372036854775807")]:
        with pytest.raises(ValueError, match=match):
            Mine(**bad)
    Mine(mode="exact", ratio=1, where=Path("x"), count=2.5)
    with pytest.raises(ValueError, match=r"`tree_budget` must be <= 9223372036854775807 \(2\*\*63 - 1"):
        hfpd.LookaheadSettings(tree_budget=10**30)  # a built-in integer setting: never past int64
