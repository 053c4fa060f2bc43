"""Benchmark: stock greedy ``generate`` (AR) and parallel decodings side by side, in one process.

Method
    Every repeat runs, for each prompt, AR first and then every strategy on the same inputs
    (interleaved, so drifts of a noisy machine hit all of them alike); one untimed warm-up pass
    comes first. Every timed run starts after a full garbage collection (untimed), so no run pays for garbage
    an earlier one left: a full collection of the bench's process took about 230 ms on 2 CPU threads, and it landed
    on whichever run crossed the collector's threshold. Per run it records:

    * end-to-end seconds (the whole ``generate`` call) and decode-only seconds (from the first
      generated token reaching the streamer to the end), hence tokens/s both ways;
    * target forward passes and their total seconds, through forward hooks on the model (the
      same instrument for AR and for strategies; CUDA is synchronised in the hooks), hence
      TPF = generated tokens / (forward passes x rows per call), i.e. tokens per forward per
      sequence (padding after a row's EOS is not counted), and loop overhead = 1 - forward time /
      wall time;
    * whether the generated tokens equal AR's (exact match).

    Reported per strategy: medians over repeats of the per-repeat totals, speedup = AR seconds /
    strategy seconds within the same repeat (median). Writes ``bench.json`` (with each strategy's
    settings and resolved settings), ``bench.png`` and, when strategies differ in ``tree_budget``,
    ``tree_budget.png`` (charts need matplotlib; ``report["files"]`` lists what was written).

Stock peers
    ``transformers_prompt_lookup`` and ``dflash_transformers`` run transformers' own assisted generation, which
    is batch-1 only: at batch > 1 they run row by row (``sequential_rows`` in the report).
    ``transformers_fast_path`` is stock decoding on transformers' own fast path (a static cache and a compiled
    forward; on a CPU through the switch transformers provides to compile on every device).

One attention order
    Every entry, stock and its peers included, runs under the run's attention priority (``attention_priority``,
    recorded in the report), so no entry's gain is the order's. Where the run's order differs from torch's own (a
    GPU where torch tries cuDNN's attention first), ``ar_torch_order`` adds stock under torch's order: what the
    order alone gives stock, on a line of its own.

What it deliberately does not do
    Assert anything about speed: it measures and reports.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .attention import (  # noqa: F401 - SDPA_BACKENDS's old home
    SDPA_BACKENDS,
    check_attention_priority,
    check_sdpa_backends,
    decoding_attention,
    get_attention_priority,
    sdpa_backends_context,
    sdpa_priority_names,
)
from .attention import attention_priority as priority_context
from .decoding.policy.memory import memory_scope
from .integration import STOCK

logger = logging.getLogger(__name__)

__all__ = ["StrategySpec", "parse_strategy", "run_benchmark", "random_model", "load_prompts"]


@dataclass
class StrategySpec:
    """A decoding and its settings, written ``name:key=value,key=value`` on the command line."""

    decoding: str
    settings: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        if not self.settings:
            return self.decoding
        return self.decoding + "(" + ",".join(f"{k}={v}" for k, v in sorted(self.settings.items())) + ")"


def _parse_value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


#: how ``name:key=value`` writes a setting's ``None``
_NONE_TEXTS = ("None", "none")


def _setting_type(settings_cls, key: str) -> tuple[type | None, bool]:
    """``(bool, int, float or str: the setting's one simple type, else None; whether its type admits None)``."""
    import types
    import typing

    try:
        hint = typing.get_type_hints(settings_cls).get(key, typing.Any) if settings_cls is not None else typing.Any
    except Exception:  # noqa: BLE001 - an annotation that does not resolve here: any value
        hint = typing.Any
    if hint is typing.Any:
        return None, True
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    rest = [a for a in args if a is not type(None)]
    return (rest[0] if len(rest) == 1 and rest[0] in (bool, int, float, str) else None), len(rest) < len(args)


def _parse_setting(settings_cls, key: str, text: str):
    """The value ``text`` writes for setting ``key`` of ``settings_cls`` (``None``: a stock peer's argument):
    ``None`` / ``none`` is ``None`` where the setting's type admits it and refused where it does not; a bool, int,
    float or str setting gets that type when the text reads as one (else the generic reading, which the settings'
    own check then refuses naming the setting)."""
    simple, admits_none = _setting_type(settings_cls, key)
    if text in _NONE_TEXTS:
        if admits_none:
            return None
        default = settings_cls.defaults().get(key)
        raise ValueError(f"`{key}` does not take None (default {default!r}): write a value, or leave it out "
                         "for its default.")
    if simple is str:
        return text
    if simple is bool:
        return {"true": True, "false": False}.get(text.lower(), text)
    if simple in (int, float):
        try:
            return simple(text)
        except ValueError:
            pass
    return _parse_value(text)


@dataclass(frozen=True)
class StockPeer:
    """An in-ecosystem peer: stock ``generate`` with ``defaults`` (plus what ``prepare`` builds).

    transformers' assisted generation (prompt lookup, DFlash) runs one row at a time: at batch > 1
    the bench runs such a peer row after row (``sequential_rows`` in the report), which is what a
    user of it would do.
    """

    defaults: dict
    prepare: object = None  # (model, settings) -> generate kwargs
    batch_one: bool = True
    attention: str | None = None  # "torch": run under torch's own attention order, not the run's


def _dflash_assistant(model, settings: dict) -> dict:
    """``drafter=`` (or the model's attached head) exported to transformers' DFlash drafter and loaded."""
    from .integration import attached_drafter

    settings = dict(settings)
    head = _resolve_drafter(settings).get("drafter") or attached_drafter(model)
    settings.pop("drafter", None)
    if head is None:
        raise ValueError("dflash_transformers needs a block_bidirectional head: dflash_transformers:drafter=PATH, "
                         "or --drafter PATH.")
    key = ("dflash", id(head))
    if key not in _HEADS:
        import tempfile

        from transformers import AutoModel

        from .drafters.export import export_draft_head

        with tempfile.TemporaryDirectory() as tmp:
            export_draft_head(head, tmp, format="transformers")
            _HEADS[key] = AutoModel.from_pretrained(tmp).to(device=model.device, dtype=model.dtype).eval()
    return {"assistant_model": _HEADS[key], "speculation_type": "dflash", **settings}


def _fast_path(model, settings: dict) -> dict:
    """Stock decoding with a static cache and a compiled forward (:func:`~.compat.fast_path_generate_kwargs`)."""
    from .compat import fast_path_generate_kwargs

    return {**fast_path_generate_kwargs(model.device), **settings}


#: transformers' own fast and speculative paths, benchmarked next to this library's strategies
STOCK_PEERS = {
    "transformers_prompt_lookup": StockPeer({"prompt_lookup_num_tokens": 10}),
    "transformers_fast_path": StockPeer({}, prepare=_fast_path, batch_one=False),
    "dflash_transformers": StockPeer({}, prepare=_dflash_assistant),
    "ar_torch_order": StockPeer({}, batch_one=False, attention="torch"),
}
#: the peers every bench table shows beside stock eager (``hf-paralleldecode bench`` adds them unless told not to)
BASELINE_PEERS = ("transformers_fast_path", "transformers_prompt_lookup")


def parse_strategy(text: str) -> StrategySpec:
    """``name:key=value,...``: a registered decoding, or a stock peer (``transformers_prompt_lookup``)."""
    from .registry import available_decodings, settings_class, unknown_settings_hint

    name, _, rest = text.partition(":")
    if name not in STOCK_PEERS and name not in available_decodings():
        raise ValueError(
            f"Unknown strategy {name!r}. Available decodings: {', '.join(available_decodings())}; "
            f"stock peers: {', '.join(STOCK_PEERS)}."
        )
    cls = None if name in STOCK_PEERS else settings_class(name)  # a peer's settings are generate arguments
    settings = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"Bad strategy setting {item!r} in {text!r}: write key=value.")
        try:
            settings[key.strip()] = _parse_setting(cls, key.strip(), value.strip())
        except ValueError as err:
            raise ValueError(f"Bad strategy setting {item!r} in {text!r}: {err}") from None
    if cls is not None:
        known = sorted(cls.names())
        unknown = cls.unknown(settings)
        if unknown:
            raise ValueError(f"Unknown setting(s) {unknown} of strategy {name!r} in {text!r}"
                             f"{unknown_settings_hint(unknown, known)}. Its settings: {', '.join(known)}.")
    return StrategySpec(name, settings)


