"""The one interface every drafter kind implements, and the typed statistics of a drafted run.

A drafter kind (a file of this package plus one entry of :data:`DRAFTER_KINDS`) owns
    * its config and weights (loading them strictly: :mod:`.loading` recognises the formats);
    * the slot layout its training and its inference share;
    * its checks against the target (vocabulary, sizes, tapped layers, lengths);
    * per run, a :class:`DrafterState` (made by :meth:`Drafter.start`): its cache of target features
      or tokens, its per-row state, and its forwards.

What the tree grower (``decoding/speculative.py``) asks of a state, and nothing else
    * ``expansion == "marginals"`` (block drafters: DFlash heads, DEER): :meth:`DrafterState.marginals`
      gives per-depth distributions for a block after each row's root; a node at depth ``d`` takes its
      children from depth ``d + 1``.
    * ``expansion == "branches"`` (autoregressive / causal drafters: JetSpec tree-causal heads,
      EAGLE-3): :meth:`DrafterState.expand` gives, for given nodes of the growing trees, the
      distribution of their children conditioned on the node's own branch.
    Both return logits over the *target's* vocabulary (``-inf`` for tokens the drafter cannot
    propose), so ``q`` is a distribution over the target vocabulary and rejection sampling stays exact.
    After verification :meth:`DrafterState.update` receives the tree, the verdict and (for drafters that
    read target features) the verification forward's tapped features.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

__all__ = ["Drafter", "DrafterState", "DraftStats", "DRAFTER_KINDS", "register_drafter_kind", "drafter_kind",
           "target_vocab_size", "logit_rows", "SHIPPED_DRAFTERS", "shipped_drafter_dir", "ASSETS_DIR"]

#: the package's shipped checkpoints (the embedded models, heads and drafters)
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"

#: aliases of the drafters shipped for the embedded model -> their folder under ``assets/``
SHIPPED_DRAFTERS = {
    "default-jetspec": "stdlib-coder-8m-jetspec-head",  # recipes/draft_head_tiny_cpu.yaml
    "default-dflash": "stdlib-coder-8m-dflash-head",  # recipes/dflash_head_tiny_cpu.yaml
    "default-deer": "stdlib-coder-8m-deer",  # recipes/deer
    "default-eagle3": "stdlib-coder-8m-eagle3",  # recipes/eagle3_tiny_cpu.yaml
}


def shipped_drafter_dir(name) -> Path | None:
    """The folder of a shipped drafter alias (:data:`SHIPPED_DRAFTERS`), else ``None``."""
    folder = SHIPPED_DRAFTERS.get(name) if isinstance(name, str) else None
    return None if folder is None else ASSETS_DIR / folder


class Drafter:
    """Mixin of every drafter kind (an ``nn.Module`` or a ``PreTrainedModel`` besides)."""

    #: the registry name (:data:`DRAFTER_KINDS`)
    kind: str = ""
    #: ``"marginals"`` or ``"branches"`` (see the module docstring)
    expansion: str = "marginals"

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

    def check_target(self, target, tokenizer=None) -> None:  # pragma: no cover - interface
        """``ValueError`` naming the mismatch when ``target`` is not a model this drafter drafts for."""
        raise NotImplementedError

    def bind(self, target):
        """Check ``target`` (:meth:`check_target`) and borrow what the drafter reads of it (embeddings, LM head, its
        depth); returns self. What :attr:`tap_layers` names may depend on it (an EAGLE-3 checkpoint that records
        no taps)."""
        self.check_target(target)
        return self

    def copy_to(self, device=None, dtype=None):
        """A copy of the drafter that shares no weights or state with this one, on ``device`` / ``dtype`` (unbound: what
        this one borrowed from its target, if anything, is not copied)."""
        import copy

        borrowed = self.__dict__.get("_target")
        twin = copy.deepcopy(self, {id(borrowed): []} if borrowed is not None else {})
        return twin.to(device=device, dtype=dtype)

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

    def run_settings(self) -> dict:
        """What ``output.stats`` reports about the drafter (its kind and kind-specific settings)."""
        return {"drafter": self.kind}

    def start(self, run, taps, vocab: int, depth: int, **settings) -> DrafterState:  # pragma: no cover - interface
        """The state of one ``generate`` call (``run``: the decode run after the prefill; ``taps``: the
        :class:`~hf_paralleldecode.engine.target.HiddenStateTaps` of :attr:`tap_layers`, or ``None``)."""
        raise NotImplementedError


class DrafterState:
    """A drafter's per-call state for the active rows (see the module docstring)."""

    expansion = "marginals"

    def __init__(self):
        self.forwards = 0  # drafter forwards
        self.seconds = 0.0  # their time
        self.fed_tokens = 0  # input slots fed, summed over forwards
        self.skipped_tokens = 0  # committed tokens left out of the drafter's context (a capped catch-up)

    def marginals(self, roots: torch.Tensor, root_pos: torch.Tensor, depth: int | None = None) -> torch.Tensor:
        """``[active, D, V]`` raw logits for depths ``1..D`` after each row's root. ``depth``: the depths this step
        needs (a drafter whose cost depends on it may feed a shorter block; it may also return more)."""
        raise NotImplementedError

    def expand(self, builders, wanted: list[list[int]], roots: torch.Tensor, root_pos: torch.Tensor) -> torch.Tensor:
        """Raw logits ``[n, V]`` of the children of the ``wanted`` nodes (per row, node ids of
        ``builders[i]``), in row-major order; ``None`` from a state that can expand no further this step."""
        raise NotImplementedError  # pragma: no cover

    def update(self, tree, verdict, root_pos: torch.Tensor) -> None:  # pragma: no cover - interface
        """Learn what was committed (accepted path + bonus token)."""
        raise NotImplementedError

    def end_step(self) -> None:
        """Drop this step's drafted slots."""

    def select(self, kept: torch.Tensor) -> None:  # pragma: no cover - interface
        """Keep only the rows ``kept`` (positions among the active rows)."""
        raise NotImplementedError


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


#: drafter kind name -> class; adding a kind = one file plus one entry (:func:`register_drafter_kind`)
DRAFTER_KINDS: dict[str, type] = {}


def register_drafter_kind(cls):
    """Class decorator: add a :class:`Drafter` subclass to :data:`DRAFTER_KINDS` under its ``kind``."""
    if not cls.kind or cls.kind in DRAFTER_KINDS:
        raise ValueError(f"drafter kind {cls.kind!r} is empty or registered twice")
    DRAFTER_KINDS[cls.kind] = cls
    return cls


def drafter_kind(obj) -> str | None:
    """The registered kind of a drafter object, ``None`` for anything else."""
    return obj.kind if isinstance(obj, Drafter) and obj.kind in DRAFTER_KINDS else None


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
        out = super().save_pretrained(save_directory, *args, **kwargs)
        readme = Path(save_directory) / "README.md"
        if not readme.exists():
            readme.write_text(self.model_card())
        return out

    def push_to_hub(self, repo_id: str, commit_message: str | None = None, private: bool | None = None, token=None,
                    revision: str | None = None, **kwargs) -> str:
        """Upload what :meth:`save_pretrained` writes (the stock ``push_to_hub`` would replace the card)."""
        return upload_saved(self, repo_id, commit_message or self.upload_message, private, token, revision, **kwargs)
