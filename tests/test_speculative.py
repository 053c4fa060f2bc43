"""decoding="speculative" with draft heads: lossless, batched, one target forward per step, clear errors."""

from __future__ import annotations

import pytest
import torch
from models import (
    ARCHITECTURES,
    EOS,
    ForwardRecorder,
    RecordingStreamer,
    enabled,
    prompts,
    reference,
    small_prompts,
    tiny_model,
)
from test_sampling import chi_square_two_sample, outcomes

import hf_paralleldecode as hfpd
from hf_paralleldecode import DraftHead

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)

KINDS = ("tree_causal", "block_bidirectional")
MAIN_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


def head_for(model, kind, layers=1, block_size=4, seed=0):
    torch.manual_seed(seed)
    return DraftHead.for_target(model, attention=kind, num_hidden_layers=layers, block_size=block_size)


@pytest.mark.parametrize("budget", [1, 2, 8, 64, 256])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("arch", MAIN_ARCHS)
def test_matches_stock_greedy(arch, batch, kind, budget):
    model = enabled(arch)
    ids, mask = prompts(batch)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                         decoding="speculative", drafter=head_for(model, kind), tree_budget=budget)
    torch.testing.assert_close(out, reference(arch, batch, 24), rtol=0, atol=0)


@pytest.mark.parametrize("budget", [2, 8, 32])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch", [1, 3])
def test_context_ngrams_composed_into_the_head_tree_match_stock_greedy(batch, kind, budget):
    model = enabled("llama")
    ids, mask = prompts(batch)
    ids = torch.cat([ids, ids], dim=1)  # the prompt repeats itself: context matches exist
    mask = torch.cat([mask, mask], dim=1)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                         decoding="speculative", drafter=head_for(model, kind), tree_budget=budget,
                         context_matches=3, context_tokens=5, adaptive=False, return_dict_in_generate=True)
    torch.testing.assert_close(out.sequences, ref, rtol=0, atol=0)
    assert out.stats["context_step_share"] > 0 and out.stats["context_matched_step_share"] > 0
    assert out.num_forward_passes <= 24  # one target forward per step, context nodes included


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a not in MAIN_ARCHS])
def test_other_architectures_match_stock_greedy(arch, kind):
    model = enabled(arch)
    ids, mask = prompts(3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                         decoding="speculative", drafter=head_for(model, kind), tree_budget=16)
    torch.testing.assert_close(out, reference(arch, 3, 24), rtol=0, atol=0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("extra", [dict(), dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=2),
                                   dict(max_new_tokens=3)], ids=["plain", "rep_penalty", "no_repeat", "short"])
def test_accepted_branches_eos_and_processors_match_stock(small_vocab, kind, extra):
    ids, mask = small_prompts()
    gen = dict(input_ids=ids, attention_mask=mask, do_sample=False, **{"max_new_tokens": 40, **extra})
    ref_no_eos = small_vocab.generate(**gen, eos_token_id=None)
    eos = int(ref_no_eos[0, ids.shape[1] + min(9, ref_no_eos.shape[1] - ids.shape[1] - 1)])
    head = head_for(small_vocab, kind, layers=2, block_size=6)
    for eos_id in (None, eos, EOS):
        kw = dict(gen, eos_token_id=eos_id)
        out = small_vocab.generate(**kw, decoding="speculative", drafter=head, tree_budget=32, tree_width=3,
                                   adaptive=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, small_vocab.generate(**kw)), f"eos={eos_id}"
        if extra.get("max_new_tokens", 40) > 3 and eos_id is None:
            assert out.stats["mean_accepted_length"] > 1.3  # multi-token acceptance really happened


