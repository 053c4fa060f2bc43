"""Export a drafter to the formats other engines read: transformers' DFlash, vLLM speculators, DFlash native, EAGLE-3.

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

    * EAGLE-3 drafters (:class:`~.eagle3.Eagle3Drafter`): ``"speculators"`` (``speculators_model_type
      = "eagle3"``, ``layers.0.*``, hidden-state tap indices, ``norm_before_residual`` always written,
      ``embed_tokens`` written as speculators saves it) and ``"eagle3"`` (the original EAGLE / SpecForge
      layout: ``midlayer.*``, ``LlamaForCausalLMEagle3``, ``eagle_config`` tap ids as SpecForge writes
      them; Llama-style layers only).

Every export reads back here (:func:`hf_paralleldecode.load_drafter`) and drafts identically: what the
format has no field for (the target's facts, a ``tree_causal`` head's attention) is written under the
``hf_paralleldecode`` key, which other readers ignore. The ``speculators`` exports name the verifier
(``verifier.name_or_path``, ``verifier.architectures`` as class names): speculators and vLLM load its
embeddings and LM head from there, so it must be a folder or Hub repo that loads. It comes from
``verifier=`` (the target model, its folder or repo id) or the drafter's ``target_name_or_path``;
an export whose verifier does not load is refused.

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
import logging
from pathlib import Path

import torch
from safetensors.torch import save_file

from .formats import PROJECT_KEY

__all__ = ["export_drafter", "export_draft_head", "EXPORT_FORMATS", "EAGLE3_EXPORT_FORMATS"]

logger = logging.getLogger(__name__)

EXPORT_FORMATS = ("transformers", "speculators", "dflash")
EAGLE3_EXPORT_FORMATS = ("speculators", "eagle3")


def _layer_config(c, dtype, model_type="qwen3", architectures=("DFlashDraftModel",)) -> dict:
    rope = c.rope_parameters or {"rope_type": "default", "rope_theta": c.rope_theta}
    return {
        "model_type": model_type, "architectures": list(architectures), "vocab_size": c.target_vocab_size,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim, "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps, "rope_parameters": dict(rope), "rope_theta": rope.get("rope_theta", 10000.0),
        "max_position_embeddings": c.max_position_embeddings,
        "layer_types": ["full_attention"] * c.num_hidden_layers, "attention_bias": False,
        "tie_word_embeddings": False, "dtype": str(dtype).replace("torch.", ""),
    }


def _facts(c, **extra) -> dict:
    """What the foreign formats have no field for, under :data:`~.formats.PROJECT_KEY`."""
    keys = ("target_hidden_size", "target_vocab_size", "target_num_hidden_layers", "target_model_type",
            "target_name_or_path")
    return {PROJECT_KEY: {**{k: getattr(c, k) for k in keys}, **extra}}


def _engine_weights(head) -> dict[str, torch.Tensor]:
    """The body's weights under the DFlash engine names (``fc``, ``hidden_norm``, ``layers.*``, ``norm``)."""
    out = {}
    for name, tensor in head.model.state_dict().items():
        name = name.replace("encoder.fc.", "fc.").replace("encoder.output_norm_enc.", "hidden_norm.")
        out[name] = tensor.detach().contiguous().cpu()
    return out


