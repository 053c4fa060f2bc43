"""Export a drafter to the formats other engines read: transformers' DFlash, vLLM speculators, DFlash native, EAGLE-3.

What it is for
    Users outgrow one machine: a head trained here should be readable by transformers' own assisted
    generation, by vLLM and by SGLang without conversion scripts. :func:`export_draft_head` writes
    one directory per format from the head's single state dict (the body is transformers' DFlash
    drafter, so only names change). The transformers form is run by the tests (its drafts are
    compared with ``tree_width=1`` here); the vLLM / SGLang forms are written with the fields those
    loaders read and checked structurally (config fields, weight names), not run against vLLM or
    SGLang here.

Where the writers live
    Each drafter kind writes its own formats: it lists them in ``EXPORT_FORMATS`` and writes them in its
    ``export`` method, in its own file (``head.py``, ``eagle3.py``); :func:`export_drafter` only checks the
    format against the kind's list and calls it, and :mod:`.formats` holds what the writers share.

The formats, and the fields each loader reads:

    * ``"transformers"``: ``MuseGlimmerAssistantModel`` layout (``encoder.fc``,
      ``encoder.output_norm_enc``): ``AutoModel.from_pretrained(dir)`` loads it without remote
      code and ``target.generate(..., assistant_model=draft, speculation_type="dflash")`` runs it
      (every transformers of the tested range). It reads ``target_layer_ids``, ``block_size`` and ``mask_token_id`` from
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

from pathlib import Path

from .base import Drafter

__all__ = ["export_drafter", "export_draft_head"]


def export_drafter(drafter: Drafter, directory, format: str = "speculators", verifier=None, *,
                   verifier_name_or_path=None) -> Path:
    """Write ``drafter`` in ``format`` (one of its kind's ``EXPORT_FORMATS``: a :class:`~hf_paralleldecode.DraftHead`
    writes ``"transformers"``, ``"speculators"``, ``"dflash"``; an EAGLE-3 drafter ``"speculators"``, ``"eagle3"``) to
    ``directory``; return the directory.

    ``verifier`` (or ``verifier_name_or_path``, speculators' name for it): the target (model, folder or Hub repo
    id) a ``speculators`` export names; default: the drafter's ``target_name_or_path`` (refused when it does not
    load).
    """
    verifier = _one_verifier("export_drafter", verifier, verifier_name_or_path)
    formats = getattr(drafter, "EXPORT_FORMATS", ())
    if not formats:
        raise ValueError(f"A {type(drafter).__name__} has no export formats: save it with save_pretrained() (read "
                         "back by hf_paralleldecode.load_drafter).")
    if format not in formats:
        raise ValueError(f"Unknown export format {format!r} for this {drafter.describe()}; choose one of {formats}.")
    return drafter.export(Path(directory), format, verifier)


def export_draft_head(head, directory, format: str = "transformers", verifier=None, *,
                      verifier_name_or_path=None) -> Path:
    """Write a draft ``head`` in ``format`` (``"transformers"``, ``"speculators"`` or ``"dflash"``) to
    ``directory``; return the directory. :func:`export_drafter` with the transformers form by default.

    ``verifier`` / ``verifier_name_or_path``: see :func:`export_drafter` (``speculators`` only).
    """
    verifier = _one_verifier("export_draft_head", verifier, verifier_name_or_path)
    return export_drafter(head, directory, format, verifier)


def _one_verifier(caller: str, verifier, verifier_name_or_path):
    if verifier is not None and verifier_name_or_path is not None:
        raise TypeError(f"{caller}() got both verifier= and verifier_name_or_path= (two names of one argument); pass "
                        "one of them.")
    return verifier if verifier is not None else verifier_name_or_path
