"""The target model's forwards: prefill and one packed tree per step, timed and counted.

What it is for
    :class:`TargetForward` runs the target exactly as the strategies need it: the prompt once
    (``prefill``), then one forward per step over a packed token tree placed after each row's
    committed slots (``forward``), with explicit ``position_ids`` and the 4D mask built by the
    :class:`~.cache.SlotCache`. It counts forwards, times them (with a device sync on CUDA, so
    the figure is the forward's and not the launch's) and, when a drafter asks for them, records
    the hidden states of chosen decoder layers through forward hooks (:class:`HiddenStateTaps`):
    learned drafters read their features from the verification forward itself, never from an
    extra one.

What it deliberately does not know
    What the tree holds, how it is verified, what is committed.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref

import torch
from torch import nn

from ..compat import cache_kwargs
from .timing import DeviceTimer
from .verify import greedy_argmax

__all__ = ["TargetForward", "HiddenStateTaps", "GreedyHead", "decoder_layers"]


def decoder_layers(model) -> nn.ModuleList:
    """The target's stack of decoder layers (the ``ModuleList`` as long as ``num_hidden_layers``).

    Found by structure, not by class or attribute names, so it works for Llama-, Qwen-, GPT-2- or
    GPT-NeoX-style models alike; ``ValueError`` when no such list exists.
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = getattr(config, "num_hidden_layers", None)
    base = model.get_decoder() if hasattr(model, "get_decoder") else model
    for root in (base, model):
        for module in root.modules():
            if isinstance(module, nn.ModuleList) and len(module) == n and n:
                return module
    raise ValueError(
        f"Could not find the decoder layers of {type(model).__name__} (a ModuleList of num_hidden_layers={n} "
        "modules); draft heads need them to read the target's hidden states."
    )


class HiddenStateTaps:
    """Forward hooks that keep the output of chosen decoder layers from the latest target forward.

    ``layer_ids`` use the "output of decoder layer i" convention (transformers' DFlash
    ``target_layer_ids``). :meth:`features` concatenates them on the feature axis:
    ``[batch, seq, len(layer_ids) * hidden]``. Hooks are removed by :meth:`remove` (or the
    ``with`` block), so a model is never left modified.
    """

    def __init__(self, model, layer_ids: list[int]):
        layers = decoder_layers(model)
        bad = [i for i in layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(f"target_layer_ids {bad} out of range for a target with {len(layers)} layers.")
        self.layer_ids = list(layer_ids)
        self._out: dict[int, torch.Tensor] = {}
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in self.layer_ids]

    def _hook(self, i):
        owner = threading.get_ident()  # another thread's forward of the same model is not this call's

        def hook(module, args, output):
            if threading.get_ident() != owner:
                return None
            self._out[i] = output[0] if isinstance(output, (tuple, list)) else output

        return hook

    def features(self) -> torch.Tensor:
        missing = [i for i in self.layer_ids if i not in self._out]
        if missing:
            raise RuntimeError(f"No hidden states recorded for layers {missing}: run a target forward first.")
        return torch.cat([self._out[i] for i in self.layer_ids], dim=-1)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._out = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


