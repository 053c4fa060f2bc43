"""The decoding engine: the pieces every strategy and every drafter shares, below both.

``run`` (validation, prefill, the decode loop, outputs), ``support`` (which ``generate`` arguments are supported or
refused), ``cache`` (per-row committed KV slots), ``target`` (the target forward and hidden-state taps), ``tree``
(packed token trees and their masks), ``verify`` (acceptance rules), ``processors`` (logits processors per
position), ``commit`` (emission in stock order), ``ngram_pool`` (n-gram pools for lookahead and rejection
recycling), ``draft_tree`` (best-first draft trees for draft heads), ``settings`` (a strategy's settings class, the factory
of its ``custom_generate`` callable, the table of strategies by name). Nothing here imports a strategy, a drafter
or the batch policy.
"""
