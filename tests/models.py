"""Tiny random causal LMs built in-process (no downloads) for the test tables."""

from __future__ import annotations

import functools

import torch
import transformers

import hf_paralleldecode as hfpd
from hf_paralleldecode.compat import user_cache

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
#: architectures the strategies refuse (ALiBi: positions come from the 2D mask); built by tiny_model too
REFUSED_ARCHITECTURES = {
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(hidden_size=32, n_layer=2, n_head=4)),
}


def tiny_model(arch: str = "llama", attn: str = "sdpa", seed: int = 0, **overrides):
    config_name, model_name, kwargs = {**ARCHITECTURES, **REFUSED_ARCHITECTURES}[arch]
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


class FakeClock:
    """A clock for the batch policy that moves only when told: ``clock.advance(0.05)``; ``clock()`` reads it."""

    def __init__(self, now: float = 0.0):
        self.now = float(now)

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ForwardRecorder:
    """Wraps model.forward to record what each target forward is fed (and, with ``keep_logits``, its logits)."""

    def __init__(self, model, keep_logits: bool = False):
        self.calls, self.logits = [], []
        self.model = model
        orig = model.forward

        def forward(*args, **kwargs):
            cache = user_cache(kwargs)
            self.calls.append(dict(
                fed=kwargs["input_ids"].shape[1],
                cached=cache.get_seq_length() if cache is not None else 0,
                first_position=int(kwargs["position_ids"][0, 0]) if kwargs.get("position_ids") is not None else None,
            ))
            out = orig(*args, **kwargs)
            if keep_logits:
                self.logits.append(out.logits.detach().clone())
            return out

        model.forward = forward

    def restore(self):
        del self.model.forward


def launch_two_processes(cli_args: list[str], timeout: int = 600):
    """Run ``hf_paralleldecode.cli CLI_ARGS`` as 2 CPU processes under ``accelerate launch`` (gloo); assert success."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(port), "-m", "hf_paralleldecode.cli", *cli_args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", ACCELERATE_USE_CPU="true")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def saved_model_and_prompts(root, prompts: list[str]):
    """A tiny Llama + word tokenizer saved under ``root/model`` and ``prompts`` as ``root/prompts.jsonl``."""
    import json

    tiny_model("llama").save_pretrained(root / "model")
    word_tokenizer().save_pretrained(root / "model")
    path = root / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return root / "model", path


def small_prompts(batch: int = 3):
    """:func:`prompts` mapped into tokens 3..7, for an 8-token model where random drafters get many drafts
    accepted (so whole branches and long blocks are exercised)."""
    ids, mask = prompts(batch)
    return torch.where(mask.bool(), ids % 5 + 3, 0), mask
