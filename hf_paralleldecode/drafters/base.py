"""The contract every drafter kind implements (:class:`Drafter`, :class:`DrafterState`), its registry, and the
typed statistics of a drafted run. ``docs/architecture.md`` is the page a new kind is written from.

A drafter kind is one file: a :class:`Drafter` subclass (a ``torch.nn.Module``) registered with
:func:`register_drafter_kind`, which checks the required members, and the :class:`DrafterState` its
:meth:`Drafter.start` returns for each ``generate`` call. The kind owns its config and weights (its ``FORMATS``
and :meth:`Drafter.read_checkpoint` are what :func:`~.loading.load_drafter` recognises and reads; its
``EXPORT_FORMATS`` and :meth:`Drafter.export` what :func:`~.export.export_drafter` writes), the slot layout its
training and inference share, and its checks against the target.

What the tree grower (``decoding/speculative.py``) asks of a state, and nothing else
    * ``expansion == "marginals"`` (block drafters: DFlash heads, DEER): :meth:`DrafterState.marginals`
      gives per-depth distributions for a block after each row's root; a node at depth ``d`` takes its
      children from depth ``d + 1``.
    * ``expansion == "branches"`` (autoregressive / causal drafters: JetSpec tree-causal heads,
      EAGLE-3): :meth:`DrafterState.expand` gives, for one wave of nodes of the growing trees, the
      distribution of their children conditioned on the node's own branch.
    Both return logits over the *target's* vocabulary (``-inf`` for tokens the drafter cannot
    propose), so ``q`` is a distribution over the target vocabulary and rejection sampling stays exact.
    After verification :meth:`DrafterState.update` receives the tree, the verdict and (for drafters that
    read target features) the verification forward's tapped features through the context's taps.
    What a drafter receives is declared in :mod:`.context`; it never sees the decode run.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..compat import DynamicCache
from ..engine.cache import SlotCache
from ..engine.timing import DeviceTimer
from .context import DrafterContext, DraftNodes, DraftStep
from .formats import DrafterFormat

if TYPE_CHECKING:
    from ..engine.tree import PackedTree
    from ..engine.verify import Verdict

__all__ = ["Drafter", "DrafterState", "DraftStats", "DRAFTER_KINDS", "EXPANSIONS", "register_drafter_kind",
           "drafter_kind", "check_state", "target_vocab_size", "target_facts", "default_target_layer_ids",
           "logit_rows", "SHIPPED_DRAFTERS", "shipped_drafter_dir", "ASSETS_DIR"]

#: the package's shipped checkpoints (the embedded models, heads and drafters)
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"

#: aliases of the drafters shipped for the embedded model -> their folder under ``assets/``
SHIPPED_DRAFTERS = {
    "default-jetspec": "stdlib-coder-8m-jetspec-head",  # recipes/draft_head_tiny_cpu.yaml
    "default-dflash": "stdlib-coder-8m-dflash-head",  # recipes/dflash_head_tiny_cpu.yaml
    "default-deer": "stdlib-coder-8m-deer",  # recipes/deer
    "default-eagle3": "stdlib-coder-8m-eagle3",  # recipes/eagle3_tiny_cpu.yaml
}

#: how a drafter's state gives the children of a node (see the module docstring)
EXPANSIONS = ("marginals", "branches")


def shipped_drafter_dir(name) -> Path | None:
    """The folder of a shipped drafter alias (:data:`SHIPPED_DRAFTERS`), else ``None``."""
    folder = SHIPPED_DRAFTERS.get(name) if isinstance(name, str) else None
    return None if folder is None else ASSETS_DIR / folder


class Drafter(nn.Module):
    """The interface of every drafter kind (a ``torch.nn.Module``; a kind may be a transformers ``PreTrainedModel``
    besides). Required of a kind, checked by :func:`register_drafter_kind`: :attr:`kind`, :attr:`expansion`,
    :meth:`check_target` and :meth:`start`, plus :meth:`read_checkpoint` when it lists :attr:`FORMATS` and
    :meth:`export` when it lists :attr:`EXPORT_FORMATS`. Everything else has a default here.

    From ``torch.nn.Module`` the loader and the proposer use ``to(device=..., dtype=...)`` (in place),
    ``train()`` / ``eval()`` and ``parameters()``.
    """

    #: the registry name (:data:`DRAFTER_KINDS`)
    kind: str = ""
    #: ``"marginals"`` or ``"branches"`` (see the module docstring); a property when it depends on the config
    expansion: str = "marginals"
    #: the checkpoint layouts :func:`~.loading.load_drafter` recognises as this kind (each a
    #: :class:`~.formats.DrafterFormat`: a name, a test on the folder's config, a weight-name map)
    FORMATS: tuple[DrafterFormat, ...] = ()
    #: the formats :func:`~.export.export_drafter` writes for this kind
    EXPORT_FORMATS: tuple[str, ...] = ()

    # ---- loading, saving, exporting ---------------------------------------------------------------
    @classmethod
    def read_checkpoint(cls, fmt: DrafterFormat, folder: Path, config: dict) -> Drafter:
        """A drafter from a folder one of :attr:`FORMATS` (``fmt``) recognised; ``config``: its ``config.json`` (or
        ``{}``). Strict: a missing or unexpected weight raises ``ValueError`` (:func:`~.formats.load_strict`)."""
        raise NotImplementedError(f"The {cls.kind!r} drafter kind reads no checkpoint formats.")

    def export(self, directory: Path, format: str, verifier=None) -> Path:
        """Write the drafter in ``format`` (one of :attr:`EXPORT_FORMATS`, checked by the caller) to ``directory``
        (created); return it. ``verifier``: the target a format that names one records (a model, folder or repo id;
        ``None``: the drafter's own record)."""
        raise NotImplementedError(f"A {self.describe()} has no export formats.")

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save the drafter where :func:`~.loading.load_drafter` reads it back (a bundle's ``drafter/``): the model
        class's own ``save_pretrained`` (transformers' for a ``PreTrainedModel`` kind), else the kind defines it."""
        self.check_saveable()
        return super().save_pretrained(save_directory, *args, **kwargs)

    def check_saveable(self) -> None:
        """``ValueError`` naming the fix when :meth:`save_pretrained` cannot save this drafter (a kind that is a plain
        ``torch.nn.Module`` and defines none); every save runs it before it writes any file (an enabled model's
        bundle too)."""
        defined = type(self).save_pretrained
        if defined is not Drafter.save_pretrained and defined is not CardSaving.save_pretrained:
            return  # the kind writes its own checkpoint
        if getattr(super(), "save_pretrained", None) is None:
            raise ValueError(
                f"A {self.describe()} ({type(self).__name__}) cannot be saved: its kind is a torch.nn.Module that "
                "defines no save_pretrained(save_directory), and a checkpoint without its drafter would not load back "
                "as saved. Define save_pretrained(save_directory) on the kind (writing a folder one of its FORMATS "
                "reads back), or make it a transformers PreTrainedModel; to save the model alone, save it before "
                "attaching the drafter.")

    # ---- where it runs ------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device | None:
        """The device of its weights (the first parameter's, else the first buffer's); ``None`` for a drafter with
        neither (nothing of its own to place: it runs where the call's tensors are)."""
        return next((t.device for t in itertools.chain(self.parameters(), self.buffers())), None)

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of its weights (the first floating-point parameter's, else buffer's); ``None`` for a drafter
        without any."""
        return next((t.dtype for t in itertools.chain(self.parameters(), self.buffers()) if t.is_floating_point()),
                    None)

    def copy_to(self, device=None, dtype=None):
        """A copy of the drafter that shares no weights or state with this one, on ``device`` / ``dtype`` (unbound: what
        this one borrowed from its target, if anything, is not copied)."""
        import copy

        borrowed = self.__dict__.get("_target")
        twin = copy.deepcopy(self, {id(borrowed): []} if borrowed is not None else {})
        return twin.to(device=device, dtype=dtype)

    # ---- the target -----------------------------------------------------------------------------------
    def check_target(self, target, tokenizer=None) -> None:
        """``ValueError`` naming the mismatch when ``target`` is not a model this drafter drafts for (``tokenizer``:
        the target's, when the caller has it)."""
        raise NotImplementedError(f"The {self.kind!r} drafter kind defines no check_target(target, tokenizer=None).")

    def bind(self, target) -> Drafter:
        """Check ``target`` (:meth:`check_target`) and borrow what the drafter reads of it (embeddings, LM head, its
        depth); returns self. Called before :meth:`start` on every call. What :attr:`tap_layers` names may depend on
        it (an EAGLE-3 checkpoint that records no taps)."""
        self.check_target(target)
        return self

    @property
    def tap_layers(self) -> list[int] | None:
        """Target decoder layers (output of layer ``i``) whose features the drafter reads, or ``None``."""
        return None

    @property
    def max_depth(self) -> int | None:
        """The deepest level one step may draft (a block drafter's block), ``None`` for no limit."""
        return None

    @property
    def default_depth(self) -> int:
        """``tree_depth`` when the call does not set it."""
        return self.max_depth or 8

    # ---- the call's settings ------------------------------------------------------------------------
    def check_length(self, max_length: int) -> None:
        """``ValueError`` when the drafter cannot draft a generation of ``max_length`` tokens."""

    def check_settings(self, depth: int, tree_waves: int | None, denoise_steps: int | None) -> None:
        """``ValueError`` naming the setting this kind does not take (run before any forward)."""
        if denoise_steps is not None:
            raise ValueError(f"denoise_steps sets a diffusion drafter's denoising forwards per draft; a {self.describe()} "
                             "drafts in one pass. Drop denoise_steps.")
        if tree_waves is not None and self.expansion != "branches":
            raise ValueError(f"tree_waves sets how many forwards a branch-expanding drafter may run per step; this "
                             f"{self.describe()} drafts every depth in one forward. Drop tree_waves.")
        if self.max_depth is not None and depth > self.max_depth:
            raise ValueError(f"tree_depth={depth} exceeds the {self.describe()}'s block_size={self.max_depth}: one block "
                             "drafts at most block_size positions. Lower tree_depth.")

    def describe(self) -> str:
        """A few words naming the drafter in messages."""
        return self.kind

    def run_settings(self, depth: int, denoise_steps: int | None = None) -> dict:
        """What ``output.stats`` reports about the drafter for a call of ``depth`` levels (its kind and kind-specific
        settings)."""
        return {"drafter": self.kind}

    def start(self, context: DrafterContext, depth: int, denoise_steps: int | None = None) -> DrafterState:
        """The state of one ``generate`` call, after the prefill (``context``: the prompts, the taps of
        :attr:`tap_layers`, the target's vocabulary; ``depth``: the call's ``tree_depth``; ``denoise_steps``: the
        call's, checked by :meth:`check_settings`)."""
        raise NotImplementedError(f"The {self.kind!r} drafter kind defines no start(context, depth, denoise_steps).")


class DrafterState:
    """A drafter's per-call state for the active rows (see the module docstring).

    Its statistics (``output.draft_stats``): ``forwards``, ``seconds`` (their time), ``fed_tokens`` (input slots,
    summed over forwards) and ``skipped_tokens`` (committed tokens left out of the drafter's context), which the
    state counts itself.

    The per-call cache a drafter with its own KV cache keeps lives here once: :meth:`open_cache` makes
    :attr:`slots` (a :class:`~hf_paralleldecode.engine.cache.SlotCache` over a ``DynamicCache``: committed context,
    then the slots this step drafted, ``step_slots`` of them); :meth:`place` records which of them each node of a branch
    drafter's trees holds; :meth:`end_step` crops the step's slots and compacts, :meth:`select` follows finished rows.
    """

    _timer: DeviceTimer | None = None  # the forwards timed by timed() (made at the first one, on its device)

    def __init__(self):
        self.forwards = 0  # drafter forwards
        self.seconds = 0.0  # their time (a kind adds its own, or times its forwards with timed())
        self.fed_tokens = 0  # input slots fed, summed over forwards
        self.skipped_tokens = 0  # committed tokens left out of the drafter's context (a capped catch-up)
        self.slots: SlotCache | None = None  # the drafter's own cache (open_cache), if any
        self.step_slots = 0  # slots this step appended after the context (end_step crops them)
        self._branches: list[dict[int, tuple[int, ...]]] = []  # per row: node -> block slots of it and its ancestors

    @property
    def seconds(self) -> float:
        """The drafter forwards' seconds: what the kind added, plus the forwards it ran under :meth:`timed`."""
        return self._seconds + (self._timer.seconds if self._timer is not None else 0.0)

    @seconds.setter
    def seconds(self, value: float) -> None:  # (``state.seconds += t`` adds t)
        self._seconds = float(value) - (self._timer.seconds if self._timer is not None else 0.0)

    def timed(self, device) -> contextlib.AbstractContextManager:
        """Time a drafter forward on ``device`` into :attr:`seconds` without making the host wait (on CUDA: events
        read when the seconds are asked for, :class:`~hf_paralleldecode.engine.timing.DeviceTimer`)."""
        if self._timer is None:
            self._timer = DeviceTimer(device)
        return self._timer.timing()

    # ---- the step (what the tree grower calls) ---------------------------------------------------
    def marginals(self, step: DraftStep) -> torch.Tensor:
        """``"marginals"`` drafters: ``[active, D, V]`` raw logits for depths ``1..D`` after each row's root, with
        ``D >= step.depth`` (a drafter whose cost depends on it may feed a shorter block; it may return more)."""
        raise NotImplementedError(f"{type(self).__name__} defines no marginals(step).")

    def expand(self, step: DraftStep, nodes: DraftNodes) -> torch.Tensor:
        """``"branches"`` drafters: raw logits ``[len(nodes), V]`` of the children of one wave of ``nodes``, in their
        order, each conditioned on its own branch; the first wave of a step is every drafting row's root."""
        raise NotImplementedError(f"{type(self).__name__} defines no expand(step, nodes).")

    def update(self, step: DraftStep, tree: PackedTree, verdict: Verdict) -> None:
        """Learn what the verification of ``step``'s ``tree`` committed: ``verdict.path`` ``[active, L]`` (accepted
        nodes from the root, -1 past the end), ``verdict.num_accepted`` ``[active]``, ``verdict.tokens``
        ``[active, L]`` (committed: the accepted drafts, then the target's bonus token); ``tree.depth``
        ``[active, nodes]``. A plain step (the roots alone, nothing drafted) is verified and learnt too."""
        raise NotImplementedError(f"{type(self).__name__} defines no update(step, tree, verdict).")

    def end_step(self) -> None:
        """Drop this step's drafted slots (the cache's last :attr:`step_slots` slots) and forget the step's nodes; compact
        the cache when its holes are worth it."""
        if self.slots is None:
            return
        if self.step_slots:
            self.slots.cache.crop(-self.step_slots)
            self.step_slots = 0
        for placed in self._branches:
            placed.clear()
        self.slots.compact_if_worth_it()

    def select(self, kept: torch.Tensor) -> None:
        """Keep only the rows ``kept`` (positions among the active rows); a state with per-row tensors of its own
        narrows them after calling this."""
        if self.slots is not None:
            self.slots.select_rows(kept)
            self._branches = [{} for _ in range(len(kept))]  # (end_step emptied them)

    # ---- the cache bookkeeping -----------------------------------------------------------------------
    def open_cache(self, batch: int, device, dtype: torch.dtype) -> SlotCache:
        """Give the state its own empty KV cache for ``batch`` rows (keys and values in ``dtype``): :attr:`slots`."""
        self.slots = SlotCache(DynamicCache(), torch.zeros(batch, 0, dtype=torch.bool, device=device), dtype)
        self._branches = [{} for _ in range(batch)]
        return self.slots

    def place(self, row: int, node: int, parent: int, slot: int) -> tuple[int, ...]:
        """Record that ``node`` of active row ``row`` (child of ``parent``) holds block slot ``slot`` this step; return
        the block slots of its ancestors placed this step (what its slot must see besides the context and itself)."""
        above = self._branches[row].get(parent, ())
        self._branches[row][node] = above + (slot,)
        return above


def check_state(drafter: Drafter, state: DrafterState) -> DrafterState:
    """``state`` as :meth:`Drafter.start` returned it, or ``TypeError`` naming the members its drafter's
    :attr:`~Drafter.expansion` needs and it lacks."""
    if not isinstance(state, DrafterState):
        raise TypeError(f"{type(drafter).__name__}.start() returned a {type(state).__name__}, not a DrafterState.")
    needed = ("marginals" if drafter.expansion == "marginals" else "expand", "update")
    missing = [name for name in needed if _owner(type(state), name) is DrafterState]
    if missing:
        raise TypeError(f"{type(state).__name__}, the state of a {drafter.expansion!r} drafter ({drafter.describe()}), "
                        f"defines no {' or '.join(missing)}: see docs/architecture.md.")
    return state


@dataclass
class DraftStats:
    """What a drafted run measured (``output.draft_stats``; the bench reads it).

    ``tau``: accepted drafted tokens + 1 per drafting step and row (the convention of the JetSpec, DFlash and
    EAGLE papers); ``accepted_lengths``: per drafting step, per active row; ``drafting_cost``: ``c = (T_draft /
    N) / T_verify`` (JetSpec Appendix G, ``N`` the drafted nodes per step). ``steps`` are drafting steps: a plain
    step the batch policy chose drafts nothing and is not counted. ``drafter_skipped_tokens``: committed tokens left
    out of the drafter's context (0 for drafters that always catch up in full)."""

    drafter: str
    tau: float
    max_accepted_length: int
    accepted_lengths: list[list[int]] = field(repr=False)
    steps: int
    drafter_forwards: int
    drafter_seconds: float
    drafter_fed_tokens: int
    drafted_nodes: int
    drafting_cost: float
    draft_host_seconds: float
    #: committed tokens (all rows) the drafter's context left out: a block-causal DEER drafter catches up on at most
    #: its last ``max_catch_up`` tokens per row after a run of plain steps, the older ones stay a hole
    drafter_skipped_tokens: int = 0

    @property
    def drafter_forwards_per_step(self) -> float:
        return self.drafter_forwards / max(self.steps, 1)

    @property
    def drafter_tokens_per_forward(self) -> float:
        return self.drafter_fed_tokens / max(self.drafter_forwards, 1)

    def as_stats(self) -> dict:
        """The flat keys of ``output.stats``."""
        out = {k: v for k, v in asdict(self).items() if k not in ("drafter", "drafter_forwards", "drafter_fed_tokens",
                                                                   "steps", "drafted_nodes")}
        out.update(mean_accepted_length=self.tau, drafter_forwards_per_step=self.drafter_forwards_per_step,
                   drafter_tokens_per_forward=self.drafter_tokens_per_forward)
        return out


#: drafter kind name -> class; adding a kind = one file whose class is decorated with :func:`register_drafter_kind`
#: (the built-in kinds are imported by the package, ``drafters/__init__.py``)
DRAFTER_KINDS: dict[str, type] = {}


def _owner(cls: type, name: str) -> type | None:
    """The class of ``cls``'s MRO that defines ``name``."""
    return next((k for k in cls.__mro__ if name in vars(k)), None)


def register_drafter_kind(cls):
    """Class decorator: add a :class:`Drafter` subclass to :data:`DRAFTER_KINDS` under its ``kind``, after checking
    that it defines the required members (``ValueError`` naming the missing ones)."""
    if not (isinstance(cls, type) and issubclass(cls, Drafter)):
        raise ValueError(f"register_drafter_kind takes a subclass of Drafter, got {cls!r}.")
    if not isinstance(cls.kind, str) or not cls.kind or cls.kind in DRAFTER_KINDS:
        raise ValueError(f"drafter kind {cls.kind!r} is empty or registered twice")
    expansion = vars(cls).get("expansion", cls.expansion)
    if not isinstance(expansion, property) and expansion not in EXPANSIONS:
        raise ValueError(f"drafter kind {cls.kind!r}: expansion must be one of {EXPANSIONS}, got {expansion!r}.")
    required = ["check_target", "start"] + (["read_checkpoint"] if cls.FORMATS else []) + \
        (["export"] if cls.EXPORT_FORMATS else [])
    missing = [name for name in required if _owner(cls, name) is Drafter]
    if missing:
        raise ValueError(f"drafter kind {cls.kind!r} ({cls.__name__}) does not define {', '.join(missing)}: every kind "
                         "defines check_target and start, and read_checkpoint / export when it lists FORMATS / "
                         "EXPORT_FORMATS (docs/architecture.md).")
    DRAFTER_KINDS[cls.kind] = cls
    return cls


def drafter_kind(obj) -> str | None:
    """The registered kind of a drafter object, ``None`` for anything else."""
    return obj.kind if isinstance(obj, Drafter) and obj.kind in DRAFTER_KINDS else None


def target_facts(target) -> dict:
    """What a drafter records of its target: hidden size, vocabulary rows (input embeddings), decoder layers and
    ``model_type``, as ``target_*`` keys."""
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    return dict(
        target_hidden_size=int(config.hidden_size),
        target_vocab_size=int(target.get_input_embeddings().weight.shape[0]),
        target_num_hidden_layers=int(config.num_hidden_layers),
        target_model_type=getattr(config, "model_type", None),
    )


def default_target_layer_ids(num_target_layers: int, count: int) -> list[int]:
    """``count`` layers spread evenly over ``1 .. L - 3`` (the last layers are the LM head's business).

    Small targets use every layer they have except the last one.
    """
    if num_target_layers <= 3:
        return sorted({min(i, num_target_layers - 1) for i in range(min(count, num_target_layers))})
    lo, hi = 1, num_target_layers - 3
    if count == 1:
        return [(lo + hi) // 2]
    return sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)})


def logit_rows(model) -> int | None:
    """Rows of a model's logits, from its output embedding or its config (None when neither says)."""
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is not None and getattr(out, "weight", None) is not None:
        return int(out.weight.shape[0])
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    return getattr(config, "vocab_size", None)


def target_vocab_size(target) -> int:
    """Rows of the target's logits (its vocabulary as the verifier sees it)."""
    return logit_rows(target)


def upload_saved(drafter, repo_id: str, commit_message: str, private: bool | None = None, token=None,
                 revision: str | None = None, **kwargs) -> str:
    """Create ``repo_id`` if needed and upload what ``drafter.save_pretrained`` writes (weights, config, card)."""
    import tempfile

    from huggingface_hub import HfApi

    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    with tempfile.TemporaryDirectory() as tmp:
        drafter.save_pretrained(tmp)
        info = api.upload_folder(folder_path=tmp, repo_id=repo_id, commit_message=commit_message,
                                 revision=revision, **kwargs)
    return str(info)


class CardSaving:
    """``save_pretrained`` / ``push_to_hub`` of a ``PreTrainedModel`` drafter: only the drafter (safetensors), its config
    and its own model card (``model_card()``); the target's weights never."""

    upload_message = "Upload drafter"

    def save_pretrained(self, save_directory, *args, **kwargs):
        kwargs["safe_serialization"] = True
        readme = Path(save_directory) / "README.md"
        card = None if readme.exists() else self.model_card()  # before any file is written
        out = super().save_pretrained(save_directory, *args, **kwargs)
        if card is not None:
            readme.write_text(card)
        return out

    def push_to_hub(self, repo_id: str, commit_message: str | None = None, private: bool | None = None, token=None,
                    revision: str | None = None, **kwargs) -> str:
        """Upload what :meth:`save_pretrained` writes (the stock ``push_to_hub`` would replace the card)."""
        return upload_saved(self, repo_id, commit_message or self.upload_message, private, token, revision, **kwargs)
