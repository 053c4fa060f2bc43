"""Train the embedded demo model: a tiny Qwen2 code model on the Python standard library.

No model can be downloaded on the machines this project runs on, so the project trains its
own default model. Everything here uses stock transformers / tokenizers APIs:

1. Corpus: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]``, minus ``site-packages``
   and ``__pycache__``. The top-level ``test/`` package is held out for evaluation.
2. Tokenizer: a byte-level BPE (``tokenizers``) trained on the training split.
3. Model: ``Qwen2ForCausalLM`` built from a config (sizes below), trained from scratch with
   ``transformers.Trainer`` on fixed-length chunks of the concatenated files.
4. Export: fp32 weights in safetensors plus the tokenizer, a ``generation_config.json`` and
   ``training_report.json`` (held-out loss, steps, tokens) into ``--export_dir``. The weights are
   exported in Llama layout (``LlamaForCausalLM`` with ``attention_bias=True`` and a zero
   ``o_proj`` bias: the same function, bit for bit), because ``AutoTokenizer`` replaces the
   tokenizer of every ``qwen2`` checkpoint with ``Qwen2Tokenizer``, which pre-tokenizes differently
   from the BPE trained here. ``--convert_only`` re-exports an existing Qwen2 export in place.

Reproduce the shipped model (2 CPU cores, about 2 hours; resumable):

    python recipes/demo_model/train_demo_model.py --output_dir runs/demo_model \
        --export_dir hf_paralleldecode/assets/stdlib-coder-8m

Rerunning the same command resumes from the newest checkpoint in ``--output_dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
from pathlib import Path

import torch


def stdlib_files(held_out: bool) -> list[Path]:
    """Sorted ``.py`` files of the standard library: the ``test/`` package if ``held_out``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if "site-packages" in rel or "__pycache__" in rel:
            continue
        if (rel[0] == "test") == held_out:
            out.append(path)
    return out


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return ""


def train_tokenizer(files: list[Path], vocab_size: int, out_dir: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
    )
    tok.train_from_iterator((read_text(f) for f in files), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        model_max_length=2048,
    )
    fast.save_pretrained(out_dir)
    return fast


def chunk_ids(tokenizer, files: list[Path], seq_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """Concatenate ``file <eos>`` streams and cut them into ``[num_chunks, seq_len]``."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for f in files:
        text = read_text(f)
        if not text:
            continue
        ids.extend(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids.append(eos)
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


class ChunkDataset(torch.utils.data.Dataset):
    def __init__(self, chunks: torch.Tensor):
        self.chunks = chunks

    def __len__(self):
        return self.chunks.shape[0]

    def __getitem__(self, i):
        x = self.chunks[i]
        return {"input_ids": x, "labels": x}


def build_model(vocab_size: int, args):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        attn_implementation="sdpa",
    )
    return Qwen2ForCausalLM(config)


def to_llama_layout(model):
    """The same network as ``LlamaForCausalLM``: Qwen2 = Llama with q/k/v biases and no o_proj bias."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = model.config
    config = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps, rope_parameters=dict(c.rope_parameters), hidden_act=c.hidden_act,
        tie_word_embeddings=c.tie_word_embeddings, attention_bias=True, mlp_bias=False,
        bos_token_id=c.bos_token_id, eos_token_id=c.eos_token_id, pad_token_id=c.pad_token_id,
    )
    llama = LlamaForCausalLM(config).to(model.dtype)
    state = dict(model.state_dict())
    for i in range(c.num_hidden_layers):
        state[f"model.layers.{i}.self_attn.o_proj.bias"] = torch.zeros(c.hidden_size, dtype=model.dtype)
    llama.load_state_dict(state, strict=True)
    llama.generation_config = model.generation_config
    return llama


def export(model, tokenizer, export_dir):
    export_dir = Path(export_dir)
    export_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config.do_sample = False
    to_llama_layout(model).save_pretrained(export_dir)
    tokenizer.save_pretrained(export_dir)


