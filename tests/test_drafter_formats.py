"""load_drafter: every known layout imports strictly and drafts losslessly; every export reads back and drafts
identically; a wrong folder raises before any forward. (tests/speculators_check.py runs the speculators package.)"""

from __future__ import annotations

import json

import pytest
import torch
from models import enabled, prompts, reference, tiny_model
from safetensors.torch import save_file

import hf_paralleldecode as hfpd
from hf_paralleldecode import DraftHead, Eagle3Drafter, export_drafter, load_drafter
from hf_paralleldecode.decoding.speculative import DraftProposer

pytestmark = pytest.mark.core


def _head(model, attention="block_bidirectional", **kw):
    torch.manual_seed(0)
    return DraftHead.for_target(model, attention=attention, num_hidden_layers=2, block_size=4,
                                initializer_range=0.3, **kw)


def _eagle(model, **kw):
    torch.manual_seed(0)
    return Eagle3Drafter.for_target(model, initializer_range=0.3, **kw)


def _drafts(model, drafter, batch=3, **settings):
    """Greedy output (checked against stock) and every tree the drafter proposed."""
    trees = []
    pack = DraftProposer._pack

    def record(self, nodes, q_store, sample_then_match=False):
        trees.append([tuple(tokens) for tokens, _, _ in nodes])
        return pack(self, nodes, q_store, sample_then_match)

    DraftProposer._pack = record
    try:
        ids, mask = prompts(batch)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False,
                             decoding="speculative", drafter=drafter, drafter_dtype="float32", adaptive=False,
                             **settings)
    finally:
        DraftProposer._pack = pack
    arch = model.config.model_type
    stock = reference(arch, batch, 16) if model is enabled(arch) else model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, decoding="stock")
    torch.testing.assert_close(out, stock, rtol=0, atol=0)
    return trees


def _same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert torch.equal(sa[k].float(), sb[k].float()), k


def _saved_target(model, tmp_path):
    folder = tmp_path / "target"
    model.save_pretrained(folder)
    return folder


# ---- this project's exports read back and draft identically ------------------------------------------------
@pytest.mark.parametrize("fmt,attention", [("transformers", "block_bidirectional"),
                                           ("speculators", "block_bidirectional"), ("speculators", "tree_causal"),
                                           ("speculators", "block_causal"), ("dflash", "block_bidirectional"),
                                           ("dflash", "tree_causal"), ("dflash", "block_causal")])
def test_head_exports_read_back_and_draft_identically(tmp_path, fmt, attention):
    model = enabled("qwen3")
    head = _head(model, attention)
    export_drafter(head, tmp_path / "out", format=fmt, verifier=_saved_target(model, tmp_path))
    again = load_drafter(tmp_path / "out", cache=False)
    assert isinstance(again, DraftHead) and again.config.attention == attention
    assert again.config.block_size == head.config.block_size
    assert again.config.target_layer_ids == head.config.target_layer_ids
    assert again.config.target_vocab_size == head.config.target_vocab_size
    _same_weights(head, again)
    assert _drafts(model, head, tree_budget=8) == _drafts(model, again, tree_budget=8)


@pytest.mark.parametrize("fmt", ["speculators", "eagle3"])
@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "reduced_vocab"])
def test_eagle3_exports_read_back_and_draft_identically(tmp_path, fmt, reduced):
    model = enabled("llama")
    drafter = _eagle(model, draft_vocab_size=48 if reduced else None)
    drafter.bind(model)
    export_drafter(drafter, tmp_path / "out", format=fmt, verifier=_saved_target(model, tmp_path))
    again = load_drafter(tmp_path / "out", cache=False)
    assert isinstance(again, Eagle3Drafter)
    assert again.config.target_layer_ids == drafter.config.target_layer_ids
    assert again.config.draft_vocab_size == drafter.config.draft_vocab_size
    if reduced:
        assert torch.equal(again.draft_token_ids(), drafter.draft_token_ids())
    assert _drafts(model, drafter, tree_budget=8) == _drafts(model, again, tree_budget=8)


