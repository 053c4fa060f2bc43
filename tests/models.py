"""Tiny random causal LMs built in-process (no downloads) for the test tables."""

from __future__ import annotations

import functools

import torch
import transformers

import hf_paralleldecode as hfpd

VOCAB = 97
BOS, EOS, PAD = 1, 2, 0

_COMMON = dict(vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD, initializer_range=0.2)
_LLAMA_LIKE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512,
)

ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _LLAMA_LIKE),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _LLAMA_LIKE),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_LLAMA_LIKE, "head_dim": 8}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_LLAMA_LIKE, "sliding_window": None}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_LLAMA_LIKE, "head_dim": 8}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_LLAMA_LIKE, "num_key_value_heads": 4}),
    "gpt_neox": (
        "GPTNeoXConfig", "GPTNeoXForCausalLM",
        dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512),
    ),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=32, n_layer=2, n_head=4, n_positions=512)),
}


def tiny_model(arch: str = "llama", attn: str = "sdpa", seed: int = 0, **overrides):
    config_name, model_name, kwargs = ARCHITECTURES[arch]
    config = getattr(transformers, config_name)(**{**_COMMON, **kwargs, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    model.set_attn_implementation(attn)
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    model.generation_config.bos_token_id = BOS
    return model.eval()


def prompts(batch: int, length: int = 7, pad_left: tuple[int, ...] = (0, 3, 1), seed: int = 1):
    """Random prompts; row i is left-padded with ``pad_left[i]`` pad tokens (batch > 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    if batch > 1:
        for i in range(batch):
            p = pad_left[i % len(pad_left)]
            mask[i, :p] = 0
    ids[mask == 0] = PAD
    return ids, mask


def word_tokenizer():
    """A word-level tokenizer over the tiny vocabulary: token i is spelled ``t{i}``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t3"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t2")


@functools.cache
def enabled(arch: str, attn: str = "sdpa"):
    """A cached tiny model of ``arch`` passed through ``hf_paralleldecode.enable``."""
    return hfpd.enable(tiny_model(arch, attn=attn))


@functools.cache
def reference(arch: str, batch: int, max_new_tokens: int, attn: str = "sdpa"):
    """Stock greedy output on ``prompts(batch)`` (cached across the equivalence tables)."""
    ids, mask = prompts(batch)
    return enabled(arch, attn).generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                        do_sample=False)


class RecordingStreamer:
    """Streamer that records every ``put`` and counts ``end`` calls."""

    def __init__(self):
        self.values, self.ended = [], 0

    def put(self, value):
        self.values.append(value.clone())

    def end(self):
        self.ended += 1


class ForwardRecorder:
    """Wraps model.forward to record what each target forward is fed."""

    def __init__(self, model):
        self.calls = []
        self.model = model
        orig = model.forward

        def forward(*args, **kwargs):
            cache = kwargs.get("past_key_values")
            self.calls.append(dict(
                fed=kwargs["input_ids"].shape[1],
                cached=cache.get_seq_length() if cache is not None else 0,
                first_position=int(kwargs["position_ids"][0, 0]) if kwargs.get("position_ids") is not None else None,
            ))
            return orig(*args, **kwargs)

        model.forward = forward

    def restore(self):
        del self.model.forward