@torch.no_grad()
def held_out_loss(model, chunks: torch.Tensor, batch_size: int = 8) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, chunks.shape[0], batch_size):
        x = chunks[i : i + batch_size]
        out = model(input_ids=x, labels=x)
        n = x.numel() - x.shape[0]
        total += out.loss.item() * n
        count += n
    return total / max(count, 1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", default="runs/demo_model")
    p.add_argument("--export_dir", default="hf_paralleldecode/assets/stdlib-coder-8m")
    p.add_argument("--vocab_size", type=int, default=8192)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--hidden_size", type=int, default=256)
    p.add_argument("--intermediate_size", type=int, default=768)
    p.add_argument("--num_layers", type=int, default=8)
    p.add_argument("--num_heads", type=int, default=8)
    p.add_argument("--num_kv_heads", type=int, default=4)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--max_steps", type=int, default=1200)
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--save_steps", type=int, default=50)
    p.add_argument("--eval_tokens", type=int, default=200_000, help="held-out tokens from test/")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--convert_only", action="store_true",
                   help="re-export the Qwen2 checkpoint in --export_dir in Llama layout (exact) and exit")
    args = p.parse_args(argv)
    if args.convert_only:
        from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

        model = AutoModelForCausalLM.from_pretrained(args.export_dir)
        if model.config.model_type != "qwen2":
            raise SystemExit(f"{args.export_dir} is a {model.config.model_type!r} checkpoint, not qwen2: nothing to do.")
        export(model, PreTrainedTokenizerFast.from_pretrained(args.export_dir), args.export_dir)
        return

    from transformers import PreTrainedTokenizerFast, Trainer, TrainingArguments, set_seed

    if args.threads:
        torch.set_num_threads(args.threads)
    set_seed(args.seed)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    train_files, eval_files = stdlib_files(held_out=False), stdlib_files(held_out=True)

    tok_dir = out / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    else:
        t0 = time.time()
        tokenizer = train_tokenizer(train_files, args.vocab_size, tok_dir)
        print(f"tokenizer trained in {time.time() - t0:.0f}s on {len(train_files)} files", flush=True)

    cache = out / f"chunks_{args.seq_len}.pt"
    if cache.exists():
        data = torch.load(cache)
    else:
        data = {
            "train": chunk_ids(tokenizer, train_files, args.seq_len),
            "eval": chunk_ids(tokenizer, eval_files, args.seq_len, max_tokens=args.eval_tokens),
        }
        torch.save(data, cache)
    print(f"train chunks {tuple(data['train'].shape)}, eval chunks {tuple(data['eval'].shape)}", flush=True)

    model = build_model(len(tokenizer), args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model parameters: {n_params / 1e6:.2f}M", flush=True)

    targs = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=args.batch_size,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.max_steps // 25),
        weight_decay=0.1,
        adam_beta2=0.95,
        max_grad_norm=1.0,
        logging_steps=10,
        save_steps=args.save_steps,
        save_total_limit=2,
        use_cpu=not torch.cuda.is_available(),
        dataloader_drop_last=True,
        report_to=[],
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=targs, train_dataset=ChunkDataset(data["train"]))
    ckpts = sorted(out.glob("checkpoint-*"), key=lambda c: int(c.name.split("-")[1]))
    t0 = time.time()
    trainer.train(resume_from_checkpoint=str(ckpts[-1]) if ckpts else None)
    print(f"training done in {time.time() - t0:.0f}s", flush=True)

    model = trainer.model.float()
    loss = held_out_loss(model, data["eval"])
    report = {
        "held_out_loss": round(loss, 4),
        "held_out_perplexity": round(math.exp(loss), 3),
        "held_out_tokens": int(data["eval"].numel()),
        "train_tokens_seen": int(args.max_steps * args.batch_size * args.seq_len),
        "train_corpus_tokens": int(data["train"].numel()),
        "parameters": n_params,
        "max_steps": args.max_steps,
        "command": "python recipes/demo_model/train_demo_model.py " + " ".join(argv or os.sys.argv[1:]),
        "python": sysconfig.get_python_version(),
    }
    print(json.dumps(report, indent=2), flush=True)
    export(model, tokenizer, args.export_dir)
    (Path(args.export_dir) / "training_report.json").write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
