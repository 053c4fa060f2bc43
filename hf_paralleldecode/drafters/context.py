"""What a drafter is handed: the call once (:class:`DrafterContext`), each step (:class:`DraftStep`) and the nodes
of one wave (:class:`DraftNodes`).

The speculative proposer builds them from its decode run; a drafter kind reads these and nothing else of the
run (never the ``DecodeRun``, never the proposer's tree builders). Shapes: ``batch`` = the call's rows in their
original order (the context's tensors, ``DraftStep.committed``), ``active`` = the rows still decoding, in the order
of ``DraftStep.rows`` (what ``marginals`` / ``expand`` return, what ``select(kept)`` narrows). Every tensor lives on
the run's device (``DrafterContext.device``).

What it deliberately does not know
    How trees are grown or verified (``decoding/speculative.py``, ``engine/verify.py``), or any drafter kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..engine.target import HiddenStateTaps

__all__ = ["DrafterContext", "DraftStep", "DraftNodes"]


@dataclass(frozen=True)
class DrafterContext:
    """One ``generate`` call as a drafter sees it, built once after the prefill (every row is active then).

    ``taps`` records the target layers the drafter names (:attr:`~.base.Drafter.tap_layers`):
    ``taps.features()`` is ``[rows, tokens, len(tap_layers) * hidden]`` of the last target forward, i.e. of the
    prompt at :meth:`~.base.Drafter.start`, of the verified tree in :meth:`~.base.DrafterState.update`.
    """

    prompt: torch.Tensor  # [batch, P] the prompt ids as given (left padding in place)
    prompt_mask: torch.Tensor  # [batch, P] bool, True for real tokens
    prompt_positions: torch.Tensor  # [batch, P] the prompt's position ids
    packed_prompt: torch.Tensor  # [batch, P] each row's real tokens moved to the front, in order
    prompt_lengths: torch.Tensor  # [batch] real prompt tokens per row
    first_tokens: torch.Tensor  # [batch] the token the prefill committed (the first step's roots)
    first_positions: torch.Tensor  # [batch] its position
    taps: HiddenStateTaps | None  # the tapped target features, None for a drafter that taps none
    vocab: int  # rows of the target's logits: drafters return logits over this vocabulary
    device: torch.device  # where the run's tensors live
    dtype: torch.dtype  # the target's dtype (that of the tapped features)

    @classmethod
    def from_run(cls, run, taps, vocab: int) -> DrafterContext:
        """The context of a decode run just after its prefill, when every row is active (what the speculative
        proposer calls)."""
        if run.rows.shape[0] != run.prompt.shape[0]:
            raise ValueError("A drafter starts with every row of the call active (right after the prefill).")
        return cls(prompt=run.prompt, prompt_mask=run.prompt_mask, prompt_positions=run.prompt_positions,
                   packed_prompt=run.packed_prompt, prompt_lengths=run.prompt_lengths,
                   first_tokens=run.log.tokens[:, 0], first_positions=run.next_positions(), taps=taps, vocab=vocab,
                   device=run.rows.device, dtype=run.model.dtype)


@dataclass
class DraftStep:
    """One step of the active rows: where each row's tree starts and what the rows committed so far."""

    rows: torch.Tensor  # [active] original row id of each active row
    roots: torch.Tensor  # [active] each row's last committed token: node 0 of its tree
    root_pos: torch.Tensor  # [active] its position
    depth: int  # the deepest level this step's trees may reach (the batch policy may pick fewer than tree_depth)
    #: returns ``(tokens [batch, max_new_tokens], count [batch])`` of the commit log
    read_committed: Callable[[], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @classmethod
    def from_run(cls, run, roots: torch.Tensor, depth: int) -> DraftStep:
        """The step a decode run is about to propose from ``roots`` (what the speculative proposer calls)."""
        log = run.log
        return cls(rows=run.rows, roots=roots, root_pos=run.next_positions(), depth=depth,
                   read_committed=lambda: (log.tokens, log.count))

    @property
    def committed(self) -> torch.Tensor:
        """``[batch, max_new_tokens]`` the tokens each original row committed after its prompt (the prefill's first),
        the first ``num_committed[r]`` valid; built when read (a drafter that does not read it costs nothing)."""
        return self.read_committed()[0]

    @property
    def num_committed(self) -> torch.Tensor:
        """``[batch]`` committed tokens per original row."""
        return self.read_committed()[1]


class DraftNodes:
    """The nodes one wave of a branch-expanding drafter evaluates, flat and row-major: node ``k`` belongs to active
    row ``rows[k]``, where it is the ``index[k]``-th node of the wave. Tensors (``[n]``, long) are built on first read
    from the host lists (``host``), which a drafter's own bookkeeping may read without a device copy."""

    def __init__(self, rows: list[int], index: list[int], nodes: list[int], parents: list[int], tokens: list[int],
                 depths: list[int], root_pos: torch.Tensor, batch: int):
        self.host = _NodeLists(rows, index, nodes, parents, tokens, depths)
        self.batch = batch  # active rows
        self.width = max(index) + 1 if index else 0  # most nodes one row has in this wave
        self._root_pos = root_pos

    def __len__(self) -> int:
        return len(self.host.rows)

    @cached_property
    def _packed(self) -> torch.Tensor:  # [6, n] one copy to the device for every field
        h = self.host
        return torch.tensor([h.rows, h.index, h.nodes, h.parents, h.tokens, h.depths], dtype=torch.long,
                            device=self._root_pos.device).reshape(6, len(self))

    @property
    def rows(self) -> torch.Tensor:
        """``[n]`` the active row of each node."""
        return self._packed[0]

    @property
    def index(self) -> torch.Tensor:
        """``[n]`` its place among its row's nodes in this wave (``0 .. width - 1``)."""
        return self._packed[1]

    @property
    def nodes(self) -> torch.Tensor:
        """``[n]`` its node id in its row's tree (0: the root)."""
        return self._packed[2]

    @property
    def parents(self) -> torch.Tensor:
        """``[n]`` its parent's node id (-1 for the root). A parent was evaluated in an earlier wave of the step."""
        return self._packed[3]

    @property
    def tokens(self) -> torch.Tensor:
        """``[n]`` its token."""
        return self._packed[4]

    @property
    def depths(self) -> torch.Tensor:
        """``[n]`` its depth (0: the root)."""
        return self._packed[5]

    @cached_property
    def positions(self) -> torch.Tensor:
        """``[n]`` its position: its row's root position plus its depth."""
        return self._root_pos[self.rows] + self.depths


@dataclass(frozen=True)
class _NodeLists:
    rows: list[int]
    index: list[int]
    nodes: list[int]
    parents: list[int]
    tokens: list[int]
    depths: list[int]