def test_exactly_one_target_forward_per_step_plus_prefill(small_vocab):
    ids, mask = small_prompts()
    head = head_for(small_vocab, "tree_causal", layers=2, block_size=6)
    rec = ForwardRecorder(small_vocab)
    try:
        out = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                                   eos_token_id=None, decoding="speculative", drafter=head, tree_budget=16,
                                   adaptive=False, return_dict_in_generate=True)
    finally:
        rec.restore()
    steps = out.num_forward_passes - 1
    assert len(rec.calls) == out.num_forward_passes  # the head never runs the target
    assert out.stats["drafter_forwards_per_step"] >= 1 and steps > 0
    assert rec.calls[0]["cached"] == 0 and all(c["cached"] > 0 for c in rec.calls[1:])


def test_statistics_report_tau_head_forwards_and_drafting_cost(small_vocab):
    ids, mask = small_prompts(1)
    for kind, forwards in (("block_bidirectional", 1.0), ("tree_causal", None)):
        out = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                                   decoding="speculative", drafter=head_for(small_vocab, kind), tree_budget=8,
                                   adaptive=False, return_dict_in_generate=True)
        s = out.stats
        assert s["mean_accepted_length"] >= 1 and s["drafting_cost"] > 0 and s["drafter_seconds"] > 0
        if forwards is not None:
            assert s["drafter_forwards_per_step"] == forwards
        assert s["tree_budget"] == 8 and s["tree_depth"] == 4 and s["head"] == kind


def test_streamer_gets_committed_tokens(small_vocab):
    ids, mask = small_prompts(1)
    streamer = RecordingStreamer()
    out = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                               decoding="speculative", drafter=head_for(small_vocab, "tree_causal"), streamer=streamer)
    assert streamer.ended == 1
    assert torch.cat([v.reshape(-1) for v in streamer.values[1:]]).tolist() == out[0, ids.shape[1]:].tolist()


def given_cost(monkeypatch, points):
    """The cost-aware budget's forward cost: ``(tokens, seconds)`` points instead of a measurement."""
    from hf_paralleldecode.decoding import budget

    monkeypatch.setattr(budget, "forward_cost", lambda model: budget.ForwardCost(points))


def linear_cost(monkeypatch, per_token: float):
    """1 for one token, ``per_token`` (of that) for each further token."""
    given_cost(monkeypatch, [(1, 1.0), (256, 1.0 + 255 * per_token)])


def any_drafter(model, kind):
    if kind == "deer":
        from hf_paralleldecode import DiffusionDrafter

        torch.manual_seed(0)
        return DiffusionDrafter.for_target(model, num_hidden_layers=1, block_size=4)
    return head_for(model, kind)


@pytest.mark.parametrize("kind", [*KINDS, "deer"])
@pytest.mark.parametrize("batch", [1, 3])
def test_cost_aware_trees_match_stock_greedy_and_a_steep_cost_feeds_fewer_nodes(monkeypatch, batch, kind):
    model = enabled("llama")
    ids, mask = prompts(batch)
    ids, mask = torch.cat([ids, ids], dim=1), torch.cat([mask, mask], dim=1)  # context matches exist
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    drafter = any_drafter(model, kind)
    chosen = {}
    for per_token in (0.0, 0.5):  # flat: every node pays; steep: a node costs half a forward
        linear_cost(monkeypatch, per_token)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                             decoding="speculative", drafter=drafter, tree_budget=12, tree_width=3,
                             context_matches=2, context_tokens=4, cost_aware=True, adaptive=False,  # compared counts
                             return_dict_in_generate=True)
        torch.testing.assert_close(out.sequences, ref, rtol=0, atol=0)
        assert out.stats["cost_aware"] is True
        chosen[per_token] = out.stats["budget_optional_nodes_per_step"]
    assert chosen[0.5] < chosen[0.0] <= 12


