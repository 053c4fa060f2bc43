"""What every strategy does before and after its loop: validation, prefill, target forwards, output.

What it is for
    A strategy is a ``custom_generate`` callable (the arguments ``generate`` hands every such callable:
    ``compat.SAMPLE_ARGUMENTS``).
    :func:`start` validates the request *before any forward pass* (clear ``ValueError`` naming
    the fix), prepares the cache, runs the prefill and commits each row's first token, returning a
    :class:`DecodeRun` that holds the target forward (:meth:`DecodeRun.forward`), the
    :class:`~hf_paralleldecode.engine.cache.SlotCache`, the
    :class:`~hf_paralleldecode.engine.commit.CommitLog` and the statistics.
    :meth:`DecodeRun.result` builds the stock output type plus decoding statistics.
    :func:`decode` runs the loop with the objects that existed before the call frozen (:func:`old_objects_frozen`).

What it deliberately does not know
    What the strategy proposes or how it verifies.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from ..attention import decoding_attention
from ..compat import GenerateDecoderOnlyOutput, enclosing_generate_streamer, user_cache
from .cache import SlotCache, prepare_cache
from .census import host_values
from .commit import CommitLog
from .contract import PendingCheck, check_proposer, check_tree
from .processors import prefix_independent, process_block
from .settings import check_bool_setting, check_int_setting  # noqa: F401 - their old home
from .support import (
    generation_config_conflict,
    model_conflict,
    model_inputs_conflict,
    processors_conflict,
    rope_conflict,
)
from .target import TargetForward
from .tree import PackedTree
from .verify import Verdict, verify_tree

__all__ = ["DecodeRun", "ContextDraw", "LazyHistories", "ParallelDecodingOutput", "Proposer", "decode", "decode_call",
           "old_objects_frozen", "start"]


@dataclass
class ParallelDecodingOutput(GenerateDecoderOnlyOutput):
    """``GenerateDecoderOnlyOutput`` plus decoding statistics.

    Attributes (beyond the stock ones):
        num_forward_passes: target forward passes, prefill included.
        num_generated_tokens: tokens generated, summed over rows, up to each row's stop.
        tokens_per_forward: TPF = generated tokens / target forward passes, averaged per row
            (sum over rows of tokens / sum over rows of the forwards that row took part in).
        decoding: name of the strategy.
        stats: strategy-specific counters and the settings the strategy resolved (e.g. cache
            compactions, ``block_size``, ``tau``).
        draft_stats: a learned drafter's measurements (:class:`~hf_paralleldecode.DraftStats`;
            ``decoding="speculative"``), else ``None``.

    ``scores`` / ``logits`` (with ``output_scores`` / ``output_logits``) hold, per step, the values
    of the committed tokens; rows that had already finished at that step hold zeros (stock
    generation fills them with the scores of its padding continuation, which is never computed
    here). The output's cache is ``None``: the cache holds per-row holes and is not reusable as is.
    """

    num_forward_passes: int | None = None
    num_generated_tokens: int | None = None
    tokens_per_forward: float | None = None
    decoding: str | None = None
    stats: dict | None = None
    draft_stats: Any = None


def _validate(model, name, input_ids, generation_config, logits_processor, model_kwargs):
    for reason in (model_conflict(model), model_inputs_conflict(model_kwargs, model, name),
                   generation_config_conflict(generation_config), processors_conflict(logits_processor),
                   rope_conflict(model, int(generation_config.max_length))):
        if reason is not None:
            raise ValueError(f"decoding={name!r} {reason}")
    if model_kwargs.get("inputs_embeds") is not None:
        raise ValueError(f"decoding={name!r} needs input_ids; inputs_embeds are not supported.")
    if input_ids.shape[1] == 0:
        raise ValueError("decoding needs a non-empty prompt (input_ids of length >= 1).")


class ContextDraw:
    """One uniform draw of ``k`` tokens per active row from the row's context (:meth:`DecodeRun.context_draw`).

    ``draw[i]`` is active row ``i``'s ``k`` tokens; ``draw.take(i, n)`` the first ``n`` of them. A row's
    positions become tokens only when read.
    """

    def __init__(self, picks: torch.Tensor, prompts: list[list[int]], committed: list[list[int]], totals: list[int]):
        self.picks, self.prompts, self.committed, self.totals = picks, prompts, committed, totals
        self.k = picks.shape[1]

    def __len__(self) -> int:
        return self.picks.shape[0]

    def __getitem__(self, i: int) -> list[int]:
        return self.take(i, self.k)

    def take(self, i: int, n: int) -> list[int]:
        """The first ``min(n, k)`` tokens of active row ``i``."""
        return self._tokens(i, self.picks[i, :n])

    def tail(self, i: int, start: int) -> list[int]:
        """Active row ``i``'s drawn tokens from index ``start`` on (only those are read)."""
        return self._tokens(i, self.picks[i, start:])

    def _tokens(self, i: int, picks: torch.Tensor) -> list[int]:
        prompt, committed, total = self.prompts[i], self.committed[i], self.totals[i]
        plen = len(prompt)
        return [prompt[p] if p < plen else committed[min(p, total - 1) - plen] for p in host_values(picks)]

    def cycled(self, i: int, n: int) -> list[int]:
        """``n`` tokens of active row ``i``: its ``k`` drawn tokens, repeated as often as needed."""
        if n <= 0:
            return []
        row = self.take(i, n)
        return row if n <= self.k else [row[j % self.k] for j in range(n)]


