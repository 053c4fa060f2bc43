"""DEER: diffusion drafters through decoding="speculative" (lossless, batched, cached, refused when foreign)
and their diffusion-to-AR alignment trainer."""

from __future__ import annotations

import json

import datasets
import pytest
import torch
from models import ARCHITECTURES, EOS, ForwardRecorder, enabled, prompts, reference, small_prompts, tiny_model
from test_sampling import chi_square_two_sample, outcomes
from test_speculative import fake_hub
from transformers import BertConfig, BertForMaskedLM

import hf_paralleldecode as hfpd
from hf_paralleldecode import DiffusionDrafter
from hf_paralleldecode.drafters import diffusion as diffusion_module
from hf_paralleldecode.training import (
    DiffusionAlignmentCollator,
    DiffusionAlignmentConfig,
    DiffusionAlignmentTrainer,
    diffusion_alignment_loss,
)
from hf_paralleldecode.training.diffusion_alignment import alignment_logits

pytestmark = pytest.mark.core  # the equivalence core: also run on the floor of the tested range (.ci/run)

ATTENTIONS = ("block_causal", "bidirectional")
CONVENTIONS = [dict(shifted=False, boundary_token=False), dict(shifted=True, boundary_token=True),
               dict(shifted=True, boundary_token=False), dict(shifted=False, boundary_token=True)]


def drafter_for(model, attention="block_causal", layers=1, block_size=4, seed=0, **kw):
    torch.manual_seed(seed)
    return DiffusionDrafter.for_target(model, num_hidden_layers=layers, block_size=block_size, attention=attention,
                                       **kw)


# ---- lossless greedy ------------------------------------------------------------------------------
@pytest.mark.parametrize("budget, width", [(1, 1), (4, 1), (8, 3), (64, 8)])
@pytest.mark.parametrize("convention", range(len(CONVENTIONS)))
@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("batch", [1, 3])
def test_matches_stock_greedy(batch, attention, convention, budget, width):
    model = enabled("llama")
    ids, mask = prompts(batch)
    drafter = drafter_for(model, attention, **CONVENTIONS[convention])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                         decoding="speculative", adaptive=False, drafter=drafter, tree_budget=budget, tree_width=width)
    torch.testing.assert_close(out, reference("llama", batch, 24), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_drafter_dtype_sets_the_drafters_dtype_and_output_stays_exact(attention, dtype):
    model = enabled("llama")
    ids, mask = prompts(3)
    drafter = drafter_for(model, attention, shifted=True)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False, tree_budget=8,
                         decoding="speculative", adaptive=False, drafter=drafter, drafter_dtype=dtype, return_dict_in_generate=True)
    torch.testing.assert_close(out.sequences, reference("llama", 3, 24), rtol=0, atol=0)
    assert str(drafter.dtype) == f"torch.{dtype}" and out.stats["drafter_dtype"] == dtype
    assert out.stats["drafter_forwards_per_step"] == 1


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != "llama"])
def test_other_architectures_match_stock_greedy(arch, attention):
    model = enabled(arch)
    ids, mask = prompts(3)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                         decoding="speculative", adaptive=False, drafter=drafter_for(model, attention, shifted=True), tree_budget=8)
    torch.testing.assert_close(out, reference(arch, 3, 24), rtol=0, atol=0)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("extra", [dict(), dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=2),
                                   dict(max_new_tokens=3)], ids=["plain", "rep_penalty", "no_repeat", "short"])
def test_accepted_blocks_eos_and_processors_match_stock(small_vocab, attention, extra):
    ids, mask = small_prompts()
    gen = dict(input_ids=ids, attention_mask=mask, do_sample=False, **{"max_new_tokens": 40, **extra})
    ref_no_eos = small_vocab.generate(**gen, eos_token_id=None)
    eos = int(ref_no_eos[0, ids.shape[1] + min(9, ref_no_eos.shape[1] - ids.shape[1] - 1)])
    if attention == "block_causal":  # the target's own layers, shifted: the first drafted token is the target's
        drafter, tree = drafter_for(small_vocab, layers=2, block_size=6, shifted=True, init_from_target=True), (6, 1)
    else:
        drafter, tree = drafter_for(small_vocab, attention, layers=2, block_size=6), (18, 3)
    for eos_id in (None, eos, EOS):
        kw = dict(gen, eos_token_id=eos_id)
        out = small_vocab.generate(**kw, decoding="speculative", adaptive=False, drafter=drafter, tree_budget=tree[0],
                                   tree_width=tree[1], return_dict_in_generate=True)
        assert torch.equal(out.sequences, small_vocab.generate(**kw)), f"eos={eos_id}"
        if extra.get("max_new_tokens", 40) > 3 and eos_id is None:
            assert out.stats["mean_accepted_length"] > 1.3  # multi-token acceptance really happened


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("steps", [2, 4])
def test_more_denoising_steps_stay_exact_and_cost_one_drafter_forward_each(small_vocab, attention, steps):
    ids, mask = small_prompts()
    drafter = drafter_for(small_vocab, attention, block_size=4)
    drafter.config.denoise_steps = steps
    ref = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    out = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                               decoding="speculative", adaptive=False, drafter=drafter, tree_budget=8, tree_width=2,
                               return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref)
    assert out.stats["drafter_forwards_per_step"] == steps and out.stats["denoise_steps"] == steps


