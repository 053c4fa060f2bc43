"""Loading a checkpoint's tokenizer (a floor below ``loading`` and the drafters, which both need it)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["load_tokenizer"]


def load_tokenizer(path, **kwargs):
    """The checkpoint's tokenizer; a generic ``tokenizer.json`` pipeline is loaded exactly as written.

    ``AutoTokenizer`` in transformers 5.x replaces the tokenizer of any ``qwen2`` checkpoint with
    ``Qwen2Tokenizer`` (its own pre-tokenizer), which splits text differently from a byte-level BPE
    trained with ``tokenizers`` (the embedded model ships in Llama layout for that reason). A
    checkpoint whose ``tokenizer_config.json`` declares the generic backend (``TokenizersBackend`` /
    ``PreTrainedTokenizerFast``) is therefore loaded with ``PreTrainedTokenizerFast``; anything else
    goes through ``AutoTokenizer``.
    """
    import json

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = Path(path) / "tokenizer_config.json"
    declared = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if declared in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(path, **kwargs)
    return AutoTokenizer.from_pretrained(path, **kwargs)