@pytest.mark.parametrize("arch", MAIN_ARCHS)
def test_cost_aware_trees_match_stock_greedy_on_every_main_architecture(monkeypatch, arch):
    model = enabled(arch)
    ids, mask = prompts(3)  # left-padded rows of different lengths
    linear_cost(monkeypatch, 0.2)  # some nodes pay, some do not: trees are cut
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, decoding="speculative",
                         drafter=head_for(model, "block_bidirectional"), tree_budget=16, tree_width=3, cost_aware=True,
                         return_dict_in_generate=True)
    torch.testing.assert_close(out.sequences, reference(arch, 3, 24), rtol=0, atol=0)
    assert out.stats["budget_optional_nodes_per_step"] < 16
    # one per drafting step, plus the plain steps the batch policy chose, plus the prefill
    assert out.num_forward_passes == len(out.stats["accepted_lengths"]) + out.stats["shape_steps"].get("plain", 0) + 1


@pytest.mark.parametrize("settings", [dict(context_matches=2, context_tokens=1, tree_width=4), dict(cost_aware=True)],
                         ids=["context", "cost_aware"])  # context: a 1-token candidate is mostly among the draws
def test_sampled_steps_choose_their_verification_rule_before_the_draws(monkeypatch, settings):
    """Rejection sampling is lossless only averaged over every draw: a rule that switched to it on the draws
    that happen to cover the context candidates, or that a cost-aware cut leaves whole, would be biased."""
    from hf_paralleldecode.decoding.prompt_lookup import ContextNgrams
    from hf_paralleldecode.decoding.speculative import DraftProposer

    linear_cost(monkeypatch, 0.0)  # flat: a cost-aware budget cuts nothing
    steps = []
    pack, candidates = DraftProposer._pack, ContextNgrams.candidates

    def record_candidates(self, counts):
        found = candidates(self, counts)
        steps.append({"candidates": any(found)})
        return found

    def record_pack(self, nodes, q_store, sample_then_match=False):
        if not steps or "rule" in steps[-1]:
            steps.append({"candidates": False})
        steps[-1]["rule"] = sample_then_match
        return pack(self, nodes, q_store, sample_then_match)

    monkeypatch.setattr(ContextNgrams, "candidates", record_candidates)
    monkeypatch.setattr(DraftProposer, "_pack", record_pack)
    model = hfpd.enable(tiny_model("llama", vocab_size=5, initializer_range=0.05))
    ids = torch.tensor([[3, 4, 3, 4, 3, 4, 3]]).repeat(3, 1)
    torch.manual_seed(0)
    model.generate(input_ids=ids, max_new_tokens=12, do_sample=True, eos_token_id=None, decoding="speculative",
                   drafter=head_for(model, "tree_causal", block_size=3), tree_budget=6, **{"tree_width": 2, **settings})
    assert steps and all("rule" in step for step in steps)
    if settings.get("cost_aware"):
        assert all(step["rule"] for step in steps)  # every step: the cut may depend on the draws
    else:
        assert any(step["candidates"] for step in steps)
        assert all(step["rule"] == step["candidates"] for step in steps)


@pytest.mark.slow
@pytest.mark.parametrize("kind", [*KINDS, "deer"])
def test_cost_aware_sampled_output_distribution_equals_stock(monkeypatch, kind):
    """A tree the budget cut is verified by sample-then-match: still distributed as stock sampling."""
    vocab, rows = 5, 4000
    model = hfpd.enable(tiny_model("llama", vocab_size=vocab, initializer_range=0.05))
    head = any_drafter(model, kind)
    given_cost(monkeypatch, [(1, 1.0), (3 * rows, 1.0), (7 * rows, 20.0)])  # flat up to 2 drafted nodes per row
    ids = torch.tensor([[3, 4, 3, 4, 3]]).repeat(rows, 1)
    kwargs = dict(input_ids=ids, max_new_tokens=3, do_sample=True, eos_token_id=None)
    torch.manual_seed(0)
    stock = model.generate(**kwargs)
    torch.manual_seed(1)
    ours = model.generate(**kwargs, decoding="speculative", drafter=head, tree_budget=6, tree_width=2,
                          cost_aware=True, return_dict_in_generate=True)
    assert ours.tokens_per_forward > 1.05, "multi-token acceptance must happen for the test to mean anything"
    assert ours.stats["budget_optional_nodes_per_step"] < 6, "the budget must cut trees for the test to mean anything"
    p = chi_square_two_sample(outcomes(stock, 5), outcomes(ours.sequences, 5), vocab**3)
    assert p > 1e-3, f"sampled distribution differs from stock sampling (p={p:.2e})"


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("warp", [dict(), dict(temperature=1.3, top_k=4),
                                  dict(context_matches=3, context_tokens=2, context_ngram_size=1)],
                         ids=["plain", "temperature_topk", "context_ngrams"])