# ---- other projects' layouts, written as the notes describe them -------------------------------------------
def _zlab_files(head, folder, *, nested: bool, causal_head: bool):
    c = head.config
    folder.mkdir(parents=True)
    cfg = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
           "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
           "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_theta,
           "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.target_vocab_size,
           "num_target_layers": c.target_num_hidden_layers, "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
           "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": c.target_layer_ids}}
    if nested:
        cfg["dflash_config"]["block_size"] = c.block_size + 1
    else:
        cfg["block_size"] = c.block_size + 1
    if causal_head:
        cfg["dflash_config"]["causal_head"] = True
    (folder / "config.json").write_text(json.dumps(cfg))
    tensors = {k.replace("model.encoder.fc.", "fc.").replace("model.encoder.output_norm_enc.", "hidden_norm.")
               .removeprefix("model."): v for k, v in head.state_dict().items()}
    save_file(tensors, folder / "model.safetensors")


MAIN_ARCHS = ("llama", "qwen2", "qwen3", "mistral")


@pytest.mark.parametrize("nested", [False, True], ids=["top_level_block_size", "nested_block_size"])
@pytest.mark.parametrize("arch", MAIN_ARCHS)
def test_zlab_dflash_imports_strictly_and_drafts_losslessly(tmp_path, nested, arch):
    model = enabled(arch)
    head = _head(model)
    _zlab_files(head, tmp_path / "zlab", nested=nested, causal_head=False)
    again = load_drafter(tmp_path / "zlab")
    assert again.config.attention == "block_bidirectional" and again.config.block_size == 4
    _same_weights(head, again)
    for batch in (1, 3):
        assert _drafts(model, head, batch, tree_budget=8) == _drafts(model, again, batch, tree_budget=8)


def test_jetspec_released_heads_are_block_causal(tmp_path):
    """JetSpec's causal_head: [anchor, MASK x B-1] under a causal mask; per-depth marginals from one forward."""
    model = enabled("qwen3")
    head = _head(model, "block_causal")
    _zlab_files(head, tmp_path / "jetspec", nested=False, causal_head=True)
    again = load_drafter(tmp_path / "jetspec")
    assert again.config.attention == "block_causal" and again.expansion == "marginals"
    assert _drafts(model, head, tree_budget=12, tree_width=3) == _drafts(model, again, tree_budget=12, tree_width=3)
    from hf_paralleldecode.drafters.head import block_layout

    _, _, intra, _ = block_layout("block_causal", 4, torch.zeros(1, 1, dtype=torch.long), torch.tensor([[5]]), 0)
    assert torch.equal(intra, torch.ones(5, 5, dtype=torch.bool).tril())  # block query i ignores block keys j > i


def test_transformers_dflash_assistant_folder_imports(tmp_path):
    """A folder saved by transformers' own MuseGlimmerAssistantModel (no project keys) loads and drafts the same."""
    from hf_paralleldecode.compat import dflash_classes

    model = enabled("qwen3")
    head = _head(model)
    body = head.model
    body.save_pretrained(tmp_path / "assistant")  # transformers' own save: config + encoder.* names
    again = load_drafter(tmp_path / "assistant")
    assert isinstance(again, DraftHead) and again.config.target_vocab_size is None  # not recorded there
    assert type(body).__name__ == dflash_classes()[1].__name__
    assert _drafts(model, head, tree_budget=8) == _drafts(model, again, tree_budget=8)


@pytest.mark.parametrize("arch", MAIN_ARCHS)
def test_speculators_dflash_layout_imports(tmp_path, arch):
    model = enabled(arch)
    head = _head(model)
    folder = tmp_path / "spec"
    export_drafter(head, folder, format="speculators", verifier=_saved_target(model, tmp_path))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("hf_paralleldecode")  # as speculators' own converter writes it
    (folder / "config.json").write_text(json.dumps(cfg))
    again = load_drafter(folder, cache=False)
    assert again.config.target_layer_ids == head.config.target_layer_ids  # aux ids are hidden-state indices (+1)
    assert _drafts(model, head, tree_budget=8) == _drafts(model, again, tree_budget=8)