def test_denoise_steps_at_generate_time_override_the_drafter_and_heads_refuse_it(small_vocab):
    ids, mask = small_prompts()
    drafter = drafter_for(small_vocab, block_size=4)
    out = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                               decoding="speculative", adaptive=False, drafter=drafter, denoise_steps=3, return_dict_in_generate=True)
    assert out.stats["denoise_steps"] == 3 and out.stats["drafter_forwards_per_step"] == 3
    assert torch.equal(out.sequences, small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20,
                                                           do_sample=False))
    head = hfpd.DraftHead.for_target(small_vocab, block_size=4)
    with pytest.raises(ValueError, match="Drop denoise_steps"):
        small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, decoding="speculative", adaptive=False,
                             drafter=head, denoise_steps=2)


def test_depth_sets_the_masks_fed_and_stats_report_acceptance(small_vocab):
    ids, mask = small_prompts(1)
    drafter = drafter_for(small_vocab, "block_causal", block_size=8)
    fed = {}
    for depth in (2, 8):
        out = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                                   eos_token_id=None, decoding="speculative", adaptive=False, drafter=drafter, tree_depth=depth,
                                   tree_width=1, return_dict_in_generate=True)
        s = out.stats
        assert s["drafter"] == "diffusion" and s["tree_depth"] == depth and s["drafter_forwards_per_step"] == 1
        assert 1 <= s["tau"] <= depth + 1 and s["max_accepted_length"] <= depth + 1
        assert s["max_accepted_length"] == max(max(step) for step in s["accepted_lengths"])
        assert s["drafter_seconds"] > 0 and s["drafting_cost"] > 0
        fed[depth] = s["drafter_tokens_per_forward"]
    assert fed[8] > fed[2]  # the block grows with the depth


# ---- the drafter's cache ---------------------------------------------------------------------------
def _recorded_marginals(model, drafter, ids, mask, **kw):
    calls = []
    original = diffusion_module.DiffusionState.marginals

    def marginals(self, step):
        out = original(self, step)
        committed, count = step.committed, step.num_committed
        calls.append(([torch.cat([self.context.prompt[r], committed[r, : int(count[r])]]) for r in step.rows.tolist()],
                      out.clone()))
        return out

    diffusion_module.DiffusionState.marginals = marginals
    try:
        kw.setdefault("drafter_dtype", "target")  # the comparisons below are fp32 to fp32
        kw.setdefault("adaptive", False)  # the configured block every step
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=None,
                       decoding="speculative", drafter=drafter, **kw)
    finally:
        diffusion_module.DiffusionState.marginals = original
    return calls


@pytest.mark.parametrize("convention", range(len(CONVENTIONS)))
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_drafting_with_the_prefix_cache_equals_the_training_layout_without_one(attention, convention):
    """Every step's marginals (cached prefix, batch 3, left padding, rows at different lengths) equal the
    alignment trainer's forward over the row's whole committed sequence: train and draft agree."""
    model = enabled("llama")
    drafter = drafter_for(model, attention, layers=2, **CONVENTIONS[convention])
    ids, mask = prompts(3)
    calls = _recorded_marginals(model, drafter, ids, mask, tree_budget=4, tree_width=1)
    assert len(calls) > 3
    for histories, marginals in calls:
        for i, history in enumerate(histories):
            row = [j for j in range(3) if torch.equal(history[: ids.shape[1]], ids[j])][0]
            seq = history[torch.cat([mask[row].bool(), torch.ones(len(history) - ids.shape[1], dtype=torch.bool)])]
            block = torch.tensor(drafter.block_ids())[None, None]
            expected = alignment_logits(drafter, seq[None], torch.ones_like(seq)[None],
                                        torch.tensor([[len(seq) - 1]]), block, 97)[0, 0]
            torch.testing.assert_close(marginals[i], expected, rtol=1e-4, atol=1e-4)