def _verifier(verifier, default) -> tuple[str, list[str]]:
    """``(name_or_path, architectures)`` of the verifier a speculators export names; ``ValueError`` when it does
    not load (speculators and vLLM read the verifier's embeddings and LM head from it)."""
    if verifier is None:
        verifier = default
    if verifier is None:
        raise ValueError("A speculators export names its verifier (speculators and vLLM load its embeddings and LM "
                         "head): pass verifier= (the target model, its folder or its Hub repo id).")
    if hasattr(verifier, "config"):  # the target model itself
        name = getattr(verifier.config, "name_or_path", None) or ""
        archs = list(getattr(verifier.config, "architectures", None) or [type(verifier).__name__])
        if not name:
            raise ValueError("The target model has no name_or_path: save it (model.save_pretrained(folder)) and pass "
                             "verifier=folder.")
        _, archs_on_disk = _verifier(name, None)
        return name, archs_on_disk or archs
    name = str(verifier)
    folder = Path(name)
    if folder.is_dir():
        config = folder / "config.json"
        if not config.is_file():
            raise ValueError(f"verifier={name!r} is a folder without a config.json: it does not load as a model.")
        archs = json.loads(config.read_text()).get("architectures") or []
        return str(folder.resolve()), list(archs)
    try:
        from transformers import AutoConfig

        archs = AutoConfig.from_pretrained(name).architectures or []
    except Exception as err:  # noqa: BLE001 - whatever the cause, the export would not load elsewhere
        raise ValueError(f"verifier={name!r} is neither a local model folder nor a Hub repo that loads "
                         f"({type(err).__name__}); speculators would fail to load the export. Pass verifier= (the "
                         "target model, its folder or its Hub repo id).") from err
    return name, list(archs)


def _speculators_config(algorithm: str, tokens: int, verifier, default_verifier) -> dict:
    name, archs = _verifier(verifier, default_verifier)
    if not archs:
        raise ValueError(f"The verifier {name!r} records no architectures (class names) in its config; speculators "
                         "needs them.")
    return {
        "algorithm": algorithm, "default_proposal_method": "greedy",
        "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": tokens, "verifier_accept_k": 1,
                              "accept_tolerance": 0.0}],
        "verifier": {"name_or_path": name, "architectures": archs},
    }


def _write(directory: Path, config: dict, tensors: dict) -> Path:
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    return directory


def export_drafter(drafter, directory, format: str = "speculators", verifier=None, *,
                   verifier_name_or_path=None) -> Path:
    """Write ``drafter`` (a :class:`~hf_paralleldecode.DraftHead` or an EAGLE-3 drafter) in ``format`` to
    ``directory``; return the directory. Heads: :data:`EXPORT_FORMATS`; EAGLE-3: :data:`EAGLE3_EXPORT_FORMATS`.

    ``verifier`` (or ``verifier_name_or_path``, speculators' name for it): the target (model, folder or Hub repo
    id) a ``speculators`` export names; default: the drafter's ``target_name_or_path`` (refused when it does not
    load).
    """
    from .eagle3 import Eagle3Drafter

    verifier = _one_verifier("export_drafter", verifier, verifier_name_or_path)
    directory = Path(directory)
    if isinstance(drafter, Eagle3Drafter):
        if format not in EAGLE3_EXPORT_FORMATS:
            raise ValueError(f"Unknown export format {format!r} for an EAGLE-3 drafter; choose one of "
                             f"{EAGLE3_EXPORT_FORMATS}.")
        config = _eagle3_config(drafter, format, verifier)
        directory.mkdir(parents=True, exist_ok=True)
        return _write(directory, config, _eagle3_weights(drafter, format))
    return export_draft_head(drafter, directory, format, verifier)


def _eagle3_config(drafter, format: str, verifier) -> dict:
    c = drafter.config
    facts = _facts(c, default_depth=c.default_depth)
    if format == "eagle3":
        if c.layer_type != "llama" or c.num_hidden_layers != 1 or c.norm_before_fc or c.fc_norm or c.norm_output:
            raise ValueError("The original EAGLE-3 layout holds one Llama-style layer with no extra norms; export this "
                             "drafter with format='speculators'.")
        layer = _layer_config(c, drafter.dtype, "llama", ("LlamaForCausalLMEagle3",))
        layer.update(draft_vocab_size=c.draft_vocab_size, target_hidden_size=c.target_hidden_size,
                     norm_before_residual=c.norm_before_residual,
                     eagle_config={"eagle_aux_hidden_state_layer_ids": drafter.tap_layers,
                                   "use_aux_hidden_state": True}, **facts)
        return layer
    layer = _layer_config(c, drafter.dtype, c.layer_type, ("LlamaForCausalLM" if c.layer_type == "llama"
                                                           else "Qwen3ForCausalLM",))
    return {
        "architectures": ["Eagle3DraftModel"], "speculators_model_type": "eagle3", "speculators_version": "0.9.0",
        "transformer_layer_config": layer, "draft_vocab_size": c.draft_vocab_size,
        "target_hidden_size": c.target_hidden_size,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in drafter.tap_layers],
        "norm_before_residual": c.norm_before_residual, "norm_before_fc": c.norm_before_fc, "fc_norm": c.fc_norm,
        "norm_output": c.norm_output, "embed_requires_grad": False, "tie_word_embeddings": False,
        "dtype": layer["dtype"],
        "speculators_config": _speculators_config("eagle3", c.default_depth, verifier, c.target_name_or_path),
        **facts,
    }


