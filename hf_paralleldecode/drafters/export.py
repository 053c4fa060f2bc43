"""Export a draft head to the formats other engines read: transformers' DFlash, vLLM speculators, DFlash native.

What it is for
    Users outgrow one machine: a head trained here should be readable by transformers' own assisted
    generation, by vLLM and by SGLang without conversion scripts. :func:`export_draft_head` writes
    one directory per format from the head's single state dict (the body is transformers' DFlash
    drafter, so only names change). The transformers form is run by the tests (its drafts are
    compared with ``tree_width=1`` here); the vLLM / SGLang forms are written with the fields those
    loaders read and checked structurally (config fields, weight names), not run against vLLM or
    SGLang here. Formats and the fields each loader reads:

    * ``"transformers"``: ``MuseGlimmerAssistantModel`` layout (``encoder.fc``,
      ``encoder.output_norm_enc``): ``AutoModel.from_pretrained(dir)`` loads it without remote
      code and ``target.generate(..., assistant_model=draft, speculation_type="dflash")`` runs it
      (transformers>=5.23). It reads ``target_layer_ids``, ``block_size`` and ``mask_token_id`` from
      the config; its block holds the anchor, so its ``block_size`` is the head's ``block_size + 1``.
    * ``"speculators"``: vLLM's speculators config: no top-level ``model_type``,
      ``speculators_model_type="dflash"``, a Qwen3 ``transformer_layer_config`` (``model_type``,
      ``vocab_size``, sizes, heads, ``head_dim``, ``rms_norm_eps``, ``rope_parameters``,
      ``max_position_embeddings``, ``hidden_act``, ``attention_bias``; ``is_causal`` for a
      ``tree_causal`` head), ``draft_vocab_size``, ``target_hidden_size``, ``block_size``,
      ``mask_token_id``, ``aux_hidden_state_layer_ids`` = the head's layer ids **+ 1** (vLLM counts
      the embeddings as capture 0) and ``speculators_config`` (proposal method, number of
      speculative tokens, the verifier's ``name_or_path``), with weights named ``fc`` /
      ``hidden_norm`` / ``layers.*`` / ``norm``.
    * ``"dflash"``: the original authors' layout: a Qwen3 config plus ``block_size``,
      ``num_target_layers`` and ``dflash_config`` (``mask_token_id``, ``target_layer_ids``,
      ``causal`` / ``causal_head``, ``target_hidden_size``), read by SGLang, vLLM's long form and the
      speculators converter; same weight names.

What is lost
    transformers' DFlash path and vLLM / SGLang draft a *chain* with one block forward: tree
    drafting (``tree_budget`` / ``tree_width``) stays in this library. A ``tree_causal`` head has no
    transformers form (its mask cannot be expressed there: refused); in the two vLLM / SGLang forms
    it is written with the causal flag, and those engines feed ``[anchor, MASK, MASK, ...]`` under a
    causal mask: depth 1 is drafted exactly as here, deeper positions see MASK slots where this
    library's branch-conditioned drafting puts the drafted tokens, so expect a lower acceptance
    length there than with ``decoding="speculative"``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

__all__ = ["export_draft_head", "EXPORT_FORMATS"]

EXPORT_FORMATS = ("transformers", "speculators", "dflash")


def _qwen3_layer_config(c, dtype) -> dict:
    return {
        "model_type": "qwen3", "architectures": ["DFlashDraftModel"], "vocab_size": c.target_vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps, "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_position_embeddings,
        "layer_types": ["full_attention"] * c.num_hidden_layers, "attention_bias": False,
        "tie_word_embeddings": False, "dtype": str(dtype).replace("torch.", ""),
    }


def _engine_weights(head) -> dict[str, torch.Tensor]:
    """The body's weights under the DFlash engine names (``fc``, ``hidden_norm``, ``layers.*``, ``norm``)."""
    out = {}
    for name, tensor in head.model.state_dict().items():
        name = name.replace("encoder.fc.", "fc.").replace("encoder.output_norm_enc.", "hidden_norm.")
        out[name] = tensor.detach().contiguous().cpu()
    return out


def export_draft_head(head, directory, format: str = "transformers", verifier_name_or_path: str | None = None) -> Path:
    """Write ``head`` in ``format`` (one of :data:`EXPORT_FORMATS`) to ``directory``; return the directory.

    ``verifier_name_or_path`` (the target's repo id) is written where the format names the verifier
    (speculators: vLLM serves the pair from the head's directory); default: the head's
    ``target_name_or_path``.
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(f"Unknown export format {format!r}; choose one of {EXPORT_FORMATS}.")
    c = head.config
    causal = c.attention == "tree_causal"
    if format == "transformers" and causal:
        raise ValueError(
            "transformers' DFlash drafter attends bidirectionally inside the block and cannot express a "
            "tree_causal head's mask. Export it with format='speculators' or 'dflash' (a causal chain), or run it "
            "with decoding='speculative' here."
        )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = head.dtype
    if format == "transformers":
        body = c.assistant_config()
        body.dtype = dtype
        body.save_pretrained(directory)
        tensors = {k: v.detach().contiguous().cpu() for k, v in head.model.state_dict().items()}
        save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
        return directory
    layer = _qwen3_layer_config(c, dtype)
    if format == "speculators":
        if causal:
            layer["is_causal"] = True  # vLLM's update_dflash overwrites dflash_config: the flag lives here
        config = {
            "architectures": ["DFlashDraftModel"],
            "speculators_model_type": "dflash",
            "speculators_version": "0.9.0",
            "transformer_layer_config": layer,
            "draft_vocab_size": c.target_vocab_size,
            "target_hidden_size": c.target_hidden_size,
            "aux_hidden_state_layer_ids": [i + 1 for i in c.target_layer_ids],
            "block_size": c.block_size + 1,
            "mask_token_id": c.mask_token_id,
            "sample_from_anchor": False,
            "sliding_window_non_causal": False,
            "tie_word_embeddings": False,
            "dtype": layer["dtype"],
            "speculators_config": {
                "algorithm": "dflash",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": c.block_size,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": verifier_name_or_path or c.target_name_or_path,
                             "architectures": [c.target_model_type] if c.target_model_type else []},
            },
        }
    else:  # dflash (z-lab native)
        config = dict(layer)
        config.update(
            block_size=c.block_size + 1,
            num_target_layers=c.target_num_hidden_layers,
            dflash_config={"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
                           "causal": causal, "causal_head": causal, "target_hidden_size": c.target_hidden_size},
        )
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file(_engine_weights(head), directory / "model.safetensors", metadata={"format": "pt"})
    return directory