def test_block_causal_feeds_only_new_tokens_bidirectional_feeds_its_window(small_vocab):
    ids, mask = small_prompts(1)
    ids, mask = ids.repeat(1, 4), mask.repeat(1, 4)  # a 28-token prompt
    tokens = {}
    for attention in ATTENTIONS:
        out = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                                   eos_token_id=None, decoding="speculative", adaptive=False,
                                   drafter=drafter_for(small_vocab, attention, block_size=4), tree_budget=4,
                                   tree_width=1, return_dict_in_generate=True)
        tokens[attention] = out.stats["drafter_tokens_per_forward"]
    # cached: the prompt once, then (accepted + 1) + the block per step; uncached: prompt + output every step
    assert tokens["block_causal"] < 20 < ids.shape[1] < tokens["bidirectional"]


def test_context_window_bounds_what_a_bidirectional_drafter_reads(small_vocab):
    ids, mask = small_prompts(1)
    ids, mask = ids.repeat(1, 4), mask.repeat(1, 4)
    drafter = drafter_for(small_vocab, "bidirectional", block_size=4)
    drafter.config.context_window = 6
    out = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False,
                               decoding="speculative", adaptive=False, drafter=drafter, tree_budget=4, return_dict_in_generate=True)
    assert torch.equal(out.sequences, small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20,
                                                           do_sample=False))
    assert out.stats["drafter_tokens_per_forward"] == 6 + 4


def test_one_target_forward_per_step_and_the_drafter_never_runs_the_target(small_vocab):
    ids, mask = small_prompts()
    rec = ForwardRecorder(small_vocab)
    try:
        out = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30, do_sample=False,
                                   eos_token_id=None, decoding="speculative", adaptive=False, drafter=drafter_for(small_vocab),
                                   tree_budget=8, return_dict_in_generate=True)
    finally:
        rec.restore()
    assert len(rec.calls) == out.num_forward_passes


# ---- sampling ------------------------------------------------------------------------------------------
def test_sampling_with_top_k_1_is_greedy(small_vocab):
    ids, mask = small_prompts()
    greedy = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    for attention in ATTENTIONS:
        out = small_vocab.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=True, top_k=1,
                                   decoding="speculative", adaptive=False, drafter=drafter_for(small_vocab, attention), tree_budget=4)
        assert torch.equal(out, greedy)


@pytest.mark.slow
@pytest.mark.parametrize("setting", [dict(attention="block_causal"), dict(attention="bidirectional", shifted=True),
                                     dict(attention="block_causal", denoise_steps=2, temperature=1.3, top_k=4)],
                         ids=["causal", "bidirectional_shifted", "two_steps_temperature_topk"])
def test_sampled_output_distribution_equals_stock(setting):
    vocab, rows = 5, 4000
    model = hfpd.enable(tiny_model("llama", vocab_size=vocab, initializer_range=0.05))
    setting = dict(setting)
    steps = setting.pop("denoise_steps", 1)
    warp = {k: setting.pop(k) for k in ("temperature", "top_k") if k in setting}
    drafter = drafter_for(model, block_size=3, **setting)
    drafter.config.denoise_steps = steps
    ids = torch.tensor([[3, 4, 3, 4, 3]]).repeat(rows, 1)
    kwargs = dict(input_ids=ids, max_new_tokens=3, do_sample=True, eos_token_id=None, **warp)
    torch.manual_seed(0)
    stock = model.generate(**kwargs)
    torch.manual_seed(1)
    ours = model.generate(**kwargs, decoding="speculative", adaptive=False, drafter=drafter, tree_budget=3, tree_width=1,
                          return_dict_in_generate=True)
    assert ours.tokens_per_forward > 1.05, "multi-token acceptance must happen for the test to mean anything"
    p = chi_square_two_sample(outcomes(stock, 5), outcomes(ours.sequences, 5), vocab**3)
    assert p > 1e-3, f"sampled distribution differs from stock sampling (p={p:.2e})"