def load_prompts(path: str | Path, column: str = "prompt") -> list[str]:
    """The prompts of a file: see :func:`hf_paralleldecode.prompts.read_prompts` (one reader for every command)."""
    from .prompts import read_prompts

    return read_prompts(path, column)

def random_model(name: str, vocab_size: int, seed: int = 0):
    """Randomly initialised timing models (Qwen2): ``random-1b`` (Llama-3.2-1B's layers, ~1.0B parameters with the
    embedded tokenizer's 8k vocabulary), ``random-100m`` (~120M) or ``random-tiny``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    sizes = {
        "random-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                          num_key_value_heads=8),
        "random-100m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                            num_key_value_heads=12),
        "random-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2),
    }
    if name not in sizes:
        raise ValueError(f"Unknown random model {name!r}; choose from {sorted(sizes)}.")
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, **sizes[name])
    model = Qwen2ForCausalLM(config)
    model.set_attn_implementation("sdpa")
    return model


class _ForwardTimer:
    """Counts target forward passes and their seconds through module hooks; ``calls``: each forward's rows (``None``:
    not known) and seconds, in order."""

    def __init__(self, model):
        self.count, self.seconds, self._t0, self._rows = 0, 0.0, None, None
        self.calls: list[tuple[int | None, float]] = []
        self._cuda = next(model.parameters()).is_cuda
        self._handles = [model.register_forward_pre_hook(self._pre, with_kwargs=True),
                         model.register_forward_hook(self._post)]

    def _sync(self):
        if self._cuda:
            torch.cuda.synchronize()

    def _pre(self, module, args, kwargs):
        inputs = next((x for x in (kwargs.get("input_ids"), kwargs.get("inputs_embeds"), *args[:1])
                       if torch.is_tensor(x)), None)
        self._rows = int(inputs.shape[0]) if inputs is not None else None
        self._sync()
        self._t0 = time.perf_counter()

    def _post(self, module, args, output):
        self._sync()
        seconds = time.perf_counter() - self._t0
        self.seconds += seconds
        self.count += 1
        self.calls.append((self._rows, seconds))

    def reset(self):
        self.count, self.seconds = 0, 0.0
        self.calls = []

    def tail(self, batch: int) -> tuple[float, float]:
        """``(seconds, total)``: the forward seconds of the decoding forwards (every one after the first, the prompt's)
        that fed fewer rows than ``batch`` (rows that finished waiting for the slowest), and of all of them."""
        decode = self.calls[1:]
        return (sum(s for rows, s in decode if rows is not None and rows < batch), sum(s for _, s in decode))

    def remove(self):
        for h in self._handles:
            h.remove()


class _FirstTokenClock:
    """Streamer that notes when the first generated token arrives (the prompt is the first put)."""

    def __init__(self, sync):
        self.puts, self.first_token_time, self._sync = 0, None, sync

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self._sync()
            self.first_token_time = time.perf_counter()

    def end(self):
        pass


_HEADS: dict = {}  # loaded heads by path / alias, exported DFlash drafters by head


def _resolve_drafter(settings: dict) -> dict:
    """``drafter=PATH`` (a draft-head or diffusion-drafter folder, repo id or alias) becomes the loaded drafter
    (loaded once)."""
    drafter = settings.get("drafter")
    if not isinstance(drafter, str):
        return settings
    if drafter not in _HEADS:
        from .drafters.loading import load_drafter

        _HEADS[drafter] = load_drafter(drafter)
    return {**settings, "drafter": _HEADS[drafter]}


def draft_acceptance(accepted_lengths: list[list[int]]) -> dict:
    """From a run's per-step, per-row accepted lengths (accepted drafts + 1): ``tau`` (their mean),
    ``max_accepted_length``, ``steps`` and ``acceptance_by_depth`` (for depth ``d = 1, 2, ...``: the share of
    steps that reached depth ``d - 1`` whose draft at depth ``d`` was accepted, i.e. the conditional
    acceptance rate along the block)."""
    flat = [n for step in accepted_lengths for n in step]
    if not flat:
        return {}
    longest = max(flat)
    reached = [sum(1 for n in flat if n - 1 >= d) for d in range(longest)]  # accepted drafts >= d
    return dict(tau=sum(flat) / len(flat), max_accepted_length=longest, steps=len(flat),
                acceptance_by_depth=[reached[d] / reached[d - 1] for d in range(1, longest) if reached[d - 1]])


def _draft_summary(draft: dict | None) -> dict:
    """Over every prompt of the last repeat: :func:`draft_acceptance`, and what one drafter forward cost
    (milliseconds, and for diffusion drafters the input slots it was fed)."""
    if draft is None:
        return {}
    out = draft_acceptance(draft["accepted"])
    if draft["forwards"]:
        out["drafter_ms_per_forward"] = 1e3 * draft["seconds"] / draft["forwards"]
        if draft["tokens"]:
            out["drafter_tokens_per_forward"] = draft["tokens"] / draft["forwards"]
    return out


def _generate_kwargs(model, spec: StrategySpec | None) -> dict:
    if spec is None:  # AR: stock generate, even if the checkpoint carries decoding defaults
        return dict(decoding=STOCK)
    peer = STOCK_PEERS.get(spec.decoding)
    if peer is None:
        return dict(decoding=spec.decoding, **_resolve_drafter(spec.settings))
    settings = {**peer.defaults, **spec.settings}
    return dict(decoding=STOCK, **(peer.prepare(model, settings) if peer.prepare else settings))


def _row_by_row(spec: StrategySpec | None, batch: int) -> bool:
    return spec is not None and spec.decoding in STOCK_PEERS and STOCK_PEERS[spec.decoding].batch_one and batch > 1


@contextlib.contextmanager
def _entry_attention(model, spec: StrategySpec | None):
    """Stock and its peers under the run's attention order, as the decodings run (``decode`` enters it per call); a
    peer that asks for torch's own order (``ar_torch_order``) gets that."""
    peer = STOCK_PEERS.get(spec.decoding) if spec is not None else None
    if spec is not None and peer is None:  # a decoding of this library: its calls enter the order themselves
        yield
        return
    with contextlib.ExitStack() as order:
        if peer is not None and peer.attention is not None:
            order.enter_context(priority_context(peer.attention))
        order.enter_context(decoding_attention(model.device))
        yield


def _one_run(model, enc, spec: StrategySpec | None, max_new_tokens: int, timer: _ForwardTimer,
             sampling: dict | None = None):
    with _entry_attention(model, spec):
        return _timed_run(model, enc, spec, max_new_tokens, timer, sampling)


def _timed_run(model, enc, spec: StrategySpec | None, max_new_tokens: int, timer: _ForwardTimer,
               sampling: dict | None = None):
    sync = timer._sync
    clock = _FirstTokenClock(sync)
    draw = dict(do_sample=True, **sampling) if sampling is not None else dict(do_sample=False)
    kwargs = dict(max_new_tokens=max_new_tokens, streamer=clock, **draw, **_generate_kwargs(model, spec))
    prompt_len = enc["input_ids"].shape[1]
    pad = model.generation_config.pad_token_id
    eos = model.generation_config.eos_token_id
    resolved, stats, ours, draft = {}, {}, False, None
    gc.collect()  # (untimed: each run pays for its own garbage only)
    timer.reset()
    sync()
    t0 = time.perf_counter()
    sequential = _row_by_row(spec, enc["input_ids"].shape[0])
    if sequential:
        rows = []
        for ids, mask in zip(enc["input_ids"], enc["attention_mask"]):
            keep = mask.bool()
            out = model.generate(input_ids=ids[keep][None], attention_mask=mask[keep][None], **kwargs)
            rows.append(out[0, int(keep.sum()) :])
            kwargs["streamer"] = None  # the first row's first token is the batch's first token
        width = max(len(r) for r in rows)
        fill = pad if pad is not None else 0
        gen = torch.stack([torch.cat([r, r.new_full((width - len(r),), fill)]) for r in rows])
        row_forwards = timer.count
    else:
        ours = kwargs["decoding"] != STOCK
        out = model.generate(**enc, **kwargs, **({"return_dict_in_generate": True} if ours else {}))
        if ours:  # the settings the strategy resolved (device presets, defaults), as its stats report them
            from .registry import settings_class

            names = settings_class(kwargs["decoding"]).names()
            resolved = {k: v for k, v in out.stats.items() if k in names and isinstance(v, (bool, int, float, str))}
            drafted = out.draft_stats  # learned drafters: summed over the prompts by run_benchmark
            stats, out = out.stats, out.sequences
            if drafted is not None:
                draft = dict(accepted=drafted.accepted_lengths, seconds=drafted.drafter_seconds,
                             forwards=drafted.drafter_forwards, tokens=drafted.drafter_fed_tokens)
        gen = out[:, prompt_len:]
        # a row finished early leaves our strategies' forwards; stock greedy keeps computing every row
        row_forwards = stats["row_forwards"] if ours else gen.shape[0] * timer.count
    sync()
    t1 = time.perf_counter()
    # row by row (a batch-1 peer) every forward has fewer rows than the batch: no tail to speak of
    tail = (0.0, 0.0) if sequential else timer.tail(enc["input_ids"].shape[0])
    tokens = _count_generated(gen, pad, eos)
    budget_steps = max(timer.count - 1, 0) if ours and "budget_optional_nodes_per_step" in stats else 0
    first = clock.first_token_time or t1
    return dict(
        seconds=t1 - t0,
        decode_seconds=max(t1 - first, 1e-9),
        tokens=tokens,
        forwards=timer.count,
        row_forwards=row_forwards,
        # the forward hooks time the model's own call; a greedy step applies the LM head after it (model work too)
        forward_seconds=timer.seconds + (stats.get("greedy_head_seconds", 0.0) if ours else 0.0),
        generated=gen.cpu(),
        resolved=resolved,
        draft=draft,
        # cost-aware budgets: the decoding steps they chose for, and the optional nodes fed over them
        budget_steps=budget_steps,
        budget_nodes=stats.get("budget_optional_nodes_per_step", 0.0) * budget_steps,
        # the batch policy: active rows of the steps of each shape (the plain ones did not speculate)
        shape_row_steps=stats.get("shape_row_steps", {}) if ours else {},
        step_trace=stats.get("step_trace") if ours else None,
        # the decoding forwards' seconds with fewer rows than the batch (rows that finished early), and all of them
        tail_seconds=tail[0],
        decode_forward_seconds=tail[1],
    )


def _count_generated(gen: torch.Tensor, pad, eos) -> int:
    """Generated tokens up to and including each row's first EOS (padding after it not counted)."""
    if eos is None:
        return int(gen.numel())
    eos_ids = torch.tensor(eos if isinstance(eos, list) else [eos])
    total = 0
    for row in gen.cpu():
        hits = torch.isin(row, eos_ids).nonzero()
        total += int(hits[0, 0]) + 1 if hits.numel() else row.numel()
    return total


def check_generation_length(model, max_new_tokens: int, prompt_length: int) -> None:
    """Refuse (``ValueError``), before anything runs, a ``max_new_tokens`` that is not an integer >= 1 or that takes
    the longest prompt batch (``prompt_length`` tokens, padding included) past the model's positions: such a run would
    go on until killed (stock generate past the positions, and every strategy after it)."""
    from .engine.settings import check_int_setting, model_positions

    check_int_setting("max_new_tokens", max_new_tokens, 1)
    positions = model_positions(model)
    if positions is None or prompt_length + max_new_tokens <= positions:
        return
    room = positions - prompt_length
    fix = (f"Lower --max-new-tokens (max_new_tokens) to at most {room}." if room >= 1 else
           "The prompts alone fill them: use shorter prompts.")
    raise ValueError(f"max_new_tokens={max_new_tokens} (--max-new-tokens) is more than {type(model).__name__} can "
                     f"generate: prompt + new tokens must fit its {positions} positions (max_position_embeddings), "
                     f"and the longest prompt batch has {prompt_length} tokens. {fix}")


def run_benchmark(
    model,
    tokenizer,
    prompts: list[str],
    strategies: list[StrategySpec],
    max_new_tokens: int = 128,
    repeats: int = 3,
    batch_size: int = 1,
    output_dir: str | Path | None = None,
    progress: bool = True,
    model_name: str = "model",
    sampling: dict | None = None,
    chat_template: bool | None = None,
    sdpa_backends: list[str] | None = None,
    attention_priority: str | list[str] | None = None,
    trace_steps: bool = False,
) -> dict:
    """Run AR and ``strategies`` interleaved; return (and optionally write) the report.

    ``prompts``: strings, or conversations (lists of ``{"role", "content"}`` messages). ``chat_template`` decides
    whether the tokenizer's chat template is applied with the generation prompt, as data collection does
    (:func:`~hf_paralleldecode.prompts.chat_prompts`: by default for conversations, plain strings stay raw); the
    report records the choice (``prompt_format``).

    ``sampling``: sampling settings (``temperature``, ``top_p``, ``top_k``) for runs with ``do_sample=True``
    (stock sampling is then the baseline). Every run of a prompt batch starts from the same torch seed,
    and ``exact_match_vs_ar`` is ``None``: sampled outputs are compared in distribution by the tests,
    not row by row.

    ``sdpa_backends``: the attention backends every run may use (names of :data:`SDPA_BACKENDS`; ``None``: torch's
    own choice), stock generate's included, so the entries stay comparable. On Hopper GPUs recent torch puts
    cuDNN's attention first for bf16 and fp16, and cuDNN builds a graph for each new shape: decoding, whose key
    length grows every step, then pays that on each forward (``["flash", "efficient", "math"]`` keeps it out).

    ``attention_priority``: the attention priority of the decoding entries (not stock's; ``None``: the process's,
    :func:`hf_paralleldecode.attention.set_attention_priority`, by default ``"auto"``: cuDNN's attention after the
    others where torch tries it first). The report records it and torch's own order (``sdpa_priority_order``).

    ``trace_steps``: keep what the batch policy did on every step of every call of an entry that runs it
    (``step_traces``: per repeat, per prompt batch, the call's ``stats["step_trace"]``: ``[shape, active rows,
    committed tokens, seconds, setup]`` a step)."""
    if not isinstance(trace_steps, bool):
        raise ValueError(f"trace_steps takes True or False, got {trace_steps!r}.")
    sdpa_backends = check_sdpa_backends(sdpa_backends)
    priority = get_attention_priority() if attention_priority is None else check_attention_priority(attention_priority)
    if sampling is not None:
        unknown = sorted(set(sampling) - {"temperature", "top_p", "top_k"})
        if unknown:
            raise ValueError(f"sampling takes temperature, top_p and top_k; got {unknown}.")
    from tqdm.auto import tqdm

    from .integration import enable

    enable(model)
    device = next(model.parameters()).device
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    from .prompts import chat_prompts

    texts, prompt_format = chat_prompts(tokenizer, list(prompts), chat_template)
    batches = [texts[i : i + batch_size] for i in range(0, len(texts), batch_size)]
    # templated text holds the template's special tokens already
    encoded = [tokenizer(b, return_tensors="pt", padding=True, add_special_tokens=prompt_format != "chat_template")
               .to(device) for b in batches]
    check_generation_length(model, max_new_tokens, max((e["input_ids"].shape[1] for e in encoded), default=0))
    if device.type == "cuda" and priority != "torch" and all(s.decoding != "ar_torch_order" for s in strategies):
        strategies = [*strategies, parse_strategy("ar_torch_order")]  # what the order alone gives stock: its own line
    entries: list[StrategySpec | None] = [None, *strategies]
    labels = ["ar", *[s.label for s in strategies]]
    timer = _ForwardTimer(model)
    # per label, per repeat: summed totals; per label: exact matches vs AR
    totals = {lab: [] for lab in labels}
    matches = {lab: [0, 0] for lab in labels}
    resolved = {lab: {} for lab in labels}
    drafts = {lab: None for lab in labels}  # learned drafters: accepted lengths and drafter cost of the last repeat
    backends = contextlib.ExitStack()
    backends.enter_context(sdpa_backends_context(sdpa_backends))
    backends.enter_context(priority_context(priority))
    try:
        # each entry learns only from its own calls (memory_scope): entries that share a drafter and a policy key
        # (`speculative` and `speculative:max_step_tokens=1`) would otherwise keep each other's step times fresh
        for enc in encoded:  # warm-up, untimed
            for lab, spec in zip(labels, entries):
                with memory_scope(lab):
                    _one_run(model, enc, spec, min(max_new_tokens, 8), timer, sampling)
        bar = tqdm(total=repeats * len(encoded) * len(entries), disable=not progress, desc="bench")
        for _ in range(repeats):
            drafts = {lab: None for lab in labels}
            acc = {lab: dict(seconds=0.0, decode_seconds=0.0, tokens=0, decode_tokens=0, forwards=0,
                             forward_seconds=0.0, rows=0, row_forwards=0, budget_nodes=0.0, budget_steps=0,
                             shape_row_steps={}, tail_seconds=0.0, decode_forward_seconds=0.0, step_traces=[])
                   for lab in labels}
            for b, enc in enumerate(encoded):
                ar_generated = None
                for lab, spec in zip(labels, entries):
                    if sampling is not None:
                        torch.manual_seed(b)
                    with memory_scope(lab):
                        res = _one_run(model, enc, spec, max_new_tokens, timer, sampling)
                    a = acc[lab]
                    rows = res["generated"].shape[0]
                    for key in ("seconds", "decode_seconds", "tokens", "forwards", "forward_seconds"):
                        a[key] += res[key]
                    a["decode_tokens"] += res["tokens"] - rows
                    a["rows"] += rows
                    a["row_forwards"] += res["row_forwards"]
                    a["tail_seconds"] += res["tail_seconds"]
                    a["decode_forward_seconds"] += res["decode_forward_seconds"]
                    a["budget_nodes"] += res["budget_nodes"]
                    a["budget_steps"] += res["budget_steps"]
                    for shape, n in res["shape_row_steps"].items():
                        a["shape_row_steps"][shape] = a["shape_row_steps"].get(shape, 0) + n
                    if trace_steps and res["step_trace"] is not None:
                        a["step_traces"].append(res["step_trace"])
                    resolved[lab] = res["resolved"] or resolved[lab]
                    if res["draft"] is not None:
                        d = drafts[lab] = drafts[lab] or dict(accepted=[], seconds=0.0, forwards=0, tokens=0.0)
                        d["accepted"] += res["draft"]["accepted"]
                        for key in ("seconds", "forwards", "tokens"):
                            d[key] += res["draft"][key]
                    if spec is None:
                        ar_generated = res["generated"]
                    elif sampling is None:
                        same = [torch.equal(x, y) for x, y in zip(res["generated"], ar_generated)]
                        matches[lab][0] += sum(same)
                        matches[lab][1] += len(same)
                    bar.update(1)
            for lab in labels:
                totals[lab].append(acc[lab])
        bar.close()
    finally:
        backends.close()
        timer.remove()

    report = dict(
        model=model_name,
        parameters=sum(p.numel() for p in model.parameters()),
        device=str(device),
        dtype=str(next(model.parameters()).dtype).replace("torch.", ""),
        torch_threads=torch.get_num_threads(),
        prompts=len(prompts),
        prompt_format=prompt_format,
        batch_size=batch_size,
        max_new_tokens=max_new_tokens,
        repeats=repeats,
        sampling=dict(do_sample=True, **sampling) if sampling is not None else None,
        sdpa_backends=sdpa_backends,
        cudnn=torch.backends.cudnn.version() if device.type == "cuda" else None,
        attention_priority=priority if isinstance(priority, str) else list(priority),
        sdpa_priority_order=sdpa_priority_names() if device.type == "cuda" else None,
        results={},
    )
    ar = totals["ar"]
    for lab, spec in zip(labels, entries):
        runs = totals[lab]
        med = statistics.median
        report["results"][lab] = dict(
            decoding=spec.decoding if spec else "ar",
            settings={k: v if isinstance(v, (bool, int, float, str, type(None))) else type(v).__name__
                      for k, v in (spec.settings if spec else {}).items()},
            sequential_rows=_row_by_row(spec, batch_size),
            resolved_settings=resolved[lab],
            # learned drafters: tau, the longest accepted block, conditional acceptance by depth, drafter cost
            **_draft_summary(drafts[lab]),
            tpf=med(r["tokens"] / max(r["row_forwards"], 1) for r in runs),
            tokens_per_second=med(r["tokens"] / r["seconds"] for r in runs),
            decode_tokens_per_second=med(r["decode_tokens"] / r["decode_seconds"] for r in runs),
            speedup_vs_ar=med(a["seconds"] / r["seconds"] for a, r in zip(ar, runs)),
            # each repeat's own (in order: a learning strategy's first repeat also pays its exploration)
            speedup_by_repeat=[round(a["seconds"] / r["seconds"], 4) for a, r in zip(ar, runs)],
            # None when there is no decode phase (one new token, or every row stops at once)
            decode_speedup_vs_ar=med(
                (r["decode_tokens"] / r["decode_seconds"]) / (a["decode_tokens"] / a["decode_seconds"])
                for a, r in zip(ar, runs)
            ) if all(a["decode_tokens"] > 0 for a in ar) else None,
            exact_match_vs_ar=None if sampling is not None else (matches[lab][0] / matches[lab][1]) if lab != "ar"
            else 1.0,
            loop_overhead=med(1.0 - r["forward_seconds"] / r["seconds"] for r in runs),
            # host time (everything but the target forwards) per decoding step, in milliseconds
            host_ms_per_step=med(1e3 * (r["seconds"] - r["forward_seconds"]) / max(r["forwards"], 1) for r in runs),
            forward_passes=med(r["forwards"] for r in runs),
            # the share of the decoding forwards' time spent with fewer rows than the batch: rows that finished
            # early while the batch waits for its slowest (stock greedy keeps every row to the end: 0); None for a
            # batch-1 peer run row by row
            tail_time_share=None if _row_by_row(spec, batch_size) else
            med(r["tail_seconds"] / r["decode_forward_seconds"] if r["decode_forward_seconds"] > 0 else 0.0
                for r in runs),
            # cost_aware=True: optional (drafted) nodes the budget fed per step
            **({"budget_optional_nodes_per_step": med(r["budget_nodes"] / max(r["budget_steps"], 1) for r in runs)}
               if any(r["budget_steps"] for r in runs) else {}),
            # the batch policy (adaptive=True): the share of row-steps that speculated (did not run a plain step)
            # and the row-steps of each shape, over every repeat
            **({"speculated_row_share": med(1.0 - r["shape_row_steps"].get("plain", 0) / sum(r["shape_row_steps"].values())
                                            for r in runs),
                "shape_row_steps": {k: sum(r["shape_row_steps"].get(k, 0) for r in runs)
                                    for k in dict.fromkeys(k for r in runs for k in r["shape_row_steps"])}}
               if all(r["shape_row_steps"] for r in runs) else {}),
            generated_tokens=med(r["tokens"] for r in runs),
            seconds=med(r["seconds"] for r in runs),
            **({"step_traces": [r["step_traces"] for r in runs]}
               if all(r["step_traces"] for r in runs) else {}),
        )
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        written = [out / "bench.json"]
        if plot_report(report, out / "bench.png"):
            written.append(out / "bench.png")
        if scaling_series(report, "tree_budget") and plot_scaling(report, "tree_budget", out / "tree_budget.png"):
            written.append(out / "tree_budget.png")
        report["files"] = [str(f) for f in written]
        (out / "bench.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    return report


def _pyplot(chart: str):
    """``matplotlib.pyplot`` with the Agg backend, or ``None`` (warned) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover - optional dependency
        logger.warning("matplotlib is not installed (pip install 'hf_paralleldecode[bench]'); no %s chart written.",
                       chart)
        return None
    return plt


def _save(plt, fig, path) -> bool:
    """Lay out, write and close a chart; True (it was written)."""
    import warnings

    with warnings.catch_warnings():  # long labels can leave no room for a tighter layout: keep the default one
        warnings.simplefilter("ignore", UserWarning)
        fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def plot_report(report: dict, path: str | Path) -> bool:
    """Bar charts of tokens/s, TPF and loop overhead per strategy (needs matplotlib: ``[bench]`` extra)."""
    plt = _pyplot("bench")
    if plt is None:
        return False
    labels = list(report["results"])
    res = report["results"]
    panels = [
        ("tokens_per_second", "tokens/s (end to end)"),
        ("tpf", "tokens per forward (TPF)"),
        ("loop_overhead", "time outside forward (share)"),
        ("host_ms_per_step", "host time per step (ms)"),
    ]
    panels = [(k, t) for k, t in panels if all(k in res[lab] for lab in labels)]  # older reports lack a column
    fig, axes = plt.subplots(1, len(panels), figsize=(4 + 2.9 * len(labels), 4))
    for ax, (key, title) in zip(axes, panels):
        values = [res[lab][key] for lab in labels]
        bars = ax.bar(range(len(labels)), values, color=["#888888"] + ["#3b75af"] * (len(labels) - 1))
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        fmt = "{:.1%}" if key == "loop_overhead" else "{:.2f}"
        for b, v in zip(bars, values):
            ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
    fig.suptitle(f"{report['model']} on {report['device']} ({report['dtype']}), batch {report['batch_size']}, "
                 f"{report['max_new_tokens']} new tokens", fontsize=10)
    return _save(plt, fig, path)


def scaling_series(report: dict, key: str) -> dict[str, list[tuple]]:
    """Entries that differ only in setting ``key``, grouped: ``{group label: [(value, result), ...]}``
    (groups with at least two values, sorted by value)."""
    groups: dict[str, list] = {}
    for res in report["results"].values():
        settings = res.get("settings", {})
        if key not in settings:
            continue
        rest = {k: v for k, v in settings.items() if k != key}
        name = res["decoding"] + ("(" + ",".join(f"{k}={v}" for k, v in sorted(rest.items())) + ")" if rest else "")
        groups.setdefault(name, []).append((settings[key], res))
    return {name: sorted(pts, key=lambda p: p[0]) for name, pts in groups.items() if len(pts) > 1}


def plot_scaling(report: dict, key: str, path: str | Path) -> bool:
    """TPF (tau) and tokens/s against setting ``key`` per group, other entries as horizontal lines
    (JetSpec Figure 4 on this machine: does tau keep rising with the tree budget?)."""
    plt = _pyplot("scaling")
    if plt is None:
        return False
    series = scaling_series(report, key)
    flat = [(lab, r) for lab, r in report["results"].items() if key not in r.get("settings", {})]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (metric, title) in zip(axes, [("tpf", "tau = tokens per target forward"), ("tokens_per_second",
                                                                                      "tokens/s (end to end)")]):
        for name, pts in series.items():
            ax.plot([v for v, _ in pts], [r[metric] for _, r in pts], marker="o", label=name)
        for i, (lab, r) in enumerate(flat):
            ax.axhline(r[metric], linestyle="--", color=f"C{len(series) + i}", linewidth=1, label=lab)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(key)
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{report['model']} on {report['device']} ({report['dtype']}), batch {report['batch_size']}, "
                 f"{report['prompts']} prompts x {report['max_new_tokens']} new tokens", fontsize=10)
    return _save(plt, fig, path)


def plot_batch_sizes(reports: list[dict], path: str | Path) -> bool:
    """Tokens/s and TPF of every entry against the batch size (one report per batch size)."""
    plt = _pyplot("batch-size")
    if plt is None or len(reports) < 2:
        return False
    reports = sorted(reports, key=lambda r: r["batch_size"])
    sizes = [r["batch_size"] for r in reports]
    labels = list(reports[0]["results"])
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.5))
    for ax, (metric, title) in zip(axes, [("tokens_per_second", "tokens/s (end to end, all rows)"),
                                          ("speedup_vs_ar", "speed against stock batched (ar = 1)"),
                                          ("tpf", "tokens per forward per row (TPF)")]):
        for i, lab in enumerate(labels):
            ys = [r["results"][lab][metric] if lab in r["results"] else float("nan") for r in reports]
            ax.plot(sizes, ys, marker="o", label=lab, color="#888888" if lab == "ar" else f"C{i}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size")
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=7)
    first = reports[0]
    fig.suptitle(f"{first['model']} on {first['device']} ({first['dtype']}), {first['prompts']} prompts x "
                 f"{first['max_new_tokens']} new tokens", fontsize=10)
    return _save(plt, fig, path)


def format_report(report: dict) -> str:
    """The results as a text table; the first column is as wide as the longest label."""
    w = max(12, *(len(lab) for lab in report["results"])) + 2
    head = (f"{'strategy':<{w}}{'TPF':>6}{'tok/s':>9}{'dec tok/s':>11}{'speedup':>9}{'exact':>7}{'overhead':>10}"
            f"{'host ms/step':>14}{'spec rows':>11}{'tail':>7}")
    lines = [head, "-" * len(head)]
    for lab, r in report["results"].items():
        lines.append(
            f"{lab:<{w}}{r['tpf']:>6.2f}{r['tokens_per_second']:>9.1f}{r['decode_tokens_per_second']:>11.1f}"
            f"{r['speedup_vs_ar']:>8.2f}x{_exact(r['exact_match_vs_ar']):>7}{r['loop_overhead']:>10.1%}"
            f"{r.get('host_ms_per_step', float('nan')):>14.2f}"
            + (f"{r['speculated_row_share']:>11.0%}" if "speculated_row_share" in r else f"{'':>11}")
            + (f"{r['tail_time_share']:>7.0%}" if r.get("tail_time_share") is not None else f"{'':>7}")
        )
    return "\n".join(lines)


def _exact(rate) -> str:
    """The exact-match column: a share, or ``n/a`` for sampled runs (compared in distribution, not row by row)."""
    return "n/a" if rate is None else f"{rate:.0%}"


def grid_strategies(decoding: str, grid: dict[str, list]) -> list[StrategySpec]:
    """Every combination of ``grid`` values as a strategy (first key varies slowest)."""
    import itertools

    keys = list(grid)
    return [StrategySpec(decoding, dict(zip(keys, values))) for values in itertools.product(*grid.values())]


def plot_sweep(report: dict, decoding: str, grid: dict[str, list], path: str | Path) -> bool:
    """Heatmaps of TPF and tokens/s over a two-setting grid (Jacobi Forcing's Figure 7b on this machine)."""
    if len(grid) != 2:
        logger.warning("sweep chart needs exactly two settings; got %s", list(grid))
        return False
    plt = _pyplot("sweep")
    if plt is None:
        return False
    (ky, ys), (kx, xs) = grid.items()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, (metric, title) in zip(axes, [("tpf", "TPF"), ("tokens_per_second", "tokens/s (end to end)")]):
        values = [[report["results"][StrategySpec(decoding, {ky: y, kx: x}).label][metric] for x in xs] for y in ys]
        im = ax.imshow(values, origin="lower", cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(xs)), [str(x) for x in xs])
        ax.set_yticks(range(len(ys)), [str(y) for y in ys])
        ax.set_xlabel(kx)
        ax.set_ylabel(ky)
        ax.set_title(f"{decoding}: {title}")
        for yi, row in enumerate(values):
            for xi, v in enumerate(row):
                ax.text(xi, yi, f"{v:.2f}" if metric == "tpf" else f"{v:.1f}", ha="center", va="center",
                        color="white", fontsize=8)
        fig.colorbar(im, ax=ax)
    ar = report["results"]["ar"]
    fig.suptitle(f"{report['model']} on {report['device']}; AR: {ar['tokens_per_second']:.1f} tokens/s", fontsize=10)
    return _save(plt, fig, path)

