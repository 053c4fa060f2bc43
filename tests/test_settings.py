"""Typed strategy settings and the one factory of the strategies' entry points (``engine/settings.py``).

Each strategy declares its settings once (a ``StrategySettings`` dataclass: typed fields, defaults, help, checks);
``decoding_strategy`` builds its ``custom_generate`` callable; the registry, ``enable()``'s generate, the saved
configs, the bench and ``tune`` read the class.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import pydoc
from dataclasses import dataclass, field

import pytest
import torch
from models import enabled, prompts, tiny_model, word_tokenizer

import hf_paralleldecode as hfpd
from hf_paralleldecode import registry
from hf_paralleldecode.compat import SAMPLE_ARGUMENTS
from hf_paralleldecode.config import CONFIG_NAME, ParallelDecodingConfig
from hf_paralleldecode.engine.run import Proposer, decode_call
from hf_paralleldecode.engine.settings import settings_class, takes_streamer
from hf_paralleldecode.engine.tree import chain_tree

#: each built-in strategy's settings: (class, its fields in order, the defaults of some)
DECLARED = {
    "jacobi": (hfpd.JacobiSettings, ["block_size", "jacobi_init", "jacobi_seed", "adaptive", "max_step_tokens"],
               dict(block_size=None, jacobi_init="random_context", jacobi_seed=0, adaptive=True)),
    "jacobi_forcing": (hfpd.JacobiForcingSettings,
                       ["block_size", "num_blocks", "activation_ratio", "pool_size", "ngram_size", "jacobi_seed",
                        "context_matches", "context_tokens", "context_ngram_size", "tree_budget", "cost_aware",
                        "adaptive", "max_step_tokens"],
                       dict(block_size=None, activation_ratio=None, context_ngram_size=3, cost_aware=False)),
    "lookahead": (hfpd.LookaheadSettings,
                  ["window_size", "ngram_size", "guess_set_size", "pool_from_prompt", "lookahead_seed",
                   "context_matches", "context_tokens", "context_ngram_size", "tree_budget", "cost_aware", "adaptive",
                   "max_step_tokens"],
                  dict(window_size=None, pool_from_prompt=True, context_tokens=10)),
    "prompt_lookup": (hfpd.PromptLookupSettings,
                      ["num_tokens", "max_ngram_size", "max_matches", "tree_budget", "cost_aware", "adaptive",
                       "max_step_tokens"],
                      dict(num_tokens=None, max_ngram_size=3, tree_budget=None)),
    "speculative": (hfpd.SpeculativeSettings,
                    ["drafter", "tree_budget", "tree_width", "tree_depth", "tree_waves", "denoise_steps",
                     "context_matches", "context_tokens", "context_ngram_size", "drafter_dtype", "cost_aware",
                     "adaptive", "max_step_tokens"],
                    dict(drafter=None, tree_width=8, context_matches=0, drafter_dtype=None)),
}


@pytest.mark.parametrize("name", list(DECLARED))
def test_each_strategy_declares_its_settings_once_with_help_and_defaults(name):
    cls, names, defaults = DECLARED[name]
    strategy = hfpd.get_decoding(name)
    assert strategy is getattr(hfpd, name) and strategy.settings_class is cls and registry.settings_class(name) is cls
    assert cls.names() == names and registry.decoding_settings(name) == sorted(names)
    assert {k: cls.defaults()[k] for k in defaults} == defaults
    assert all(len(text) > 20 for text in cls.help().values()), cls.help()
    built = cls()  # every default is a valid value
    assert built.to_dict() == cls.defaults() and built.to_dict(changed_only=True) == {}


@pytest.mark.parametrize("name", list(DECLARED))
def test_the_built_callable_lists_every_setting_with_its_default_and_help(name):
    cls = DECLARED[name][0]
    strategy = hfpd.get_decoding(name)
    params = inspect.signature(strategy).parameters
    assert list(params)[:7] == ["model", "input_ids", "logits_processor", "stopping_criteria", "generation_config",
                                "synced_gpus", "streamer"]
    assert list(params)[7:] == [*cls.names(), "pd_streamer", "model_kwargs"]
    for f in dataclasses.fields(cls):
        assert params[f.name].kind is inspect.Parameter.KEYWORD_ONLY and params[f.name].default == cls.defaults()[f.name]
    # what transformers hands a custom_generate callable: the parameters _sample does not have
    assert set(params) - SAMPLE_ARGUMENTS >= set(cls.names())
    text = pydoc.render_doc(strategy)
    assert "Args:" in text and all(f"{n} (" in text for n in cls.names()) and "pd_streamer (" in text


@pytest.mark.parametrize("settings, match", [
    (lambda: hfpd.JacobiSettings(block_size=0), r"`block_size` must be >= 1, got 0"),  # an integer's minimum
    (lambda: hfpd.JacobiForcingSettings(num_blocks=2.0), r"`num_blocks` must be an integer >= 1"),  # a type
    (lambda: hfpd.JacobiSettings(jacobi_seed=None), r"`jacobi_seed` must be an integer"),  # None is not allowed
    (lambda: hfpd.LookaheadSettings(pool_from_prompt="yes"), r"`pool_from_prompt` must be True or False"),  # a bool
    (lambda: hfpd.JacobiSettings(jacobi_init="zeros"), r"`jacobi_init` must be one of"),  # choices
    (lambda: hfpd.JacobiForcingSettings(activation_ratio=1.5), r"`activation_ratio` must be in \(0, 1\]"),  # a check
    (lambda: hfpd.SpeculativeSettings(drafter_dtype="fp8"), r"drafter_dtype must be"),  # another field's own check
    (lambda: hfpd.PromptLookupSettings(adaptive=False, max_step_tokens=8), "max_step_tokens.*adaptive=True"),  # across
])
def test_each_kind_of_check_refuses_a_bad_value_naming_the_setting(settings, match):
    with pytest.raises(ValueError, match=match):
        settings()


def test_a_bad_setting_is_refused_before_any_forward_on_both_entry_points():
    model = enabled("llama")
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    ids, mask = prompts(1)
    try:
        with pytest.raises(ValueError, match="`window_size` must be >= 1"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, decoding="lookahead", window_size=0)
        with pytest.raises(ValueError, match="`tree_budget` must be an integer"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, custom_generate=hfpd.prompt_lookup,
                           tree_budget="8")
    finally:
        hook.remove()
    assert not calls


@pytest.mark.parametrize("how", ["decoding", "custom_generate"])
def test_the_speculative_path_checks_its_settings_once_per_call(how, monkeypatch):
    model = enabled("llama")
    torch.manual_seed(0)
    head = hfpd.DraftHead.for_target(model, num_hidden_layers=1, block_size=4)
    built = []
    post_init = hfpd.SpeculativeSettings.__post_init__
    monkeypatch.setattr(hfpd.SpeculativeSettings, "__post_init__", lambda self: (built.append(1), post_init(self)))
    ids, mask = prompts(2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, drafter=head, tree_budget=6)
    where = {"decoding": "speculative"} if how == "decoding" else {"custom_generate": hfpd.speculative}
    out = model.generate(**kwargs, **where)
    assert built == [1]
    assert torch.equal(out, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                           decoding="stock"))


def test_unknown_settings_are_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"Unknown settings \['blok_size'\] for decoding 'jacobi' \(did you mean "
                                         r"'block_size'\?\); its settings: adaptive, block_size, jacobi_init"):
        hfpd.JacobiSettings.from_dict({"blok_size": 4}, decoding="jacobi")
    with pytest.raises(ValueError, match="Unknown settings"):
        hfpd.get_decoding("lookahead").check_settings({"tree_depth": 3})
    with pytest.raises(ValueError, match=r"'tree_widht'.*did you mean 'tree_width'"):
        ParallelDecodingConfig("speculative", {"tree_widht": 2})
    with pytest.raises(ValueError, match=r"pd_streamer"):  # a call argument, not a setting to save
        ParallelDecodingConfig("jacobi", {"pd_streamer": None})


def test_tune_refuses_a_grid_outside_the_settings_before_measuring_anything():
    from hf_paralleldecode.tune import tune

    model = hfpd.enable(tiny_model("llama"))
    calls = []
    hook = model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"'blok_size'.*did you mean 'block_size'"):
            tune(model, word_tokenizer(), ["t5 t6 t7"], "jacobi", {"blok_size": [2, 4]}, progress=False)
        with pytest.raises(ValueError, match="`block_size` must be >= 1"):
            tune(model, word_tokenizer(), ["t5 t6 t7"], "jacobi", {"block_size": [2, 0]}, progress=False)
    finally:
        hook.remove()
    assert not calls


def test_the_bench_reads_the_resolved_settings_through_the_class():
    from hf_paralleldecode.bench import parse_strategy, run_benchmark

    spec = parse_strategy("jacobi:block_size=4,adaptive=False")
    report = run_benchmark(tiny_model("llama"), word_tokenizer(), ["t5 t6 t7 t8"], [spec], max_new_tokens=6,
                           progress=False)
    resolved = report["results"][spec.label]["resolved_settings"]
    assert resolved == {"block_size": 4, "adaptive": False}  # the class's settings the stats hold (None left out)


def test_config_round_trips_the_settings_typed_and_records_their_class(tmp_path):
    settings = hfpd.LookaheadSettings(window_size=3, ngram_size=3, context_matches=0)
    config = ParallelDecodingConfig("lookahead", settings)
    assert config.settings == {"window_size": 3, "ngram_size": 3, "context_matches": 0}  # the changed ones
    config.save_pretrained(tmp_path)
    data = json.loads((tmp_path / CONFIG_NAME).read_text())
    assert data["settings_class"] == "hf_paralleldecode.decoding.lookahead.LookaheadSettings"
    loaded = ParallelDecodingConfig.from_pretrained(tmp_path)
    assert loaded == config and loaded.strategy_settings == settings
    assert isinstance(loaded.strategy_settings, hfpd.LookaheadSettings)
    with pytest.raises(ValueError, match=r"takes JacobiSettings, got LookaheadSettings \(the settings of "
                                         r"decoding='lookahead'\)"):
        ParallelDecodingConfig("jacobi", settings)


def test_config_files_of_the_plain_dict_format_still_load_typed(tmp_path, caplog):
    shipped = hfpd.default_model_path()  # written before the settings class was recorded
    assert "settings_class" not in json.loads((shipped / CONFIG_NAME).read_text())
    assert ParallelDecodingConfig.from_pretrained(shipped).strategy_settings == hfpd.SpeculativeSettings(
        tree_budget=20, tree_width=4, tree_depth=16, context_matches=2, context_tokens=6)
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"decoding": "jacobi", "settings": {"block_size": 8},
                                                    "settings_class": "elsewhere.OldJacobiSettings"}))
    with caplog.at_level(logging.WARNING):
        assert ParallelDecodingConfig.from_pretrained(tmp_path).strategy_settings == hfpd.JacobiSettings(block_size=8)
    assert "elsewhere.OldJacobiSettings" in caplog.text
    (tmp_path / CONFIG_NAME).write_text(json.dumps({"decoding": "jacobi", "settings": {"block_size": 0}}))
    with pytest.raises(ValueError, match="`block_size` must be >= 1"):  # values checked on load, as on construction
        ParallelDecodingConfig.from_pretrained(tmp_path)


# ---- a third party's strategy, built with the factory --------------------------------------------------------
@dataclass
class RepeatSettings(hfpd.StrategySettings):
    """Guess that the last committed token repeats."""

    width: int = field(default=3, metadata={"help": "copies of the last committed token guessed per step",
                                            "minimum": 1})


class RepeatProposer(Proposer):
    def __init__(self, run, width: int):
        self.run, self.width = run, width

    def propose(self):
        log, rows = self.run.log, self.run.rows
        count = log.count[rows]  # [active]
        last = log.tokens[rows, count - 1]  # [active] each row's last committed token
        widths = torch.clamp(log.max_new_tokens - count, max=self.width + 1)  # the root and the guesses, in budget
        return chain_tree(last[:, None].expand(-1, self.width + 1), widths)

    def update(self, tree, verdict) -> None:
        """Nothing to learn."""


def run_repeat(model, settings: RepeatSettings, call):
    return decode_call(model, call, lambda run: RepeatProposer(run, settings.width), {"width": settings.width})


repeat = hfpd.decoding_strategy("test_repeat", RepeatSettings, run_repeat, doc="Guess repeats of the last token.")


def test_a_third_party_strategy_built_with_the_factory_runs_on_both_entry_points():
    assert list(inspect.signature(repeat).parameters)[7:] == ["width", "pd_streamer", "model_kwargs"]
    assert "width (int): copies of the last committed token" in repeat.__doc__
    hfpd.register_decoding("test_repeat", repeat)
    try:
        model = enabled("llama")
        ids, mask = prompts(3)
        kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False)
        ref = model.generate(**kwargs, decoding="stock")
        out = model.generate(**kwargs, decoding="test_repeat", width=2, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref) and out.decoding == "test_repeat" and out.stats["width"] == 2
        direct = tiny_model("llama").generate(**kwargs, custom_generate=repeat, width=4)
        assert torch.equal(direct, ref)
        with pytest.raises(ValueError, match="`width` must be >= 1"):
            model.generate(**kwargs, decoding="test_repeat", width=0)
        with pytest.raises(ValueError, match=r"'widht'.*did you mean 'width'.*Its settings: width"):
            model.generate(**kwargs, decoding="test_repeat", widht=2)
        config = ParallelDecodingConfig("test_repeat", RepeatSettings(width=5))
        assert config.settings == {"width": 5} and config.strategy_settings == RepeatSettings(width=5)
        assert registry.decoding_settings("test_repeat") == ["width"]
    finally:
        registry._REGISTRY.pop("test_repeat")


def test_a_strategy_registered_without_a_settings_class_has_its_signature_as_schema():
    def mine(model, input_ids, logits_processor, stopping_criteria, generation_config, width=2, pd_streamer=None,
             **model_kwargs):
        return input_ids

    cls = settings_class(mine)
    assert cls.names() == ["width"] and cls.defaults() == {"width": 2} and takes_streamer(mine)
    assert settings_class(mine) is cls  # read once
    hfpd.register_decoding("test_signature_only", mine)
    try:
        assert ParallelDecodingConfig("test_signature_only", {"width": 3}).strategy_settings.width == 3
        with pytest.raises(ValueError, match="did you mean 'width'"):
            ParallelDecodingConfig("test_signature_only", {"widht": 3})
    finally:
        registry._REGISTRY.pop("test_signature_only")


def test_the_factory_refuses_what_is_not_a_settings_class():
    with pytest.raises(ValueError, match="StrategySettings dataclass"):
        hfpd.decoding_strategy("x", dict, run_repeat)

    @dataclass
    class Clashing(hfpd.StrategySettings):
        streamer: int = field(default=0, metadata={"help": "..."})

    with pytest.raises(ValueError, match="arguments generate hands every strategy"):
        hfpd.decoding_strategy("x", Clashing, run_repeat)