# ---- refusals, before any forward -------------------------------------------------------------------
def _no_forward(*models):
    def forward(*a, **k):
        raise AssertionError("a forward ran before validation")
    for m in models:
        m.forward = forward


@pytest.mark.parametrize("settings, match", [
    (dict(tree_depth=5), "exceeds the diffusion drafter's block_size=4"),
    (dict(tree_waves=2), "Drop tree_waves"),
    (dict(tree_budget=0), "tree_budget"),
    (dict(denoise_steps=0), "denoise_steps"),
    (dict(denoise_steps=3, tree_depth=2), "exceeds the block of 2 masks"),
])
def test_bad_settings_raise_before_any_forward(settings, match):
    model = hfpd.enable(tiny_model("llama"))
    drafter = drafter_for(model)
    _no_forward(model, drafter.model)
    with pytest.raises(ValueError, match=match):
        model.generate(input_ids=torch.tensor([[5, 6]]), max_new_tokens=4, decoding="speculative", adaptive=False, drafter=drafter,
                       **settings)


def test_a_drafter_for_another_vocabulary_is_refused_before_any_forward():
    model = hfpd.enable(tiny_model("llama"))
    smaller = drafter_for(hfpd.enable(tiny_model("llama", vocab_size=50)))
    _no_forward(model, smaller.model)
    with pytest.raises(ValueError, match="does not share the target's vocabulary"):
        model.generate(input_ids=torch.tensor([[5, 6]]), max_new_tokens=4, decoding="speculative", adaptive=False, drafter=smaller)
    larger = drafter_for(hfpd.enable(tiny_model("llama", vocab_size=120)))  # more rows, recorded for 120
    _no_forward(larger.model)
    with pytest.raises(ValueError, match="built for a 120-token vocabulary"):
        model.generate(input_ids=torch.tensor([[5, 6]]), max_new_tokens=4, decoding="speculative", adaptive=False, drafter=larger)


class _Tokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return dict(self.vocab)


def test_a_drafter_trained_with_another_tokenizer_is_refused(tmp_path):
    model = tiny_model("llama")
    ours = _Tokenizer({f"t{i}": i for i in range(97)})
    theirs = _Tokenizer({f"t{(i * 7) % 97}": i for i in range(97)})  # same size, other token -> id table
    drafter = drafter_for(model, tokenizer=ours)
    drafter.check_target(model, tokenizer=ours)
    with pytest.raises(ValueError, match="another tokenizer"):
        drafter.check_target(model, tokenizer=theirs)
    # the target's own tokenizer, found next to a saved target, is compared too
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({f"w{i}": i for i in range(97)},
                                                                                unk_token="w0")))
    model.save_pretrained(tmp_path / "target")
    fast.save_pretrained(tmp_path / "target")
    saved = hfpd.load_model(tmp_path / "target")
    _no_forward(saved, drafter.model)
    with pytest.raises(ValueError, match="another tokenizer"):
        saved.generate(input_ids=torch.tensor([[5, 6]]), max_new_tokens=4, decoding="speculative", adaptive=False, drafter=drafter)
    drafter_for(model, tokenizer=fast).check_target(saved)  # the same tokenizer passes


@pytest.mark.parametrize("kwargs, match", [
    (dict(), "needs mask_token_id"),
    (dict(mask_token_id=500), "not a token of the wrapped model"),
    (dict(mask_token_id=3, attention="sideways"), "attention"),
    (dict(mask_token_id=3, block_size=0), "block_size"),
    (dict(mask_token_id=3, block_size=2, denoise_steps=3), "denoise_steps"),
    (dict(mask_token_id=3, boundary_token_id=3), "boundary_token_id must differ"),
])
def test_bad_drafter_settings_are_refused(kwargs, match):
    bert = BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=32))
    with pytest.raises(ValueError, match=match):
        DiffusionDrafter(bert, **kwargs)


def test_a_model_whose_vocabulary_cannot_be_read_needs_vocab_size():
    with pytest.raises(ValueError, match="pass vocab_size="):
        DiffusionDrafter(RemoteStyleDiffusionLM(), mask_token_id=97)


def test_block_causal_refuses_an_attention_that_ignores_4d_masks():
    model = tiny_model("llama", vocab_size=98)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        DiffusionDrafter(model, mask_token_id=97, attention="block_causal")