def test_sampled_output_distribution_equals_stock(kind, warp):
    vocab, rows = 5, 4000
    model = hfpd.enable(tiny_model("llama", vocab_size=vocab, initializer_range=0.05))
    head = head_for(model, kind, layers=1, block_size=3)
    ids = torch.tensor([[3, 4, 3, 4, 3]]).repeat(rows, 1)
    warp = dict(warp)  # parametrize shares the dict between cases
    context = {k: warp.pop(k) for k in list(warp) if k.startswith("context_")}
    kwargs = dict(input_ids=ids, max_new_tokens=3, do_sample=True, eos_token_id=None, **warp)
    torch.manual_seed(0)
    stock = model.generate(**kwargs)
    torch.manual_seed(1)
    ours = model.generate(**kwargs, decoding="speculative", drafter=head, tree_budget=6, tree_width=2,
                          return_dict_in_generate=True, **context)
    assert ours.tokens_per_forward > 1.05, "multi-token acceptance must happen for the test to mean anything"
    p = chi_square_two_sample(outcomes(stock, 5), outcomes(ours.sequences, 5), vocab**3)
    assert p > 1e-3, f"sampled distribution differs from stock sampling (p={p:.2e})"


def test_sampling_with_top_k_1_is_greedy(small_vocab):
    ids, mask = small_prompts()
    greedy = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    for kind in KINDS:
        out = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=True, top_k=1,
                                   decoding="speculative", drafter=head_for(small_vocab, kind), tree_budget=8)
        assert torch.equal(out, greedy)


def _no_forward(model):
    def forward(*a, **k):
        raise AssertionError("a forward ran before validation")
    model.forward = forward


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(), "needs a drafter"),
        (dict(drafter="no/such-head-anywhere"), "neither a local folder nor a Hub repo"),
        (dict(drafter=3), "must be a drafter"),
        (dict(tree_budget=0), "tree_budget"),
        (dict(tree_width=0), "tree_width"),
        (dict(tree_depth=0), "tree_depth"),
        (dict(tree_budget=2.5), "tree_budget"),
        (dict(tree_waves=0), "tree_waves"),
        (dict(tree_waves=1.5), "tree_waves"),
        (dict(drafter_dtype="int8"), "drafter_dtype"),
        (dict(drafter_dtype=torch.int64), "drafter_dtype"),
        (dict(drafter_dtype="fp32"), "drafter_dtype"),
    ],
)
def test_bad_settings_raise_before_any_forward(settings, match):
    model = hfpd.enable(tiny_model("llama"))
    if "drafter" not in settings:
        settings = dict(settings, drafter=head_for(model, "tree_causal")) if settings else settings
    _no_forward(model)
    with pytest.raises(ValueError, match=match):
        model.generate(input_ids=torch.tensor([[5, 6]]), max_new_tokens=4, decoding="speculative", **settings)


