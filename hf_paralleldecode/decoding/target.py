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

import inspect
import time

import torch
from torch import nn

__all__ = ["TargetForward", "HiddenStateTaps", "decoder_layers"]


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
        def hook(module, args, output):
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
        self.seconds = 0.0
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._cuda = model.device.type == "cuda"
        self.token_type_ids = None  # [batch, prompt_len] when given: new tokens repeat each row's last type

    def prompt_inputs(self) -> dict:
        return {} if self.token_type_ids is None else {"token_type_ids": self.token_type_ids}

    def step_inputs(self, rows: torch.Tensor, shape) -> dict:
        """Per-token inputs of new tokens, extended as stock ``_update_model_kwargs_for_generation`` does."""
        if self.token_type_ids is None:
            return {}
        return {"token_type_ids": self.token_type_ids[rows.to(self.token_type_ids.device), -1:].expand(shape)}

    def _run(self, logits_to_keep: int, **kwargs) -> torch.Tensor:
        extra = {"logits_to_keep": logits_to_keep} if self._takes_logits_to_keep else {}
        if self._cuda:
            torch.cuda.synchronize(self.model.device)
        t0 = time.perf_counter()
        out = self.model(use_cache=True, **kwargs, **extra)
        if self._cuda:
            torch.cuda.synchronize(self.model.device)
        self.seconds += time.perf_counter() - t0
        self.num_forward_passes += 1
        return out.logits

    def prefill(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        """Feed the prompt; return the fp32 logits of its last position ``[batch, vocab]``."""
        device = self.model.device
        logits = self._run(
            1, input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device), past_key_values=cache,
            **{k: v.to(device) for k, v in self.prompt_inputs().items()},
        )
        return logits[:, -1].float().to(input_ids.device)

    def forward(self, tree, slots, first_positions: torch.Tensor, rows: torch.Tensor | None = None,
                fp32: bool = True) -> torch.Tensor:
        """One forward of ``tree`` after each row's committed slots; logits ``[active, nodes, vocab]``, in fp32
        unless ``fp32=False`` (the model's dtype: a greedy argmax without processors picks the same token,
        since widening bf16 / fp16 to fp32 is exact, and skips a copy of every logit).

        Node ``j`` of a row sits at position ``first_positions[row] + depth[row, j]`` and attends
        to the row's committed slots plus its ancestors-or-self (``tree.mask``).
        """
        device = self.model.device
        logits = self._run(
            0, input_ids=tree.tokens.to(device),
            position_ids=(first_positions[:, None] + tree.depth).to(device),
            attention_mask=slots.attention_mask(tree.mask).to(device), past_key_values=slots.cache,
            **({} if rows is None else {k: v.to(device) for k, v in self.step_inputs(rows, tree.tokens.shape).items()}),
        )
        return (logits.float() if fp32 else logits).to(tree.tokens.device)
