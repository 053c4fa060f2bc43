"""Train the embedded DEER drafter (``DiffusionDrafter.from_pretrained("default-deer")``) on CPU.

No pretrained diffusion LM shares the embedded model's tokenizer, so the drafter is made here in
three stages, each saved as a drafter folder (rerunning skips finished stages):

0. Masked-diffusion pretraining on the standard library (the demo model's training split, the
   embedded tokenizer plus a mask and a boundary token). The drafter is a 2-layer copy of the
   embedded model's own first layers (``init_from_target=True``, Dream's AR initialisation,
   shifted predictions: the first drafted token comes from the anchor's causal slot, exactly as
   the AR layers predict), block-causal (it keeps a prefix KV cache at inference). No boundary
   token by default: in a block-causal drafter the masks themselves mark where the block starts
   (``--boundary_token`` adds DEER's [SEP]).
1. DEER stage I on the base model's own greedy answers (``hf-paralleldecode regenerate``):
   continuation distillation, the masked continuation after a random truncation point.
2. DEER stage II on the same answers: the R tokens after the prefix, exponentially decaying weights.

Every stage draws its masked span per batch from ``--spans`` so one drafter serves block sizes 4
to 32 (``tree_depth``). Reproduce (2 CPU cores; about 20 minutes for stage 0, 5 for stage I, 17 for
stage II):

    python recipes/demo_model/make_prompts.py --split train --num_prompts 1600 --per_file 4 --out runs/deer/train_prompts.jsonl
    python recipes/demo_model/make_prompts.py --split train --style midfile --num_prompts 1600 --per_file 4 --out runs/deer/train_prompts_midfile.jsonl
    python recipes/demo_model/make_prompts.py --split train --style midfile --num_prompts 3200 --per_file 8 --out runs/deer/train_prompts_midfile8.jsonl
    for S in "" _midfile _midfile8; do
      hf-paralleldecode regenerate --model default --prompts runs/deer/train_prompts$S.jsonl --output-dir runs/deer/regen$S \
        --max-new-tokens 96 --batch-size 16
    done
    python recipes/deer/train_default_deer.py --work_dir runs/deer --regen runs/deer/regen runs/deer/regen_midfile \
        runs/deer/regen_midfile8 --steps 1000 400 1500 --export_dtype bfloat16 \
        --export_dir hf_paralleldecode/assets/stdlib-coder-8m-deer

Stage I reads the 1603 answers to function openings; stage II reads those plus the answers to 4803 mid-file
windows of training files (a first version ran stage II for 300 steps on the openings' answers only: see
docs/methods/deer.md). The shipped drafters then ran stage II once more, 1500 steps at half the learning rate,
from the first stage II's drafter (given as ``--stage1``; the exported ``training_report.json`` lists stage 0, the
first stage II and the second):

    python recipes/deer/train_default_deer.py --stage0 runs/deer/stage0 --stage1 runs/deer/stage2 \
        --work_dir runs/deer_v4/base --regen runs/deer/regen runs/deer/regen_midfile runs/deer/regen_midfile8 \
        --steps 1000 400 1500 --lr 1e-3 5e-4 1e-4 --export_dtype bfloat16 \
        --export_dir hf_paralleldecode/assets/stdlib-coder-8m-deer The Jacobi Forcing model's drafter (shipped inside that checkpoint, ``drafter/``)
shares stage 0 and is aligned to the Jacobi Forcing model's own answers to the same prompts:

    for S in "" _midfile _midfile8; do
      hf-paralleldecode regenerate --model default-trained --prompts runs/deer/train_prompts$S.jsonl \
        --output-dir runs/deer_jf/regen$S --max-new-tokens 96 --batch-size 16
    done
    python recipes/deer/train_default_deer.py --target default-trained --stage0 runs/deer/stage0 --work_dir runs/deer_jf \
        --regen runs/deer_jf/regen runs/deer_jf/regen_midfile runs/deer_jf/regen_midfile8 --steps 1000 400 1500 \
        --export_dtype bfloat16 --export_dir hf_paralleldecode/assets/stdlib-coder-8m-jacobi-forcing/drafter
    python recipes/deer/train_default_deer.py --target default-trained --stage0 runs/deer/stage0 \
        --stage1 runs/deer_jf/stage2 --work_dir runs/deer_v4/jf --regen runs/deer_jf/regen runs/deer_jf/regen_midfile \
        runs/deer_jf/regen_midfile8 --steps 1000 400 1500 --lr 1e-3 5e-4 1e-4 --export_dtype bfloat16 \
        --export_dir hf_paralleldecode/assets/stdlib-coder-8m-jacobi-forcing/drafter
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "demo_model"))


def text_dataset(tokenizer, seq_len: int, max_tokens: int):
    import datasets
    from train_demo_model import chunk_ids, stdlib_files

    chunks = chunk_ids(tokenizer, stdlib_files(held_out=False), seq_len, max_tokens)
    return datasets.Dataset.from_dict({"input_ids": chunks.tolist(), "prompt_ids": [[] for _ in range(len(chunks))]})


def run_stage(stage, drafter, target, dataset, out_dir: Path, args, steps: int, lr: float):
    from hf_paralleldecode.training import DiffusionAlignmentConfig, DiffusionAlignmentTrainer

    config = DiffusionAlignmentConfig(
        output_dir=str(out_dir / "checkpoints"), stage=stage, max_steps=steps, per_device_train_batch_size=args.batch_size,
        learning_rate=lr, lr_scheduler_type="cosine", warmup_steps=min(50, steps // 10), weight_decay=0.0,
        max_anchors=args.max_anchors, span_lengths=args.spans, logging_steps=25, save_steps=200, save_total_limit=1,
        use_cpu=True, report_to="none", seed=args.seed, dataloader_num_workers=0,
        base_model_name_or_path=args.target_name,
    )
    trainer = DiffusionAlignmentTrainer(model=drafter.train(), args=config, train_dataset=dataset)
    t0 = time.time()
    checkpoints = sorted((out_dir / "checkpoints").glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    trainer.train(resume_from_checkpoint=str(checkpoints[-1]) if checkpoints else None)
    trainer.save_model(str(out_dir))
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    report = dict(stage=stage, steps=steps, learning_rate=lr, seconds=round(time.time() - t0, 1), rows=len(dataset),
                  first_log=logs[0] if logs else None, last_log=logs[-1] if logs else None)
    (out_dir / "stage_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return drafter.eval(), report


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work_dir", default="runs/deer")
    parser.add_argument("--regen", nargs="+", default=None, help=(
        "regenerated answers, one or more folders read as one dataset (default: WORK_DIR/regen)"))
    parser.add_argument("--export_dir", default=None)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--block_size", type=int, default=32)
    parser.add_argument("--boundary_token", action="store_true", help=(
        "put DEER's [SEP] between the prefix and the masks (off: with shifted predictions the first drafted token "
        "then comes from the anchor's causal slot, the AR-initialised layers' own next-token prediction)"))
    parser.add_argument("--spans", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--max_anchors", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--text_tokens", type=int, default=3_000_000)
    parser.add_argument("--steps", type=int, nargs=3, default=[1000, 400, 300], help="stage 0, I, II")
    parser.add_argument("--lr", type=float, nargs=3, default=[1e-3, 5e-4, 2e-4])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target", default="default", help=(
        "the embedded model the drafter is aligned to: 'default' (the base model) or 'default-trained' (the Jacobi "
        "Forcing model; its stages I and II then read that model's own answers, --regen)"))
    parser.add_argument("--stage0", default=None, help=(
        "a finished stage-0 drafter folder to start stage I from (stage 0 is text pretraining: it does not depend "
        "on the target's answers, so the base model's stage 0 serves the Jacobi Forcing model's drafter too)"))
    parser.add_argument("--export_dtype", choices=["float32", "bfloat16"], default="float32", help=(
        "dtype of the exported weights (bfloat16 halves the file; CPUs with native bf16 run the drafter in bf16 anyway)"))
    parser.add_argument("--stage1", default=None, help=(
        "a finished stage-I drafter folder to start stage II from (e.g. to run stage II again on more answers)"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import hf_paralleldecode as hfpd
    from hf_paralleldecode.drafters.diffusion import DRAFTER_CONFIG_NAME
    from hf_paralleldecode.loading import EMBEDDED_MODELS
    from hf_paralleldecode.training import load_regenerated

    target, tokenizer = hfpd.load_default_model(args.target)
    args.target_name = EMBEDDED_MODELS[args.target]
    work = Path(args.work_dir)
    reports = []
    stages = [(0, Path(args.stage0) if args.stage0 else work / "stage0"),
              (1, Path(args.stage1) if args.stage1 else work / "stage1"), (2, work / "stage2")]
    drafter = None
    for (stage, out), steps, lr in zip(stages, args.steps, args.lr):
        if (out / DRAFTER_CONFIG_NAME).is_file():
            drafter = hfpd.DiffusionDrafter.from_pretrained(out)
            reports.append(json.loads((out / "stage_report.json").read_text()))
            print(f"stage {stage}: done already ({out})", flush=True)
            continue
        if drafter is None:
            torch.manual_seed(args.seed)
            drafter = hfpd.DiffusionDrafter.for_target(
                target, num_hidden_layers=args.layers, block_size=args.block_size, shifted=True,
                boundary_token=args.boundary_token, init_from_target=True, tokenizer=tokenizer)
        if stage == 0:
            data = text_dataset(tokenizer, args.seq_len, args.text_tokens)
        else:
            import datasets

            data = datasets.concatenate_datasets(
                [load_regenerated(folder, tokenizer=tokenizer) for folder in args.regen or [str(work / "regen")]])
        print(f"stage {stage}: {len(data)} rows, {steps} steps", flush=True)
        drafter, report = run_stage(stage, drafter, target, data, out, args, steps, lr)
        reports.append(report)
        print(json.dumps(report), flush=True)
    if args.export_dir:
        export = Path(args.export_dir)
        drafter.config.target_name_or_path = args.target_name
        drafter.to(getattr(torch, args.export_dtype)).save_pretrained(export)
        (export / "training_report.json").write_text(json.dumps(dict(
            recipe="recipes/deer/train_default_deer.py", target=args.target_name, layers=args.layers, block_size=args.block_size,
            spans=args.spans, batch_size=args.batch_size, max_anchors=args.max_anchors, stages=reports), indent=2) + "\n")
        print(f"exported to {export}")


if __name__ == "__main__":
    main()