@pytest.mark.parametrize("budget", [8, 64])
def test_more_waves_fill_larger_trees_and_stay_exact(small_vocab, budget):
    """A causal head's exact best-first tree is capped by its waves; tree_waves lifts the cap losslessly."""
    model = small_vocab
    ids, mask = small_prompts(3)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, decoding="stock")
    head = head_for(model, "tree_causal", block_size=4)
    runs = {}
    for waves in (None, 40):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                             decoding="speculative", drafter=head, tree_budget=budget, tree_width=2,
                             tree_waves=waves, adaptive=False, return_dict_in_generate=True)
        assert torch.equal(out.sequences, ref)
        assert out.stats["drafter_forwards_per_step"] <= (waves or 4) and out.stats["tree_waves"] == (waves or 4)
        runs[waves] = out.stats
    assert runs[40]["drafter_forwards_per_step"] >= runs[None]["drafter_forwards_per_step"]
    if budget == 64:  # 4 waves x width 2 cannot hold 64 nodes; 40 waves fill more of the budget
        assert runs[40]["drafter_forwards_per_step"] > runs[None]["drafter_forwards_per_step"]


def test_tree_waves_with_a_block_head_is_refused():
    model = hfpd.enable(tiny_model("llama"))
    _no_forward(model)
    with pytest.raises(ValueError, match="tree_waves.*Drop tree_waves"):
        model.generate(input_ids=torch.tensor([[5, 6]]), max_new_tokens=4, decoding="speculative",
                       drafter=head_for(model, "block_bidirectional"), tree_waves=3)


def test_block_head_depth_beyond_its_block_is_refused():
    model = hfpd.enable(tiny_model("llama"))
    head = head_for(model, "block_bidirectional", block_size=4)
    _no_forward(model)
    with pytest.raises(ValueError, match="block_size=4"):
        model.generate(input_ids=torch.tensor([[5, 6]]), max_new_tokens=4, decoding="speculative", drafter=head,
                       tree_depth=5)


@pytest.mark.parametrize("change", [dict(hidden_size=48), dict(vocab_size=101), dict(num_hidden_layers=3)])
def test_head_for_another_target_is_refused_before_any_forward(change):
    head = head_for(tiny_model("llama"), "tree_causal")
    other = hfpd.enable(tiny_model("llama", **change))
    _no_forward(other)
    with pytest.raises(ValueError, match="built for another target"):
        other.generate(input_ids=torch.tensor([[5, 6]]), max_new_tokens=4, decoding="speculative", drafter=head)


def test_head_saves_only_itself_and_round_trips(tmp_path):
    model = enabled("qwen3")
    head = head_for(model, "block_bidirectional", layers=2)
    head.save_pretrained(tmp_path)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["README.md", "config.json", "model.safetensors"]
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert not any("embed" in k or "lm_head" in k for k in keys)  # the target's weights are never saved
    loaded = DraftHead.from_pretrained(tmp_path)
    assert loaded.config.attention == "block_bidirectional" and loaded.config.target_layer_ids == \
        head.config.target_layer_ids
    for a, b in zip(head.state_dict().values(), loaded.state_dict().values()):
        assert torch.equal(a, b)
    ids, mask = prompts(3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                         decoding="speculative", drafter=loaded, tree_budget=8)
    assert torch.equal(out, reference("qwen3", 3, 24))
    assert "draft head" in (tmp_path / "README.md").read_text()


def test_for_target_spreads_tapped_layers_and_validates_config():
    model = tiny_model("llama", num_hidden_layers=12)
    head = DraftHead.for_target(model, num_hidden_layers=3)
    assert head.config.target_layer_ids == [1, 5, 9]
    assert head.config.hidden_size == 32 and head.config.target_vocab_size == 97
    with pytest.raises(ValueError, match="attention"):
        DraftHead.for_target(model, attention="bidirectional")
    with pytest.raises(ValueError, match="target_layer_ids"):
        DraftHead.for_target(model, target_layer_ids=[12])


