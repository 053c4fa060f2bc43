"""Decoding strategies (``custom_generate`` callables) and the pieces they share.

Layout
    Strategies, one module each: ``jacobi``, ``jacobi_forcing``, ``lookahead``, ``speculative``
    (registered by name in :mod:`hf_paralleldecode.registry`; importable from the top-level package).
    Shared pieces: ``base`` (validation, prefill, the decode loop, outputs), ``support`` (which
    ``generate`` arguments are supported or refused), ``cache`` (per-row committed KV slots),
    ``target`` (the target forward and hidden-state taps), ``tree`` (packed token trees and their
    masks), ``verify`` (acceptance rules), ``processors`` (logits processors per position),
    ``commit`` (emission in stock order), ``ngram_pool`` (n-gram pools for lookahead and rejection
    recycling), ``draft_tree`` (best-first draft trees for draft heads).
"""

from .base import ParallelDecodingOutput
from .jacobi import jacobi

__all__ = ["ParallelDecodingOutput", "jacobi"]