class LazyHistories:
    """The active rows' histories (:meth:`DecodeRun.history`, by active position), each built when first read."""

    def __init__(self, run: DecodeRun):
        self.run = run
        self._built: dict[int, torch.Tensor] = {}

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in self._built:
            self._built[i] = self.run.history(self.run.row_ids[i])
        return self._built[i]

    def __len__(self) -> int:
        return len(self.run.row_ids)


class DecodeRun:
    """State of one generate() call shared by every strategy (see module docstring).

    The pieces, one job each: :class:`~.target.TargetForward` (forwards), ``processors``
    (the user's processors per node), :func:`~.verify.verify_tree` (acceptance),
    :class:`~.cache.SlotCache` (KV of the accepted path) and :class:`~.commit.CommitLog`
    (emission in stock order). :meth:`step` wires them for one packed tree.
    """

    def __init__(self, model, name, input_ids, generation_config, logits_processor, log, slots, rows,
                 prompt_mask: torch.Tensor, prompt_positions: torch.Tensor):
        self.model = model
        self.name = name
        self.prompt = input_ids  # [batch, prompt_len]
        self.prompt_mask = prompt_mask.bool()  # [batch, prompt_len] True for real tokens (the attention mask)
        self.prompt_positions = prompt_positions  # [batch, prompt_len] the prefill's position ids
        # each row's real prompt tokens moved to the front, in order (what context draws read)
        self.packed_prompt = input_ids.gather(1, (~self.prompt_mask).long().argsort(dim=1, stable=True))
        self.prompt_lengths = self.prompt_mask.long().sum(1)  # [batch] real prompt tokens
        # Stock generation continues each row's position ids from the prompt's last one; with left
        # padding that equals the number of real tokens, in general it is offset from it.
        self.position_offset = prompt_positions[:, -1] + 1 - prompt_mask.long().sum(-1)  # [batch]
        self.generation_config = generation_config
        self.logits_processor = logits_processor
        self.log = log
        self.slots = slots
        self.rows = rows  # [active] original row ids of the rows still decoding
        self.row_ids: list[int] = list(range(rows.shape[0]))  # the same on the host (the engine's mirror: no read)
        self.kept_positions: list[int] = self.row_ids  # the positions the last drop_finished kept, on the host
        self.target = TargetForward(model)
        self.stats: dict = {}
        self.draft_stats = None  # a DraftStats, set by a drafting proposer
        self._prompt_lists: list[list[int]] | None = None  # see prompt_tokens
        # sampling: one uniform per (row, generated position), drawn once per call from the user's RNG (see
        # position_uniforms); None when greedy
        self.uniforms: torch.Tensor | None = None
        self.last: torch.Tensor | None = None  # [batch] each row's last committed token, on the device (the roots)

    def position_uniforms(self, tree: PackedTree) -> torch.Tensor:
        """``[active, nodes]``: the uniform of the generated position each node's sample is for (the row's next
        position plus the node's depth). A sample-then-match step draws the target's token after a node by inverse
        CDF from it, so the token committed at a position uses that position's uniform whatever the tree held:
        a fixed seed gives the same sampled output whichever shapes the batch policy picked."""
        counts = self.log.count[self.rows]  # committed tokens: the next one has this index
        index = (counts[:, None] + tree.depth).clamp(max=self.uniforms.shape[1] - 1)
        return self.uniforms[self.rows].gather(1, index)

    @property
    def num_forward_passes(self) -> int:
        return self.target.num_forward_passes

    # ---- one step: forward, processors, acceptance, commit ------------------------------------
    def process(self, logits: torch.Tensor, tree: PackedTree) -> torch.Tensor:
        """Processed scores ``[active, nodes, vocab]`` (see ``processors.process_block``)."""
        if not self.logits_processor:
            return logits
        # (processors blind to the ids, such as temperature or top-p, need no histories)
        histories = [] if prefix_independent(self.logits_processor) else self.histories()
        return process_block(self.logits_processor, logits, tree, histories, self.rows, self.prompt.shape[0],
                             self.placeholder_prefix)

    def placeholder_prefix(self, row: int, length: int) -> torch.Tensor:
        """Row ``row``'s own ids at ``length``, as stock would hold them: its history cut to ``length``,
        or left-padded when the row has not got that far (placeholder rows of a processor call)."""
        history = self.history(row)
        if history.shape[0] >= length:
            return history[:length]
        pad = self.log.pad_token_id if self.log.pad_token_id is not None else 0
        return torch.cat([history.new_full((length - history.shape[0],), pad), history])

    def step(self, tree: PackedTree, check: PendingCheck | None = None) -> Verdict:
        """Feed ``tree`` in one target forward, verify it, commit the accepted tokens + one, emit.

        The rule (greedy / sample-then-match / rejection sampling with ``tree.q``) is
        :func:`~.verify.verify_tree`'s. Returns its :class:`~.verify.Verdict`. ``check``: the tree's boundary check
        (:func:`~.contract.check_tree`), read with the verdict; a broken contract raises before the commit.
        """
        flag = check.flag if check is not None else None
        # greedy with nothing that reads the values (processors, output scores / logits): argmax in the model's dtype
        values = bool(self.generation_config.do_sample or self.logits_processor or self.log.scores is not None
                      or self.log.logits is not None or tree.q is not None)
        if not values:  # greedy: the target's choices, never the [active, nodes, vocab] logits
            choices = self.target.greedy(tree, self.slots, self.next_positions(), self.rows)
            verdict = verify_tree(tree, None, False, choices=choices, check=flag)
            self.commit(verdict, check=check, chain=tree.is_chain)
            return verdict
        logits = self.target.forward(tree, self.slots, self.next_positions(), self.rows)
        scores = self.process(logits, tree)
        uniforms = self.position_uniforms(tree) if self.uniforms is not None and tree.q is None else None
        verdict = verify_tree(tree, scores, bool(self.generation_config.do_sample), tree.q, uniforms=uniforms,
                              check=flag)
        self.commit(verdict, scores, logits, check=check, chain=tree.is_chain)
        return verdict

    def verify(self, tree: PackedTree) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`step`, returning ``(choices, num_accepted)`` (kept for drafters written against it)."""
        verdict = self.step(tree)
        return verdict.choices, verdict.num_accepted

    def commit(self, verdict: Verdict, scores: torch.Tensor | None = None, logits: torch.Tensor | None = None,
               check: PendingCheck | None = None, chain: bool = False) -> None:
        """Commit the accepted path's tokens + bonus (``num + 1`` per row) and keep the path's KV (``scores`` /
        ``logits``: the step's, needed only when the output returns them). One read of the device: the verdict's host
        lists, with ``check``'s flag (a broken contract raises here, before anything is committed). ``chain``: the
        tree was one path per row (the accepted nodes are a prefix: kept on the host, no read)."""
        path, num = verdict.path, verdict.num_accepted
        verdict.read()  # the committed tokens, their counts and the check, in one read (none when walked on the host)
        if verdict.check_failed and check is not None:
            check.explain()
        if self.last is not None:  # the next roots, on the device
            tokens = verdict.tokens
            nxt = tokens[:, 0] if tokens.shape[1] == 1 else tokens.gather(1, num[:, None]).squeeze(1)
            self.last.index_copy_(0, self.rows, nxt)
        idx = path.clamp(min=0)  # [active, depth + 1]; entries past num are ignored
        kept = {}
        for name, values in (("scores", scores), ("logits", logits)):
            if getattr(self.log, name) is not None:
                kept[name] = values.gather(1, idx[..., None].expand(-1, -1, values.shape[-1]))
        host = (self.row_ids, verdict.committed, [n + 1 for n in verdict.nums])
        self.log.add(self.rows, verdict.tokens, num + 1, kept.get("scores"), kept.get("logits"), host=host)
        if verdict.host is not None:  # the path's nodes increase (parents before children) and start at the root
            self.slots.commit_kept([[v for v in p if v >= 0] for p in verdict.host[0]], verdict.choices.shape[1])
        elif chain:  # a chain's accepted nodes: the root and the first num of the path
            self.slots.commit_kept([list(range(n + 1)) for n in verdict.nums], verdict.choices.shape[1])
        else:
            keep = torch.zeros(verdict.choices.shape[:2], dtype=torch.bool, device=path.device)
            keep.scatter_(1, idx, path >= 0)
            keep[:, 0] = True  # the root (the last committed token) always gets its KV
            self.slots.commit(keep)
        self.log.emit()

    def lazy_histories(self) -> LazyHistories:
        """:meth:`histories`, each built when first read (a step whose processors read no prefixes builds none)."""
        return LazyHistories(self)

    def histories(self) -> list[torch.Tensor]:
        return [self.history(r) for r in self.row_ids]

    def history(self, row: int) -> torch.Tensor:
        """Padded prompt + committed tokens of original row ``row`` (what stock would pass processors)."""
        return torch.cat([self.prompt[row], self.log.tokens[row, : self.log.host_counts([row])[0]]])

    def roots(self) -> torch.Tensor:
        """``[active]`` each active row's last committed token (the root of its next tree), on the device: no copy."""
        return self.last[self.rows]

    def next_positions(self) -> torch.Tensor:
        """``[active]`` position id of each active row's next token (continues the prompt's ids)."""
        return self.slots.num_valid + self.position_offset[self.rows]

    def prompt_tokens(self, row: int) -> list[int]:
        """Original row ``row``'s real prompt tokens (padding dropped, in order), as a host list (do not modify)."""
        if self._prompt_lists is None:
            self._prompt_lists = [p[:n] for p, n in zip(self.packed_prompt.tolist(), self.prompt_lengths.tolist())]
        return self._prompt_lists[row]

    def sample_context(self, k: int, generator: torch.Generator) -> torch.Tensor:
        """``[active, k]`` tokens drawn uniformly from each active row's context (:meth:`sample_context_lists`)."""
        return torch.tensor(self.sample_context_lists(k, generator), dtype=torch.long,
                            device=self.rows.device).reshape(self.rows.shape[0], k)

    def sample_context_lists(self, k: int, generator: torch.Generator) -> list[list[int]]:
        """``k`` tokens drawn uniformly from each active row's context, as host lists (:meth:`context_draw`, read
        in full)."""
        draw = self.context_draw(k, generator)
        return [draw[i] for i in range(len(draw))]

    def context_draw(self, k: int, generator: torch.Generator) -> ContextDraw:
        """``k`` tokens drawn uniformly from each active row's context: a :class:`ContextDraw`, whose rows are
        turned into host lists only when read (a proposer that refills few positions reads few).

        The context is the row's prompt without padding plus its committed tokens; ``generator``
        (CPU) makes the draw reproducible: one ``[active, k]`` uniform draw per call.
        """
        rows = self.row_ids
        prompts = [self.prompt_tokens(r) for r in rows]
        totals = [len(p) + c for p, c in zip(prompts, self.log.host_counts(rows))]
        u = torch.rand(len(rows), k, generator=generator)
        picks = (u * torch.tensor(totals, dtype=torch.float32)[:, None]).long()
        return ContextDraw(picks, prompts, [self.log.host_tokens(r) for r in rows], totals)

    # ---- row management -------------------------------------------------------------------------
    def drop_finished(self) -> torch.Tensor | None:
        """Remove rows that need no more work; return the kept positions (into the active rows) or None."""
        needs = self.log.host_needs_work()
        flags = [needs[r] for r in self.row_ids]
        if all(flags):
            return None
        kept = [i for i, f in enumerate(flags) if f]
        keep = torch.tensor(kept, dtype=torch.long, device=self.rows.device)
        self.rows = self.rows[keep]
        self.row_ids = [self.row_ids[i] for i in kept]
        self.kept_positions = kept  # the same positions on the host, for proposers' host state (select(kept))
        if keep.numel():
            self.slots.select_rows(keep)
        return keep

    # ---- output ---------------------------------------------------------------------------------
    def result(self, return_dict: bool, wall_start: float):
        self.log.finish()
        if not return_dict:
            return self.log.sequences
        useful = self.log.useful_tokens()
        forwards = int(self.log.forwards_per_row.sum())
        stats = dict(self.stats)
        stats.update(
            row_forwards=forwards,  # forwards summed over the rows that took part in them
            cache_compactions=self.slots.num_compactions,
            model_seconds=self.target.seconds,
            greedy_head_seconds=self.target.head_seconds,  # the LM head applied after the forward (greedy steps)
            wall_seconds=time.perf_counter() - wall_start,
        )
        return ParallelDecodingOutput(
            sequences=self.log.sequences,
            scores=tuple(self.log.scores) if self.log.scores is not None else None,
            logits=tuple(self.log.logits) if self.log.logits is not None else None,
            num_forward_passes=self.num_forward_passes,
            num_generated_tokens=int(useful.sum()),
            tokens_per_forward=float(useful.sum()) / max(forwards, 1),
            decoding=self.name,
            stats=stats,
            draft_stats=self.draft_stats,
        )


def start(
    model,
    name: str,
    input_ids: torch.Tensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    streamer,
    model_kwargs: dict,
    prompt_streamed: bool = False,
) -> DecodeRun:
    """Validate, prefill the prompt and commit every row's first token; return the run state."""
    _validate(model, name, input_ids, generation_config, logits_processor, model_kwargs)
    cache = prepare_cache(model, user_cache(model_kwargs), int(generation_config.max_length))
    batch, prompt_len = input_ids.shape
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    position_ids = model_kwargs.get("position_ids")
    if position_ids is None:
        position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill_(attention_mask == 0, 1)

    token_types = model_kwargs.get("token_type_ids")

    log = CommitLog(
        input_ids,
        generation_config,
        stopping_criteria,
        streamer=streamer,
        prompt_streamed=prompt_streamed,
        output_scores=bool(generation_config.return_dict_in_generate and generation_config.output_scores),
        output_logits=bool(generation_config.return_dict_in_generate and generation_config.output_logits),
    )
    slots = SlotCache(cache, attention_mask.bool(), dtype=model.dtype)
    rows = torch.arange(batch, device=input_ids.device)
    run = DecodeRun(model, name, input_ids, generation_config, logits_processor, log, slots, rows,
                    prompt_mask=attention_mask, prompt_positions=position_ids)
    run.target.token_type_ids = token_types
    if log.max_new_tokens == 0:
        return run

    logits = run.target.prefill(input_ids, attention_mask, position_ids, cache)  # [batch, vocab]
    scores = logits_processor(input_ids, logits) if logits_processor else logits
    if generation_config.do_sample:
        first = torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(1)
        # the draws of later positions (see DecodeRun.position_uniforms), from a generator seeded by the user's RNG
        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,))))
        run.uniforms = torch.rand(batch, log.max_new_tokens + 1, generator=generator).to(input_ids.device)
    else:
        first = scores.argmax(-1)
    log.add(rows, first[:, None], torch.ones_like(first), scores[:, None], logits[:, None])
    log.emit()
    run.last = first.clone()
    run.prompt_tokens(0)  # the prompts' host lists, read once with the prefill (context draws, n-gram indexes)
    return run