def test_bundle_round_trip_and_head_only_repo(tmp_path):
    target = tiny_model("qwen3")
    target.save_pretrained(tmp_path / "target")
    head = head_for(target, "tree_causal", layers=2)
    head.save_pretrained(tmp_path / "head")
    ids, mask = prompts(3)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, return_dict_in_generate=True)
    ref = target.generate(**gen).sequences

    # (b) a head-only folder attached to its target: generate() drafts with it by default
    model = hfpd.load_model(tmp_path / "target", drafter=tmp_path / "head")
    out = model.generate(**gen, tree_budget=8)
    assert out.decoding == "speculative" and torch.equal(out.sequences, ref)

    # (a) the bundle: target + drafter/ + a config naming it; loads back with its head and settings
    model.parallel_decoding_config = hfpd.ParallelDecodingConfig("speculative", {"tree_budget": 4, "tree_width": 2})
    model.save_pretrained(tmp_path / "bundle")
    assert (tmp_path / "bundle" / "drafter" / "model.safetensors").is_file()
    saved = hfpd.ParallelDecodingConfig.from_pretrained(tmp_path / "bundle")
    assert saved.drafter == "drafter" and saved.settings == {"tree_budget": 4, "tree_width": 2}
    bundle = hfpd.load_model(tmp_path / "bundle")
    out = bundle.generate(**gen, adaptive=False)  # the configured tree every step: the head drafts each one
    assert out.decoding == "speculative" and out.stats["tree_budget"] == 4 and torch.equal(out.sequences, ref)
    assert out.stats["drafter_forwards_per_step"] >= 1
    assert not any(k.startswith("draft") or "_hfpd" in k for k in bundle.state_dict())  # the head is not a submodule
    assert torch.equal(bundle.generate(**gen, decoding="stock").sequences, ref)


def test_loading_a_head_for_another_target_is_refused(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "target")
    head_for(tiny_model("llama", hidden_size=48), "tree_causal").save_pretrained(tmp_path / "head")
    with pytest.raises(ValueError, match="built for another target"):
        hfpd.load_model(tmp_path / "target", drafter=tmp_path / "head")


def _drafter_folder(kind, target, folder):
    drafter = head_for(target, "tree_causal") if kind == "head" else \
        hfpd.Eagle3Drafter.for_target(target) if kind == "eagle3" else hfpd.DiffusionDrafter.for_target(target)
    drafter.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["head", "eagle3", "deer"])
def test_models_loaded_with_one_drafter_folder_each_own_their_drafter(tmp_path, kind):
    """load_model attaches a drafter of the model's own, on its dtype: loading a bf16 then an fp32 model from one
    drafter folder leaves the bf16 model's drafter bf16, and one model's runs never move the other's drafter."""
    target = tiny_model("llama")
    target.save_pretrained(tmp_path / "target")
    folder = _drafter_folder(kind, target, tmp_path / "drafter")
    half = hfpd.load_model(tmp_path / "target", drafter=folder, dtype=torch.bfloat16)
    full = hfpd.load_model(tmp_path / "target", drafter=folder)
    a, b = hfpd.integration.attached_drafter(half), hfpd.integration.attached_drafter(full)
    assert a is not b and a.dtype == torch.bfloat16 and b.dtype == torch.float32
    ids, mask = prompts(2)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    assert torch.equal(full.generate(**gen, drafter_dtype="bfloat16"), full.generate(**gen, decoding="stock"))
    assert a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16  # drafter_dtype casts the model's own drafter
    half.generate(**gen, drafter_dtype="target")
    assert a.dtype == torch.bfloat16 and b.dtype == torch.bfloat16


def test_a_drafter_object_given_to_load_model_is_copied_not_moved(tmp_path):
    target = tiny_model("llama")
    target.save_pretrained(tmp_path / "target")
    head = head_for(target, "tree_causal").bind(target)
    model = hfpd.load_model(tmp_path / "target", drafter=head, dtype=torch.bfloat16)
    own = hfpd.integration.attached_drafter(model)
    assert own is not head and own.dtype == torch.bfloat16 and head.dtype == torch.float32
    assert head.target is target  # the object given keeps its binding
    assert all(torch.equal(p.float(), q.bfloat16().float()) for p, q in zip(own.parameters(), head.parameters()))


