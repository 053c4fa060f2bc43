"""export_draft_head: transformers' DFlash path runs the export; vLLM / DFlash-native configs carry what their loaders need."""

from __future__ import annotations

import json

import pytest
import torch
from models import tiny_model
from safetensors import safe_open

import hf_paralleldecode as hfpd
from hf_paralleldecode import DraftHead, export_draft_head
from hf_paralleldecode.decoding import speculative as spec_module


def _head(kind="block_bidirectional"):
    target = hfpd.enable(tiny_model("qwen3", num_hidden_layers=4, vocab_size=16))
    torch.manual_seed(0)
    # a large init so that a random head drafts varied tokens (a comparison of drafts must mean something)
    head = DraftHead.for_target(target, attention=kind, num_hidden_layers=2, block_size=4, target_layer_ids=[0, 2],
                                initializer_range=0.5, target_name_or_path="org/tiny-qwen3")
    return target, head


def _keys(path):
    with safe_open(path, "pt") as f:
        return set(f.keys())


def test_transformers_export_runs_in_stock_dflash_generation_with_the_same_drafts(tmp_path, monkeypatch):
    from transformers import AutoModel
    from transformers.generation import candidate_generator as cg

    target, head = _head()
    export_draft_head(head, tmp_path, format="transformers")
    draft = AutoModel.from_pretrained(tmp_path)  # no remote code
    assert type(draft).__name__ == "MuseGlimmerAssistantModel" and draft.config.block_size == 5
    assert "encoder.fc.weight" in _keys(tmp_path / "model.safetensors")

    ids = torch.tensor([[3, 4, 5, 6, 7, 3, 4, 9]])
    ref = target.generate(input_ids=ids, max_new_tokens=24, do_sample=False, decoding="stock")

    theirs, ours = [], []
    orig = cg.DFlashTokenCandidateGenerator.get_candidates

    def record_theirs(self, input_ids, *a, **k):
        out = orig(self, input_ids, *a, **k)
        if out[0].shape[1] > input_ids.shape[1]:
            theirs.append(out[0][0, input_ids.shape[1]:].tolist())
        return out

    monkeypatch.setattr(cg.DFlashTokenCandidateGenerator, "get_candidates", record_theirs)
    out = target.generate(input_ids=ids, max_new_tokens=24, do_sample=False, assistant_model=draft,
                          speculation_type="dflash", decoding="stock")
    assert torch.equal(out, ref)

    propose = spec_module.DraftProposer.propose

    def record_ours(self):
        tree = propose(self)
        ours.append(tree.tokens[0, 1 : int(tree.num_nodes[0])].tolist())
        return tree

    monkeypatch.setattr(spec_module.DraftProposer, "propose", record_ours)
    out = target.generate(input_ids=ids, max_new_tokens=24, do_sample=False, decoding="speculative", drafter=head,
                          tree_width=1, tree_budget=4, drafter_dtype="target",  # fp32, as the exported drafter
                          adaptive=False)  # a chain every step, as stock DFlash: the drafts are compared step by step
    assert torch.equal(out, ref)
    n = min(len(theirs), len(ours))
    assert n >= 3 and len({tuple(d) for d in ours}) > 1, "drafts must vary for the comparison to mean something"
    k = [min(len(t), len(o)) for t, o in zip(theirs, ours)]  # the last block is cut by the token budget
    assert [t[:m] for t, m in zip(theirs, k)] == [o[:m] for o, m in zip(ours, k)]


@pytest.mark.parametrize("kind", ["block_bidirectional", "tree_causal"])
def test_speculators_config_has_what_vllm_requires(tmp_path, kind):
    target, head = _head(kind)
    target.save_pretrained(tmp_path / "target")
    export_draft_head(head, tmp_path, format="speculators", verifier=tmp_path / "target")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert "model_type" not in cfg and cfg["speculators_model_type"] == "dflash"
    assert cfg["aux_hidden_state_layer_ids"] == [1, 3]  # vLLM counts the embeddings as capture 0
    assert cfg["mask_token_id"] == head.config.mask_token_id and cfg["draft_vocab_size"] == 16
    layer = cfg["transformer_layer_config"]
    for key in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
                "max_position_embeddings", "hidden_act", "attention_bias"):
        assert key in layer, key
    assert layer["model_type"] == "qwen3" and layer["hidden_act"] == "silu" and layer["attention_bias"] is False
    assert layer.get("is_causal", False) is (kind == "tree_causal")
    proposal = cfg["speculators_config"]["proposal_methods"][0]
    assert proposal["speculative_tokens"] == 4
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": str((tmp_path / "target").resolve()),
                                                     "architectures": ["Qwen3ForCausalLM"]}  # class names
    _check_engine_weights(tmp_path, head)


@pytest.mark.parametrize("kind", ["block_bidirectional", "tree_causal"])
def test_dflash_native_config_and_weights(tmp_path, kind):
    _, head = _head(kind)
    export_draft_head(head, tmp_path, format="dflash")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 5 and cfg["num_target_layers"] == 4
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 2]  # HF "output of layer i" ids
    assert cfg["dflash_config"]["causal"] is (kind == "tree_causal")
    _check_engine_weights(tmp_path, head)


def _check_engine_weights(path, head):
    keys = _keys(path / "model.safetensors")
    assert {"fc.weight", "hidden_norm.weight", "norm.weight"} <= keys
    assert not any(k.startswith(("encoder.", "model.")) for k in keys)
    body = {k.replace("encoder.fc.", "fc.").replace("encoder.output_norm_enc.", "hidden_norm.")
            for k in head.model.state_dict()}
    assert keys == body  # a name round trip: every body tensor, under the engine's name
    with safe_open(path / "model.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor("fc.weight"), head.model.encoder.fc.weight.detach())


def test_tree_causal_head_has_no_transformers_form_and_formats_are_checked(tmp_path):
    _, head = _head("tree_causal")
    with pytest.raises(ValueError, match="cannot express"):
        export_draft_head(head, tmp_path, format="transformers")
    with pytest.raises(ValueError, match="Unknown export format"):
        export_draft_head(head, tmp_path, format="onnx")


@pytest.mark.parametrize("kind", ["head", "eagle3"])
def test_unknown_keywords_are_a_type_error_as_python_raises_them(tmp_path, kind):
    """An unexpected keyword is the caller's typo: TypeError naming it, as Python raises for any function."""
    target, head = _head()
    drafter = head if kind == "head" else hfpd.Eagle3Drafter.for_target(target)
    with pytest.raises(TypeError, match="unknown"):
        hfpd.export_drafter(drafter, tmp_path / "a", format="speculators", unknown=1)
    with pytest.raises(TypeError, match="unknown"):
        export_draft_head(head, tmp_path / "b", format="dflash", unknown=1)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    with pytest.raises(TypeError, match="bogus"):
        hfpd.load_drafter(tmp_path, bogus=1)
    # the verifier's other name still works, and only one of the two names may be given
    export_draft_head(head, tmp_path / "c", format="dflash", verifier_name_or_path="org/tiny-qwen3")
    with pytest.raises(TypeError, match="verifier= and verifier_name_or_path="):
        hfpd.export_drafter(head, tmp_path / "d", format="dflash", verifier="a", verifier_name_or_path="b")