# ---- wrapping what users bring ----------------------------------------------------------------------
class RemoteStyleDiffusionLM(torch.nn.Module):
    """Stands in for a LLaDA-style model loaded with trust_remote_code: input_ids + attention_mask -> .logits."""

    def __init__(self, vocab=98, hidden=32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        layer = torch.nn.TransformerEncoderLayer(hidden, 4, 64, batch_first=True, dropout=0.0)
        self.body = torch.nn.TransformerEncoder(layer, 1)
        self.out = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids, attention_mask=None):
        from types import SimpleNamespace

        pad = None if attention_mask is None else attention_mask == 0
        return SimpleNamespace(logits=self.out(self.body(self.embed(input_ids), src_key_padding_mask=pad)))


def test_any_masked_lm_with_the_targets_vocabulary_drafts_losslessly():
    model = enabled("llama")
    ids, mask = prompts(3)
    torch.manual_seed(0)
    bert = BertForMaskedLM(BertConfig(vocab_size=98, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                      intermediate_size=64)).eval()
    remote = RemoteStyleDiffusionLM().eval()
    for wrapped in (DiffusionDrafter(bert, mask_token_id=97, block_size=4),
                    DiffusionDrafter(remote, mask_token_id=97, block_size=4, shifted=True, vocab_size=98)):
        assert wrapped.config.attention == "bidirectional"  # not a stock *ForCausalLM: no block-causal masks
        assert wrapped.vocab_size == 98
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                             decoding="speculative", adaptive=False, drafter=wrapped, tree_budget=8)
        torch.testing.assert_close(out, reference("llama", 3, 24), rtol=0, atol=0)


def test_init_from_target_copies_the_targets_layers():
    model = tiny_model("llama")
    drafter = drafter_for(model, layers=1, shifted=True, init_from_target=True)
    assert type(drafter.model) is type(model) and drafter.vocab_size == 98
    torch.testing.assert_close(drafter.model.get_input_embeddings().weight[:97], model.get_input_embeddings().weight)
    mine = drafter.model.model.layers[0].state_dict()
    for name, tensor in model.model.layers[0].state_dict().items():
        torch.testing.assert_close(mine[name], tensor)
    with pytest.raises(ValueError, match="block_causal"):
        drafter_for(model, attention="bidirectional", init_from_target=True)


def test_save_load_round_trip_folder_string_and_bundle(tmp_path):
    model = enabled("llama")
    drafter = drafter_for(model, "block_causal", shifted=True, boundary_token=True)
    drafter.save_pretrained(tmp_path / "deer")
    files = sorted(p.name for p in (tmp_path / "deer").iterdir())
    assert {"config.json", "model.safetensors", "diffusion_drafter.json", "README.md"} <= set(files)
    assert "DEER diffusion drafter" in (tmp_path / "deer" / "README.md").read_text()
    assert json.loads((tmp_path / "deer" / "diffusion_drafter.json").read_text())["boundary_token_id"] == 98
    loaded = DiffusionDrafter.from_pretrained(tmp_path / "deer")
    assert loaded.config == drafter.config
    ids, mask = prompts(3)
    ref = reference("llama", 3, 24)
    for given in (loaded, str(tmp_path / "deer")):  # an object, or its folder
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                             decoding="speculative", adaptive=False, drafter=given, tree_budget=8)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    model.save_pretrained(tmp_path / "target")
    bundled = hfpd.load_model(tmp_path / "target", drafter=tmp_path / "deer")
    out = bundled.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False)
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # the attached drafter makes speculative the default
    bundled.save_pretrained(tmp_path / "bundle")
    again = hfpd.load_model(tmp_path / "bundle")
    torch.testing.assert_close(again.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False),
                               ref, rtol=0, atol=0)
    with pytest.raises(ValueError, match="not a DiffusionDrafter folder"):
        DiffusionDrafter.from_pretrained(tmp_path / "target")


def test_push_to_hub_uploads_the_drafter_its_config_and_its_card(monkeypatch):
    uploaded = fake_hub(monkeypatch)
    drafter_for(tiny_model("llama"), boundary_token=True).push_to_hub("me/deer")
    assert uploaded["repo"] == "me/deer"
    assert {"config.json", "model.safetensors", "diffusion_drafter.json", "README.md"} <= set(uploaded)
    assert b"DEER diffusion drafter" in uploaded["README.md"]
    assert json.loads(uploaded["diffusion_drafter.json"])["boundary_token_id"] == 98