def _original_eagle3(drafter, folder, binary=True):
    c = drafter.config
    folder.mkdir(parents=True)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_hidden_layers": 1,
           "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
           "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "rope_theta": c.rope_parameters["rope_theta"],
           "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.target_vocab_size,
           "draft_vocab_size": c.draft_vocab_size,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": c.target_layer_ids, "use_aux_hidden_state": True}}
    (folder / "config.json").write_text(json.dumps(cfg))
    state = {k.replace("layers.0.", "midlayer."): v.clone() for k, v in drafter.state_dict().items()}
    if not c.reduced_vocab:  # EAGLE writes the maps anyway
        state["d2t"] = torch.zeros(c.draft_vocab_size, dtype=torch.long)
        state["t2d"] = torch.ones(c.target_vocab_size, dtype=torch.bool)
    if binary:
        torch.save(state, folder / "pytorch_model.bin")
    else:
        save_file(state, folder / "model.safetensors")


@pytest.mark.parametrize("reduced", [False, True], ids=["full_vocab", "reduced_vocab"])
@pytest.mark.parametrize("arch", MAIN_ARCHS)
def test_original_eagle3_layout_imports(tmp_path, reduced, arch):
    model = enabled(arch)
    drafter = _eagle(model, draft_vocab_size=40 if reduced else None, layer_type="llama")  # the layout's layer
    if reduced:
        drafter.set_draft_vocab(torch.arange(0, 80, 2))
        ids = drafter.draft_token_ids()
        assert int(drafter.t2d.sum()) == 40 and torch.equal(ids, torch.arange(0, 80, 2))
    _original_eagle3(drafter, tmp_path / "eagle", binary=not reduced)
    again = load_drafter(tmp_path / "eagle")
    assert isinstance(again, Eagle3Drafter) and again.config.reduced_vocab == reduced
    for batch in (1, 3):
        assert _drafts(model, drafter, batch, tree_budget=8) == _drafts(model, again, batch, tree_budget=8)


