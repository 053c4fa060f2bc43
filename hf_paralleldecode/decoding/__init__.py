"""Decoding strategies (``custom_generate`` callables) and the pieces they share.

Layout: ``cache`` (per-row committed KV slots), ``processors`` (logits processors per position),
``verify`` (acceptance rules), ``commit`` (emission in stock order), ``base`` (validation,
prefill, target forward, outputs); one module per strategy (``jacobi``).
"""

from .base import ParallelDecodingOutput
from .jacobi import jacobi

__all__ = ["ParallelDecodingOutput", "jacobi"]