class TargetForward:
    """Counted, timed target forwards (see module docstring)."""

    def __init__(self, model):
        self.model = model
        self.num_forward_passes = 0
        self._forwards = DeviceTimer(model.device)  # forwards, the greedy head's work after them included
        self._head_time = DeviceTimer(model.device)  # the greedy head's share (outside the model's own forward call)
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.token_type_ids = None  # [batch, prompt_len] when given: new tokens repeat each row's last type
        self._head = False  # the model's GreedyHead (None: none), looked up on the call's first greedy step

    @property
    def seconds(self) -> float:
        """Seconds of the forwards so far, the greedy head's work after them included."""
        return self._forwards.seconds

    @property
    def head_seconds(self) -> float:
        """The greedy head's share of :attr:`seconds` (outside the model's own forward call)."""
        return self._head_time.seconds

    @property
    def vocab(self) -> int:
        """The ids the model embeds (its input embedding's rows)."""
        return int(self.model.get_input_embeddings().weight.shape[0])

    def prompt_inputs(self) -> dict:
        return {} if self.token_type_ids is None else {"token_type_ids": self.token_type_ids}

    def step_inputs(self, rows: torch.Tensor, shape) -> dict:
        """Per-token inputs of new tokens, extended as stock generation extends them between steps."""
        if self.token_type_ids is None:
            return {}
        return {"token_type_ids": self.token_type_ids[rows.to(self.token_type_ids.device), -1:].expand(shape)}

    def _run(self, logits_to_keep: int, **kwargs) -> torch.Tensor:
        extra = {"logits_to_keep": logits_to_keep} if self._takes_logits_to_keep else {}
        with self._forwards.timing():  # (on CUDA: events, read when the seconds are asked for; no wait here)
            out = self.model(use_cache=True, **kwargs, **extra)
        self.num_forward_passes += 1
        return out.logits

    def prefill(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        """Feed the prompt; return the fp32 logits of its last position ``[batch, vocab]``."""
        device = self.model.device
        logits = self._run(
            1, input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device), **cache_kwargs(self.model, cache),
            **{k: v.to(device) for k, v in self.prompt_inputs().items()},
        )
        return logits[:, -1].float().to(input_ids.device)

    def greedy(self, tree, slots, first_positions: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`forward` for a greedy step that reads nothing but the argmax: the target's choice at every node,
        ``[active, nodes]``, without materialising ``[active, nodes, vocab]`` logits.

        The model's LM head is fed an empty slice during the forward (a pre-hook keeps its input, the final
        hidden states), then applied here chunk by chunk, each chunk's logits argmax-ed while they are in cache
        (:class:`GreedyHead`). Whether a model's logits are exactly ``lm_head(final hidden)`` (no soft cap, no
        scale after the head) is checked on its first such step, which runs the plain forward; models that fail
        keep it. The head's time counts as the forward's.
        """
        if self._head is False:  # looked up once per call (the model's structure does not change within one)
            self._head = GreedyHead.of(self.model)
        head = None if self._head is None or self._head.refused else self._head
        if head is None or (head.checked and not head.worth_it(tree.tokens.numel())):
            return greedy_argmax(self.forward(tree, slots, first_positions, rows, fp32=False))
        if not head.checked:  # the model's first greedy step: the plain forward, and the check
            with head.capture(compute=True) as capture:
                logits = self.forward(tree, slots, first_positions, rows, fp32=False)
            head.check(capture, logits)
            return greedy_argmax(logits)
        with head.capture(compute=False) as capture:
            self.forward(tree, slots, first_positions, rows, fp32=False)
        with self._forwards.timing(), self._head_time.timing():
            choices = head.argmax(capture)
        return choices.to(tree.tokens.device)

    def forward(self, tree, slots, first_positions: torch.Tensor, rows: torch.Tensor | None = None,
                fp32: bool = True) -> torch.Tensor:
        """One forward of ``tree`` after each row's committed slots; logits ``[active, nodes, vocab]``, in fp32
        unless ``fp32=False`` (the model's dtype: a greedy argmax without processors picks the same token,
        since widening bf16 / fp16 to fp32 is exact, and skips a copy of every logit).

        Node ``j`` of a row sits at position ``first_positions[row] + depth[row, j]`` and attends
        to the row's committed slots plus its ancestors-or-self (``tree.mask``). A chain (a plain step, a Jacobi
        block) attends causally: it gets the 2D mask stock generation passes (:meth:`SlotCache.padding_mask`), so
        the model takes its own causal path, as in stock decoding.
        """
        device = self.model.device
        width = tree.tokens.shape[1]
        mask = slots.padding_mask(width) if tree.is_chain else slots.attention_mask(tree.mask)
        logits = self._run(
            0, input_ids=tree.tokens.to(device),
            position_ids=(first_positions[:, None] + tree.depth).to(device),
            **({} if mask is None else {"attention_mask": mask.to(device)}), **cache_kwargs(self.model, slots.cache),
            **({} if rows is None else {k: v.to(device) for k, v in self.step_inputs(rows, tree.tokens.shape).items()}),
        )
        return (logits.float() if fp32 else logits).to(tree.tokens.device)


class GreedyHead:
    """The argmax of a model's LM head over its final hidden states, in chunks that stay in cache (see
    :meth:`TargetForward.greedy`); one per model and model structure, found by :meth:`of`.

    Nothing about the model is trusted across a change: :meth:`of` compares the model's structure (its output
    embeddings, their weight's shape, dtype and device, every hook on the model and on the head, an instance
    ``forward``) with the one the head was checked on, and a changed model gets a new, unchecked head (checked
    again on its next greedy step). The capture hook acts only in the thread that installed it, and what it keeps
    belongs to that call: concurrent calls on one model (another thread's stock ``generate``) are untouched."""

    #: bytes of logits per chunk: a CPU chunk fits its L2 cache; a GPU chunk bounds the memory a wide batch needs
    CHUNK_BYTES = {"cpu": 1 << 21, "cuda": 1 << 28}
    _heads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, lm_head: nn.Linear):
        self.lm_head = lm_head
        self.checked = False  # logits == lm_head(hidden) seen on a real step
        self.refused = False  # logits != lm_head(hidden) seen: never used for this model
        self.hidden = None

    @classmethod
    def of(cls, model) -> GreedyHead | None:
        """The model's greedy head; ``None`` when its output embeddings are not a plain ``nn.Linear`` or its
        first checked step showed logits other than ``lm_head(hidden)``."""
        lm_head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        signature = cls.structure(model, lm_head)
        known = cls._heads.get(model)
        if known is None or known[0] != signature:
            known = (signature, cls(lm_head) if type(lm_head) is nn.Linear else None)
            cls._heads[model] = known
        head = known[1]
        return None if head is None or head.refused else head

    @staticmethod
    def structure(model, lm_head) -> tuple:
        """What the check of a head depends on: the head module and its weight, and every hook or instance
        ``forward`` that could change the logits after it."""
        def hooks(module):
            return tuple(id(h) for d in (module._forward_hooks, module._forward_pre_hooks) for h in d.values()) + (
                id(module.__dict__.get("forward")),)
        weight = getattr(lm_head, "weight", None)
        return (id(lm_head), type(lm_head), hooks(model), hooks(lm_head) if lm_head is not None else (),
                None if weight is None else (id(weight), tuple(weight.shape), weight.dtype, weight.device),
                len(nn.modules.module._global_forward_hooks),
                len(nn.modules.module._global_forward_pre_hooks))

    @contextlib.contextmanager
    def capture(self, compute: bool):
        """During the block the LM head keeps its input (once); with ``compute=False`` it computes nothing
        (an empty slice), :meth:`argmax` does it afterwards."""
        calls = []
        owner = threading.get_ident()

        def keep(module, args):
            if threading.get_ident() != owner:  # another thread's forward of this model: not ours
                return None
            calls.append(args[0])
            return None if compute else (args[0][..., :0, :],) + tuple(args[1:])

        handle = self.lm_head.register_forward_pre_hook(keep)
        capture = _Capture()
        try:
            yield capture
        finally:
            handle.remove()
        capture.hidden = calls[0] if len(calls) == 1 else None

    def check(self, capture, logits: torch.Tensor) -> None:
        """Keep this head for the model only if ``logits`` (the forward's own) equal ``lm_head(hidden)``."""
        hidden = capture.hidden
        with torch.no_grad():
            ok = hidden is not None and hidden.shape[:-1] == logits.shape[:-1] and \
                torch.equal(self.lm_head(hidden).to(logits.device), logits)
        self.checked, self.refused = ok, not ok

    def _chunk_bytes(self, device) -> int:
        """Logits per chunk: the device's chunk, and at least the head's weight (each chunk reads it once)."""
        weight = self.lm_head.weight
        return max(self.CHUNK_BYTES.get(device.type, 1 << 28), weight.numel() * weight.element_size())

    def worth_it(self, positions: int) -> bool:
        """Whether ``positions`` logits span more than two chunks: below that the plain forward's one head
        call is as cheap, and its logits are small anyway."""
        weight = self.lm_head.weight
        return positions * weight.shape[0] * weight.element_size() > 2 * self._chunk_bytes(weight.device)

    def argmax(self, capture) -> torch.Tensor:
        """``[*hidden.shape[:-1]]`` argmax of ``lm_head(hidden)`` of ``capture``, a chunk of positions at a time."""
        hidden = capture.hidden
        if hidden is None:
            raise RuntimeError("The LM head was not called exactly once in the forward: nothing to take the argmax of.")
        flat = hidden.reshape(-1, hidden.shape[-1])
        vocab = self.lm_head.weight.shape[0]
        per_chunk = max(1, self._chunk_bytes(flat.device) // (vocab * flat.element_size()))
        out = torch.empty(flat.shape[0], dtype=torch.long, device=flat.device)
        with torch.no_grad():
            for start in range(0, flat.shape[0], per_chunk):
                out[start: start + per_chunk] = greedy_argmax(self.lm_head(flat[start: start + per_chunk]))
        return out.reshape(hidden.shape[:-1])


class _Capture:
    """What one :meth:`GreedyHead.capture` kept: the LM head's input, when it was called exactly once."""

    hidden = None