# ---- the alignment trainer ----------------------------------------------------------------------------
def test_alignment_loss_closed_form():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5)
    labels = torch.tensor([[1, 2, 3], [0, 4, 4]])
    weights = torch.tensor([[1.0, 0.5, 0.25], [1.0, 0.0, 0.0]])
    ce = -torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    expected = (ce * weights).sum() / weights.sum()
    torch.testing.assert_close(diffusion_alignment_loss(logits, labels, weights), expected)
    torch.testing.assert_close(diffusion_alignment_loss(logits, labels, weights, num_items_in_batch=torch.tensor(10.)),
                               (ce * weights).sum() / 10)
    teacher = torch.randn(2, 3, 5)
    p, logq = torch.softmax(teacher, -1), torch.log_softmax(logits, -1)
    kl = (p * (p.log() - logq)).sum(-1)
    torch.testing.assert_close(diffusion_alignment_loss(logits, labels, weights, teacher, "forward_kl"),
                               (kl * weights).sum() / weights.sum())
    with pytest.raises(ValueError, match="needs teacher_logits"):
        diffusion_alignment_loss(logits, labels, weights, objective="forward_kl")


def _rows(n=12, prompt=5, answer=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        p = torch.randint(3, 97, (prompt,), generator=g).tolist()
        rows.append(dict(input_ids=p + [(p[-1] + 3 * k) % 90 + 3 for k in range(answer)], prompt_ids=p))
    return rows


def test_collator_stages_mask_and_weigh_as_specified():
    model = tiny_model("llama")
    c = drafter_for(model, block_size=4, boundary_token=True).config
    rows = _rows(2)
    one = DiffusionAlignmentCollator(c, stage=1, max_anchors=30, suffix_length=6)(rows)
    assert one["block"].shape[-1] == 7 and (one["block"][..., 0] == c.boundary_token_id).all()
    assert (one["block"][..., 1:] == c.mask_token_id).all()
    seq = torch.tensor(rows[0]["input_ids"])
    for j, a in enumerate(one["anchors"][0].tolist()):
        assert a >= 4  # inside the answer: the prompt's last token at the earliest
        inside = torch.arange(1, 7) + a < len(seq)
        assert torch.equal(one["weights"][0, j], inside.float())
        assert torch.equal(one["labels"][0, j][inside], seq[a + 1: a + 7][: int(inside.sum())])
    two = DiffusionAlignmentCollator(c, stage=2, max_anchors=30, refine_length=4, gamma=2.0)(rows)
    full = two["weights"][0][two["weights"][0, :, -1] > 0][0]
    torch.testing.assert_close(full, torch.exp(-torch.arange(4.0) / 2.0))
    zero = DiffusionAlignmentCollator(c, stage=0, max_anchors=30, seed=3)(rows)
    masked = zero["block"][..., 1:] == c.mask_token_id
    counted = zero["weights"] > 0
    assert (counted <= masked).all() and (masked.sum(-1) >= 1).all()
    shown = ~masked & (zero["anchors"][..., None] >= 0)
    assert torch.equal(zero["block"][..., 1:][shown], zero["labels"][shown])  # unmasked slots hold their token
    spans = DiffusionAlignmentCollator(c, stage=1, span_lengths=[2, 5], seed=0)
    assert {spans(rows)["labels"].shape[-1] for _ in range(12)} == {2, 5}


def _trainer(tmp_path, drafter, rows, **kw):
    args = DiffusionAlignmentConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no",
                                    logging_steps=1, seed=0, **{"learning_rate": 1e-2, "max_steps": 1, **kw})
    return DiffusionAlignmentTrainer(model=drafter.train(), args=args, train_dataset=datasets.Dataset.from_list(rows))