def test_a_drafter_folder_passed_to_generate_is_cached_per_device_and_dtype(tmp_path):
    """drafter=PATH loads once per folder, device and dtype: a run in bf16 never moves the fp32 copy other models
    use."""
    from hf_paralleldecode import load_drafter

    target = hfpd.enable(tiny_model("llama"))
    folder = str(_drafter_folder("eagle3", target, tmp_path / "drafter"))
    full = load_drafter(folder, device="cpu", dtype=torch.float32)
    assert load_drafter(folder, device="cpu", dtype=torch.float32) is full  # cached
    ids, mask = prompts(2)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, decoding="speculative",
               drafter=folder)
    ref = target.generate(**{**gen, "decoding": "stock", "drafter": None})
    assert torch.equal(target.generate(**gen, drafter_dtype="bfloat16"), ref)
    assert full.dtype == torch.float32
    half = load_drafter(folder, device="cpu", dtype=torch.bfloat16)
    assert half is not full and half.dtype == torch.bfloat16
    assert torch.equal(target.generate(**gen, drafter_dtype="float32"), ref)
    assert half.dtype == torch.bfloat16 and full.dtype == torch.float32


def test_config_names_the_drafter_outside_settings():
    with pytest.raises(ValueError, match="drafter="):
        hfpd.ParallelDecodingConfig("speculative", {"drafter": "x"})
    assert hfpd.ParallelDecodingConfig("speculative", drafter="org/head").drafter == "org/head"


def fake_hub(monkeypatch) -> dict:
    """HfApi without a network: ``create_repo`` succeeds, ``upload_folder`` records the files (and the repo)."""
    import huggingface_hub

    uploaded = {}

    class FakeRepo:
        def __init__(self, repo_id):
            self.repo_id = repo_id

    def upload_folder(self, folder_path, repo_id, **kwargs):
        from pathlib import Path

        uploaded.update({p.name: p.read_bytes() for p in Path(folder_path).iterdir()}, repo=repo_id)
        return "ok"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", lambda self, repo_id, **kw: FakeRepo(repo_id))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    return uploaded


def test_push_to_hub_uploads_the_head_its_config_and_its_card(monkeypatch, tmp_path):
    uploaded = fake_hub(monkeypatch)
    head_for(tiny_model("llama"), "block_bidirectional").push_to_hub("me/head")
    assert uploaded["repo"] == "me/head"
    assert {"config.json", "model.safetensors", "README.md"} <= set(uploaded)
    assert b"DFlash block-bidirectional draft head" in uploaded["README.md"]


def test_custom_generate_on_a_stock_model_and_per_step_accepted_lengths(small_vocab):
    stock = tiny_model("qwen3", vocab_size=8)  # not enabled
    ids, mask = small_prompts()
    head = head_for(stock, "block_bidirectional", layers=2, block_size=6)
    ref = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    out = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                         custom_generate=hfpd.speculative, drafter=head, tree_budget=16, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    lengths = out.stats["accepted_lengths"]
    plain = out.stats["shape_steps"].get("plain", 0)  # (plain steps draft nothing: not in the drafter's statistics)
    assert len(lengths) == out.num_forward_passes - 1 - plain and all(1 <= t <= 7 for step in lengths for t in step)
    flat = [t for step in lengths for t in step]
    assert abs(sum(flat) / len(flat) - out.stats["mean_accepted_length"]) < 1e-9


def test_drafter_given_as_a_folder_and_a_bundle_whose_config_does_not_name_it(tmp_path):
    target = tiny_model("qwen3")
    head = head_for(target, "block_bidirectional")
    target.save_pretrained(tmp_path)
    head.save_pretrained(tmp_path / "drafter")
    ids, mask = prompts(3)
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False)
    ref = target.generate(**gen)
    out = hfpd.enable(target).generate(**gen, decoding="speculative", drafter=str(tmp_path / "drafter"))
    assert torch.equal(out, ref)
    hfpd.ParallelDecodingConfig("speculative", {"tree_budget": 8}).save_pretrained(tmp_path)
    bundle = hfpd.load_model(tmp_path)
    out = bundle.generate(**gen, return_dict_in_generate=True)
    assert out.decoding == "speculative" and out.stats["tau"] >= 1 and torch.equal(out.sequences, ref)