def _authors_eagle3(drafter, folder):
    """An EAGLE-3 drafter as the EAGLE authors' code writes it (``eagle/traineagle3``: its config.json, the trainer's
    ``save_16bit_model`` state dict without the frozen embeddings): ``LlamaForCausalLMEagle3``, ``midlayer.*``,
    ``d2t`` / ``t2d`` always, and no record of the tapped layers (``modeling_llama_kv`` derives them from the
    target's depth)."""
    c = drafter.config
    folder.mkdir(parents=True)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
           "hidden_size": c.hidden_size, "initializer_range": 0.02, "intermediate_size": c.intermediate_size,
           "max_position_embeddings": 2048, "model_type": "llama", "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "num_hidden_layers": 1, "pad_token_id": 0,
           "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": False, "torch_dtype": "float32",
           "transformers_version": "4.28.1", "use_cache": True, "vocab_size": c.target_vocab_size,
           "draft_vocab_size": c.draft_vocab_size}
    (folder / "config.json").write_text(json.dumps(cfg))
    state = {k.replace("layers.0.", "midlayer."): v.clone() for k, v in drafter.state_dict().items()}
    state.setdefault("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
    state.setdefault("t2d", torch.ones(c.target_vocab_size, dtype=torch.bool))
    torch.save(state, folder / "pytorch_model.bin")


def _eagle_reference_features(model, ids):
    """The features EAGLE's own target code fuses: the residual stream entering decoder layers 2, L // 2 and L - 3
    (``modeling_llama_kv``: ``all_hidden_states += (hidden_states,)`` before layer ``idx``; vLLM:
    ``aux_hidden_states.append(hidden_states + residual)`` before layer ``idx``), in layer order. transformers'
    ``hidden_states[i]`` is that stream before layer ``i`` (index 0: the embeddings)."""
    L = model.config.num_hidden_layers
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states
    return torch.cat([hs[i] for i in sorted({2, L // 2, L - 3})], dim=-1)


@pytest.mark.parametrize("arch,depth", [*[(a, 8) for a in MAIN_ARCHS], ("llama", 11), ("llama", 32)])
def test_authors_eagle3_checkpoint_without_tap_ids_takes_the_reference_taps_of_its_target(tmp_path, arch, depth):
    from hf_paralleldecode.engine.target import HiddenStateTaps

    model = hfpd.enable(tiny_model(arch, num_hidden_layers=depth))
    drafter = _eagle(model, draft_vocab_size=40, layer_type="llama")
    drafter.set_draft_vocab(torch.arange(0, 80, 2))
    _authors_eagle3(drafter, tmp_path / "eagle")
    again = load_drafter(tmp_path / "eagle", cache=False)
    assert isinstance(again, Eagle3Drafter) and again.config.target_layer_ids is None  # nothing recorded
    with pytest.raises(ValueError, match=r"bind"):
        again.tap_layers  # noqa: B018 - the rule needs the target's depth
    again.bind(model)
    assert again.tap_layers == [1, depth // 2 - 1, depth - 4]  # outputs of the layers before 2, L // 2, L - 3
    ids, _ = prompts(1)
    with HiddenStateTaps(model, again.tap_layers) as taps, torch.no_grad():
        model(input_ids=ids)
        assert torch.equal(taps.features(), _eagle_reference_features(model, ids))
    if depth <= 11:  # drafts as the same weights with the taps named, and stays lossless
        for batch in (1, 3):
            assert _drafts(model, drafter, batch, tree_budget=8) == _drafts(model, again, batch, tree_budget=8)


def test_an_eagle3_checkpoint_without_tap_ids_is_refused_for_a_target_too_shallow_for_the_rule(tmp_path):
    deep = hfpd.enable(tiny_model("llama", num_hidden_layers=8))
    _authors_eagle3(_eagle(deep, layer_type="llama"), tmp_path / "eagle")
    shallow = enabled("llama")  # 2 layers: layers 2, L // 2, L - 3 are not three distinct layers to tap
    ids, mask = prompts(1)
    calls = []
    hook = shallow.register_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.raises(ValueError, match=r"records no tapped layers.*2 layers"):
            shallow.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, decoding="speculative",
                             drafter=str(tmp_path / "eagle"))
    finally:
        hook.remove()
    assert not calls
    with pytest.raises(ValueError, match="records no tapped layers"):
        hfpd.load_model(_saved_target(shallow, tmp_path), drafter=tmp_path / "eagle")


@pytest.mark.parametrize("fmt", ["eagle3", "speculators"])
def test_an_eagle3_drafter_without_tap_ids_exports_the_taps_of_the_target_it_is_bound_to(tmp_path, fmt):
    model = hfpd.enable(tiny_model("llama", num_hidden_layers=8))
    _authors_eagle3(_eagle(model, layer_type="llama"), tmp_path / "eagle")
    drafter = load_drafter(tmp_path / "eagle", cache=False)
    with pytest.raises(ValueError, match="bind"):
        export_drafter(drafter, tmp_path / "unbound", format=fmt, verifier=_saved_target(model, tmp_path))
    drafter.bind(model)
    export_drafter(drafter, tmp_path / "out", format=fmt, verifier=tmp_path / "target")
    again = load_drafter(tmp_path / "out", cache=False)
    assert again.config.target_layer_ids == [1, 3, 4]
    assert _drafts(model, drafter, tree_budget=8) == _drafts(model, again, tree_budget=8)


# ---- wrong folders raise before any forward ------------------------------------------------------------------
def test_a_folder_of_no_known_format_is_refused(tmp_path):
    folder = tmp_path / "x"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="not a drafter checkpoint.*GPT2LMHeadModel"):
        load_drafter(folder)
    with pytest.raises(ValueError, match="no config.json"):
        load_drafter(tmp_path)


def test_missing_or_unexpected_weights_are_refused_naming_them(tmp_path):
    model = enabled("qwen3")
    head = _head(model)
    _zlab_files(head, tmp_path / "zlab", nested=True, causal_head=False)
    from safetensors.torch import load_file

    tensors = load_file(tmp_path / "zlab" / "model.safetensors")
    tensors.pop("fc.weight")
    tensors["extra.weight"] = torch.zeros(2)
    save_file(tensors, tmp_path / "zlab" / "model.safetensors")
    with pytest.raises(ValueError, match=r"z-lab DFlash.*missing model\.encoder\.fc\.weight.*unexpected extra\.weight"):
        load_drafter(tmp_path / "zlab")


def test_draft_head_from_pretrained_never_returns_random_weights(tmp_path):
    model = enabled("llama")
    drafter = _eagle(model)
    _original_eagle3(drafter, tmp_path / "eagle")
    with pytest.raises(ValueError, match="holds a Eagle3Drafter, not a DraftHead"):
        DraftHead.from_pretrained(tmp_path / "eagle")
    head = _head(model)
    export_drafter(head, tmp_path / "dflash", format="dflash")
    _same_weights(head, DraftHead.from_pretrained(tmp_path / "dflash"))  # its own export reads back as a head


def test_a_wrong_drafter_is_refused_before_any_forward(tmp_path):
    model = enabled("llama")
    other = hfpd.enable(tiny_model("llama", vocab_size=77))
    _original_eagle3(_eagle(other), tmp_path / "eagle")
    ids, mask = prompts(1)
    calls = []
    model.register_forward_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="another target"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, decoding="speculative",
                       drafter=str(tmp_path / "eagle"))
    assert not calls


def test_speculators_export_needs_a_verifier_that_loads(tmp_path):
    model = enabled("qwen3")
    head = _head(model, target_name_or_path="not/a-repo-that-exists-here")
    with pytest.raises(ValueError, match="verifier="):
        export_drafter(head, tmp_path / "a", format="speculators")
    target = _saved_target(model, tmp_path)
    export_drafter(head, tmp_path / "b", format="speculators", verifier=target)
    verifier = json.loads((tmp_path / "b" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(target.resolve()), "architectures": ["Qwen3ForCausalLM"]}
    loaded = hfpd.load_model(target)
    export_drafter(head, tmp_path / "c", format="speculators", verifier=loaded)  # the model object itself
    verifier = json.loads((tmp_path / "c" / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["architectures"] == ["Qwen3ForCausalLM"]


@pytest.mark.slow
def test_an_imported_dflash_head_samples_like_stock(tmp_path):
    """Rejection sampling with an imported (z-lab layout) DFlash head's q: distributed as stock sampling."""
    from test_sampling import chi_square_two_sample, outcomes

    vocab, rows = 5, 4000
    model = hfpd.enable(tiny_model("llama", vocab_size=vocab, initializer_range=0.05))
    torch.manual_seed(0)
    head = DraftHead.for_target(model, attention="block_bidirectional", block_size=3)
    _zlab_files(head, tmp_path / "zlab", nested=True, causal_head=False)
    ids = torch.tensor([[3, 4, 3, 4, 3]]).repeat(rows, 1)
    kwargs = dict(input_ids=ids, max_new_tokens=3, do_sample=True, eos_token_id=None)
    torch.manual_seed(0)
    stock = model.generate(**kwargs)
    torch.manual_seed(1)
    ours = model.generate(**kwargs, decoding="speculative", drafter=str(tmp_path / "zlab"), tree_budget=6,
                          tree_width=2, return_dict_in_generate=True)
    assert ours.tokens_per_forward > 1.05, "multi-token acceptance must happen for the test to mean anything"
    p = chi_square_two_sample(outcomes(stock, 5), outcomes(ours.sequences, 5), vocab**3)
    assert p > 1e-3, f"sampled distribution differs from stock sampling (p={p:.2e})"


def test_tree_causal_export_says_what_is_lost(tmp_path, caplog):
    model = enabled("qwen3")
    with caplog.at_level("WARNING"):
        export_drafter(_head(model, "tree_causal"), tmp_path / "d", format="dflash")
    assert "causal chain" in caplog.text and "branch conditioning" in caplog.text


@pytest.mark.parametrize("arch", MAIN_ARCHS)
def test_speculators_eagle3_layout_imports(tmp_path, arch):
    """As speculators writes it (no project key): taps from hidden-state indices, its own embeddings, d2t / t2d."""
    model = enabled(arch)
    drafter = _eagle(model, draft_vocab_size=48)
    drafter.set_draft_vocab(torch.arange(1, 97, 2))
    drafter.bind(model)
    folder = tmp_path / "spec"
    export_drafter(drafter, folder, format="speculators", verifier=_saved_target(model, tmp_path))
    cfg = json.loads((folder / "config.json").read_text())
    cfg.pop("hf_paralleldecode")
    (folder / "config.json").write_text(json.dumps(cfg))
    again = load_drafter(folder, cache=False)
    assert again.config.target_layer_ids == drafter.config.target_layer_ids and again.config.own_embeddings
    assert torch.equal(again.draft_token_ids(), drafter.draft_token_ids())
    for batch in (1, 3):
        assert _drafts(model, drafter, batch, tree_budget=8) == _drafts(model, again, batch, tree_budget=8)