class _PerRowBlocks:
    """A collator whose blocks depend only on each row (its own seeded draw), so regrouping rows into
    micro-batches changes nothing but the grouping."""

    def __init__(self, config):
        self.config = config

    def __call__(self, rows):
        parts = [DiffusionAlignmentCollator(self.config, 2, max_anchors=3, seed=r["input_ids"][0])([r]) for r in rows]
        width = max(p["input_ids"].shape[1] for p in parts)
        out = {}
        for key in parts[0]:
            tensors = [p[key] for p in parts]
            if key in ("input_ids", "attention_mask"):
                tensors = [torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors]
            out[key] = torch.cat(tensors)
        return out


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_gradient_accumulation_is_exact(tmp_path, attention):
    """1 optimizer step of 4 rows == 2 accumulated micro-batches of 2 rows: the loss is divided by the
    step's total weight, not each micro-batch's."""
    model = tiny_model("llama")
    rows = _rows(4, answer=12)
    states = []
    for batch, accumulation in ((4, 1), (2, 2)):
        drafter = drafter_for(model, attention, block_size=3, boundary_token=True)
        trainer = _trainer(tmp_path, drafter, rows, per_device_train_batch_size=batch,
                           gradient_accumulation_steps=accumulation, stage=2, optim="sgd", learning_rate=0.5,
                           lr_scheduler_type="constant", max_grad_norm=1e9)
        trainer.data_collator = _PerRowBlocks(drafter.config)
        trainer.train()
        states.append(torch.cat([p.detach().flatten() for p in drafter.parameters()]))
    start = torch.cat([p.detach().flatten() for p in drafter_for(model, attention, block_size=3,
                                                                  boundary_token=True).parameters()])
    assert not torch.equal(states[0], start)
    torch.testing.assert_close(states[0], states[1], rtol=1e-5, atol=1e-6)


def test_trainer_learns_saves_the_drafter_and_refuses_bad_setups(tmp_path):
    model = tiny_model("llama")
    drafter = drafter_for(model, "block_causal", layers=1, block_size=4, boundary_token=True)
    trainer = _trainer(tmp_path / "run", drafter, _rows(16), max_steps=60, per_device_train_batch_size=8,
                       max_anchors=8, stage=1, suffix_length=4, learning_rate=3e-3)
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "masked_accuracy" in entry]
    assert logs[-1]["loss"] < logs[0]["loss"] * 0.8 and logs[-1]["masked_accuracy"] > logs[0]["masked_accuracy"]
    trainer.save_model(str(tmp_path / "out"))
    loaded = DiffusionDrafter.from_pretrained(tmp_path / "out")
    assert (tmp_path / "out" / "README.md").is_file()
    torch.testing.assert_close(dict(loaded.model.state_dict())["lm_head.weight"],
                               dict(drafter.model.state_dict())["lm_head.weight"])
    with pytest.raises(ValueError, match="needs target_model=|pass target_model="):
        _trainer(tmp_path, drafter, _rows(2), objective="forward_kl")
    with pytest.raises(ValueError, match="stage must be one of"):
        DiffusionAlignmentConfig(output_dir=str(tmp_path), stage=3, use_cpu=True)
    with pytest.raises(ValueError, match="trains a hf_paralleldecode.DiffusionDrafter"):
        DiffusionAlignmentTrainer(model=model, args=DiffusionAlignmentConfig(output_dir=str(tmp_path), use_cpu=True))


def test_kl_objective_distils_the_target(tmp_path):
    model = enabled("llama")
    drafter = drafter_for(model, block_size=3)
    args = DiffusionAlignmentConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no",
                                    logging_steps=1, max_steps=2, objective="forward_kl", per_device_train_batch_size=4,
                                    max_anchors=2, stage=2)
    trainer = DiffusionAlignmentTrainer(model=drafter.train(), args=args, target_model=model,
                                        train_dataset=datasets.Dataset.from_list(_rows(4)))
    trainer.train()
    assert trainer.state.log_history[0]["loss"] > 0


def test_the_shipped_drafter_loads_by_alias_and_belongs_to_the_embedded_model():
    target, tokenizer = hfpd.load_default_model()
    drafter = DiffusionDrafter.from_pretrained("default-deer")
    c = drafter.config
    assert (c.attention, c.shifted, c.target_vocab_size) == ("block_causal", True, 8192)
    drafter.check_target(target)  # vocabulary and tokenizer fingerprint (read next to the embedded model)
    drafter.check_target(target, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="vocabulary"):
        drafter.check_target(tiny_model("llama"))
    inputs = tokenizer(["import os\n\n\ndef walk(top):\n", "class Stack:\n    def push(self, item):\n"],
                       return_tensors="pt", padding=True, padding_side="left")
    ref = target.generate(**inputs, max_new_tokens=32, do_sample=False)
    out = target.generate(**inputs, max_new_tokens=32, do_sample=False, decoding="speculative", adaptive=False, drafter="default-deer",
                          tree_depth=8, tree_width=1, return_dict_in_generate=True)
    assert torch.equal(out.sequences, ref) and out.stats["tau"] > 1.5  # an aligned drafter gets blocks accepted