@pytest.mark.parametrize("dtype", ["bfloat16", torch.float16, "float32", "target"])
@pytest.mark.parametrize("kind", KINDS)
def test_drafter_dtype_runs_the_head_in_that_dtype_and_output_stays_exact(kind, dtype):
    from hf_paralleldecode.drafters.loading import DRAFTER_DTYPES

    model = enabled("llama")
    ids, mask = prompts(3)
    head = head_for(model, kind)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, tree_budget=8,
                         decoding="speculative", drafter=head, drafter_dtype=dtype, return_dict_in_generate=True)
    torch.testing.assert_close(out.sequences, reference("llama", 3, 24), rtol=0, atol=0)
    want = model.dtype if dtype == "target" else DRAFTER_DTYPES.get(dtype, dtype)
    assert head.dtype == want and out.stats["drafter_dtype"] == str(want).removeprefix("torch.")
    assert out.stats["tau"] >= 1


@pytest.mark.parametrize("native", [True, False])
def test_cpu_preset_runs_drafters_in_bf16_only_on_cpus_with_native_bf16(monkeypatch, native):
    from hf_paralleldecode import hardware

    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: native)
    assert hfpd.hardware_preset("cpu")["speculative"]["drafter_dtype"] == ("bfloat16" if native else "target")
    for cc in [(8, 0), (9, 0), (12, 0)]:  # GPUs: the target's dtype (bf16 models there already)
        assert hfpd.hardware_preset(cc)["speculative"]["drafter_dtype"] == "target"
    model = enabled("llama")
    ids, mask = prompts(2)
    head = head_for(model, "block_bidirectional")
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                         decoding="speculative", drafter=head, return_dict_in_generate=True)
    assert out.stats["drafter_dtype"] == ("bfloat16" if native else "float32")
    assert torch.equal(out.sequences, reference("llama", 2, 16))
    with pytest.raises(ValueError, match="drafter_dtype"):
        hfpd.ParallelDecodingConfig("speculative", {"drafter_dtype": "fp8"})


def test_a_drafter_named_by_folder_is_loaded_once_until_its_files_change(tmp_path):
    import os

    from hf_paralleldecode.drafters.loading import load_drafter

    target = tiny_model("llama")
    head_for(target, "block_bidirectional").save_pretrained(tmp_path / "head")
    first = load_drafter(str(tmp_path / "head"))
    assert load_drafter(str(tmp_path / "head")) is first and load_drafter(tmp_path / "head") is first
    weights = next((tmp_path / "head").glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # rewritten on disk
    assert load_drafter(str(tmp_path / "head")) is not first
    assert load_drafter("default-deer") is load_drafter("default-deer")


def test_checkpoint_settings_belong_to_its_drafter_not_to_one_passed_in_the_call():
    model = enabled("qwen2")
    ids, mask = prompts(2)
    own, other = head_for(model, "block_bidirectional"), head_for(model, "tree_causal", seed=1)
    from hf_paralleldecode.integration import attach_drafter

    bundle = hfpd.enable(tiny_model("qwen2"))
    attach_drafter(bundle, own)
    bundle.parallel_decoding_config = hfpd.ParallelDecodingConfig("speculative", {"tree_budget": 3}, drafter="drafter")
    gen = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, return_dict_in_generate=True)
    assert bundle.generate(**gen).stats["tree_budget"] == 3  # its own drafter: its settings
    out = bundle.generate(**gen, drafter=other)  # another drafter: the strategy's defaults (the preset)
    assert out.stats["tree_budget"] == hfpd.hardware_preset("cpu")["speculative"]["tree_budget"]
    assert out.stats["head"] == "tree_causal" and torch.equal(out.sequences, reference("qwen2", 2, 12))