class Proposer:
    """What a strategy supplies to :func:`decode`: guesses as a token tree, and what it learns back.

    ``propose()`` returns the :class:`PackedTree` to verify for the active rows (with ``q`` when
    the drafter sampled its tokens from a distribution); ``update(tree, verdict)`` receives the
    :class:`~.verify.Verdict` (accepted path, committed tokens, the target's choice after every
    node): proposers learn what was committed from it, not from the commit log; ``select(kept)`` follows ``DecodeRun.drop_finished`` (positions of
    the active rows that stay); ``stats`` are merged into the output's statistics.
    """

    stats: dict = {}
    #: the call's :class:`~hf_paralleldecode.decoding.policy.BatchPolicy` (the loop asks it before :meth:`propose` and tells it the verdict
    #: after): it picks each step's shape for the batch and holds the node budget; ``None``: the configured tree
    #: every step, every node of it
    policy = None

    @property
    def cost_budget(self):
        """The policy's node budget (a :class:`~.budget.CostAwareBudget`, ``cost_aware=True``), or ``None``."""
        return self.policy.nodes if self.policy is not None else None

    @property
    def shape(self):
        """The :class:`~hf_paralleldecode.decoding.policy.Shape` of the step being proposed, ``None`` without a policy (the configured tree)."""
        return self.policy.current if self.policy is not None else None

    @property
    def configured_step(self) -> bool:
        """Whether this step feeds the configured tree (always, without a policy)."""
        return self.policy is None or self.policy.index == 0

    @property
    def plain_step(self) -> bool:
        """Whether this step feeds each row's last committed token alone (the policy's plain shape)."""
        return self.policy is not None and self.policy.current.plain

    def propose(self) -> PackedTree:  # pragma: no cover - interface
        raise NotImplementedError

    def update(self, tree: PackedTree, verdict: Verdict) -> None:  # pragma: no cover
        raise NotImplementedError

    def select(self, kept: torch.Tensor) -> None:
        """Default: the proposer keys its state by original row id and needs no compaction."""