def _eagle3_weights(drafter, format: str) -> dict[str, torch.Tensor]:
    tensors = dict(drafter.state_dict())
    if format == "eagle3":
        tensors = {("midlayer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k: v
                   for k, v in tensors.items()}
    elif "embed_tokens.weight" not in tensors:  # speculators saves the (frozen) embeddings it drafts with
        if not drafter._target:
            raise ValueError("A speculators EAGLE-3 export carries the token embeddings: bind the drafter to its "
                             "target first (drafter.bind(model)).")
        tensors["embed_tokens.weight"] = drafter._target[0].get_input_embeddings().weight
    return tensors


def _one_verifier(caller: str, verifier, verifier_name_or_path):
    if verifier is not None and verifier_name_or_path is not None:
        raise TypeError(f"{caller}() got both verifier= and verifier_name_or_path= (two names of one argument); pass "
                        "one of them.")
    return verifier if verifier is not None else verifier_name_or_path


def export_draft_head(head, directory, format: str = "transformers", verifier=None, *,
                      verifier_name_or_path=None) -> Path:
    """Write a draft ``head`` in ``format`` (one of :data:`EXPORT_FORMATS`) to ``directory``; return the directory.

    ``verifier`` / ``verifier_name_or_path``: see :func:`export_drafter` (``speculators`` only).
    """
    verifier = _one_verifier("export_draft_head", verifier, verifier_name_or_path)
    if format not in EXPORT_FORMATS:
        raise ValueError(f"Unknown export format {format!r}; choose one of {EXPORT_FORMATS}.")
    c = head.config
    causal = c.attention != "block_bidirectional"
    if format == "transformers" and causal:
        raise ValueError(
            f"transformers' DFlash drafter attends bidirectionally inside the block and cannot express a {c.attention} "
            "head's mask. Export it with format='speculators' or 'dflash' (a causal chain), or run it "
            "with decoding='speculative' here."
        )
    if c.attention == "tree_causal":
        logger.warning(
            "Exporting a tree_causal head to %r: other engines run it as a causal chain of MASK slots "
            "([anchor, MASK, MASK, ...]); depth 1 drafts as here, deeper positions lose the branch conditioning "
            "(expect a shorter acceptance length there). It reads back here as a tree_causal head.", format)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = head.dtype
    facts = _facts(c, attention=c.attention)
    if format == "transformers":
        body = c.assistant_config()
        body.dtype = dtype
        setattr(body, PROJECT_KEY, facts[PROJECT_KEY])
        body.save_pretrained(directory)
        save_file({k: v.detach().contiguous().cpu() for k, v in head.model.state_dict().items()},
                  directory / "model.safetensors", metadata={"format": "pt"})
        return directory
    layer = _layer_config(c, dtype)
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
            "speculators_config": _speculators_config("dflash", c.block_size, verifier, c.target_name_or_path),
            **facts,
        }
    else:  # dflash (z-lab native)
        config = dict(layer)
        config.update(
            block_size=c.block_size + 1,
            num_target_layers=c.target_num_hidden_layers,
            dflash_config={"mask_token_id": c.mask_token_id, "target_layer_ids": list(c.target_layer_ids),
                           "causal": causal, "causal_head": causal, "target_hidden_size": c.target_hidden_size},
            **facts,
        )
    return _write(directory, config, _engine_weights(head))