@contextmanager
def old_objects_frozen() -> Iterator[None]:
    """Within: the objects the garbage collector tracked before are frozen (``gc.freeze``), after: unfrozen.

    A full collection walks every tracked object of the process: a process that holds a model, a tokenizer and
    transformers tracks a few hundred thousand (410k in the bench's, an 8.4M model), and one full collection took
    about 230 ms on 2 CPU threads. One that lands on a decoding step makes that step several steps long (a tree step
    of the 8.4M JF model at 16 rows: 341 ms against 100 ms), and the loop's own allocations trigger them. Frozen, the
    old objects are skipped: the collections the loop triggers walk what the call allocated, and its cycles are still
    collected. A collector the user froze (``gc.get_freeze_count()``: their objects are not ours to unfreeze) or
    disabled is left as it is."""
    if not gc.isenabled() or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def decode(model, name, make_proposer, input_ids, logits_processor, stopping_criteria, generation_config,
           streamer, model_kwargs, settings: dict, pd_streamer=None):
    """The loop every strategy shares: validate + prefill, then propose -> verify -> update until done, with the
    objects that existed before the call frozen (:func:`old_objects_frozen`) and the call's attention priority
    (:func:`hf_paralleldecode.attention.decoding_attention`).

    ``pd_streamer`` (what ``decoding=`` routes ``streamer=`` to, see ``integration.py``) wins over
    ``streamer``. When neither arrives but the user gave ``generate(streamer=...)`` with
    ``custom_generate=<strategy>`` (transformers keeps it from callables after putting the prompt
    into it), that streamer is found in ``generate``'s frame and fed the steps and ``end()``.
    """
    wall_start = time.perf_counter()
    streamer = pd_streamer if pd_streamer is not None else streamer
    prompt_streamed = False
    if streamer is None:  # custom_generate=<strategy> called directly: generate kept the user's streamer
        streamer = enclosing_generate_streamer(depth=2)
        prompt_streamed = streamer is not None  # generate has already put the prompt into it
    # full collections in the loop walk only what the call allocates; cuDNN's attention after the others on GPUs
    # where torch tries it first (hf_paralleldecode.attention: it builds a plan for every new shape)
    with old_objects_frozen(), decoding_attention(input_ids.device):
        run = start(model, name, input_ids, logits_processor, stopping_criteria, generation_config, streamer,
                    model_kwargs, prompt_streamed)
        run.stats.update(settings)
        if not run.log.done:  # (no room for new tokens is only reachable by calling a strategy directly)
            proposer = make_proposer(run)
            check_proposer(proposer, name)
            vocab = run.target.vocab
            fed = None  # tokens of the last verification forward (all rows)
            while not run.log.done:
                kept = run.drop_finished()
                if kept is not None:
                    proposer.select(kept)
                if not run.row_ids:
                    break
                policy = proposer.policy
                if policy is not None:
                    policy.start_step(len(run.row_ids), run.target.seconds, fed,
                                      run.log.mean_remaining(run.row_ids))
                tree = proposer.propose()
                check = check_tree(tree, run.row_ids, run.log.last_token, vocab, name, last=run.roots())
                verdict = run.step(tree, check)
                fed = tree.tokens.numel()
                if policy is not None:
                    policy.observe(tree, verdict)
                proposer.update(tree, verdict)
            if proposer.policy is not None:
                proposer.policy.finish()
                run.stats.update(proposer.policy.stats)
            run.stats.update(proposer.stats)
            run.draft_stats = getattr(proposer, "draft_stats", None)
        return run.result(bool(generation_config.return_dict_in_generate), wall_start)


def decode_call(model, call, make_proposer, settings: dict):
    """:func:`decode` for the :class:`~.settings.GenerateCall` a strategy built by
    :func:`~.settings.decoding_strategy` receives; ``settings``: what the output's ``stats`` record of them."""
    return decode(model, call.name, make_proposer, call.input_ids, call.logits_processor, call.stopping_criteria,
                  call.generation_config, call.streamer, call.model_kwargs, settings, pd_streamer=call.pd_streamer)
