"""``hf-paralleldecode``: demo, benchmarks, training data, training and an environment report.

    hf-paralleldecode demo [--drafter default-jetspec|default-deer]   # embedded model: AR vs every strategy
    hf-paralleldecode bench --strategies jacobi:block_size=16 transformers_prompt_lookup --max-new-tokens 128
    hf-paralleldecode sweep --decoding jacobi_forcing --grid block_size=4,8 pool_size=0,4
    hf-paralleldecode collect --prompts P.jsonl --output-dir D      # Jacobi trajectories (CLLM / Jacobi Forcing)
    hf-paralleldecode regenerate --prompts P.jsonl --output-dir D   # the model's own continuations (draft heads)
    hf-paralleldecode train --config RECIPE.yaml [--dry-run]        # every recipe in recipes/
    hf-paralleldecode env                                            # versions, for bug reports
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
from pathlib import Path


def _at_least(minimum: int):
    """argparse type: an integer >= ``minimum`` (argparse names the flag in its error)."""

    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be an integer >= {minimum}, got {value}")
        return value

    return convert


def _positive_float(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {value}")
    return value


def _probability(text: str) -> float:
    """argparse type: a number in (0, 1]."""
    value = _positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {value}")
    return value


POSITIVE = _at_least(1)
NON_NEGATIVE = _at_least(0)


def _env(_args) -> int:
    import importlib.metadata as md

    from .version import __version__

    info = {"hf_paralleldecode": __version__, "python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("torch", "transformers", "accelerate", "trl", "datasets", "safetensors", "flash-attn", "triton"):
        try:
            info[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            info[pkg] = "not installed"
    try:
        import torch

        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "not available"
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    from .registry import available_decodings

    info["decodings"] = ", ".join(available_decodings())
    width = max(map(len, info))
    for key, value in info.items():
        print(f"{key:<{width}}  {value}")
    return 0


def _load(args):
    """Apply ``--threads``, then load the model (and its tokenizer) named by ``--model``."""
    import torch

    if getattr(args, "threads", None):
        torch.set_num_threads(args.threads)

    from .bench import random_model
    from .loading import EMBEDDED_MODELS, default_model_path, load_model, load_tokenizer, resolve_model_path
    from .twins import embedded_twin, twin_of

    dtype = getattr(torch, args.dtype)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    import warnings

    from .hardware import SlowMatmulWarning, slow_matmul_message

    on_cpu = torch.device(device).type == "cpu"
    slow = slow_matmul_message(dtype, f"--dtype {args.dtype}", fix="--dtype float32") if on_cpu else None
    if slow and not getattr(args, "_warned", False):
        args._warned = True  # once per command (demo loads two models)
        print("warning: " + slow, file=sys.stderr)
    if args.model.startswith("random-"):
        tokenizer = load_tokenizer(default_model_path())
        model = random_model(args.model, vocab_size=len(tokenizer))
        name = args.model
    elif (twin := twin_of(args.model)) is not None:  # a cost twin of an embedded model, built on first use
        source, shape = twin
        with warnings.catch_warnings():  # (said above, once per command)
            warnings.simplefilter("ignore", SlowMatmulWarning)
            model = embedded_twin(source, shape, dtype=dtype, device=device)
        tokenizer = load_tokenizer(default_model_path(source))
        name = f"{EMBEDDED_MODELS[source]} (embedded), {shape} cost twin"
    else:
        path = resolve_model_path(args.model)
        model = load_model(path)
        tokenizer = load_tokenizer(path)
        name = f"{EMBEDDED_MODELS[args.model]} (embedded)" if args.model in EMBEDDED_MODELS else str(args.model)
    model = model.to(device=device, dtype=dtype).eval()
    if getattr(args, "drafter", None):
        from .drafters.loading import own_drafter
        from .integration import attach_drafter

        try:
            head = own_drafter(args.drafter, model)
        except Exception as err:  # noqa: BLE001 - any loading failure is a bad --drafter, reported with its cause
            raise ValueError(f"Could not load a drafter from --drafter {args.drafter!r}: {err}") from err
        attach_drafter(model, head.eval())
        name += f" + {args.drafter}"
    return model, tokenizer, name


def _add_model_args(p):
    p.add_argument("--model", default="default",
                   help="'default' (embedded demo model), 'default-trained' (the same after consistency training), "
                        "a cost twin of either at a real model's size (default-1b, default-trained-8b, ...: "
                        "NAME-SHAPE with a shape of hf_paralleldecode.TWIN_SHAPES), a local checkpoint / Hub id, or "
                        "random-1b / random-100m / random-tiny")
    p.add_argument("--prompts", default=None, nargs="+",
                   help="prompts file(s): .jsonl / .json / .parquet (the --prompt-column field) or .txt (blank-line "
                        "separated), several files are read in order; default: the shipped held-out prompts")
    p.add_argument("--prompt-column", default="prompt")
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the tokenizer's chat template with the generation prompt, as collect does (default: "
                        "for conversations, i.e. message lists; plain text stays raw, with a warning for a chat "
                        "tokenizer); --no-chat-template keeps raw text")
    p.add_argument("--num-prompts", type=POSITIVE, default=None, help="use only the first N prompts")
    p.add_argument("--max-new-tokens", type=POSITIVE, default=128)
    p.add_argument("--batch-size", type=POSITIVE, default=1)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=POSITIVE, default=None, help="torch CPU threads")
    p.add_argument("--drafter", default=None,
                   help="a drafter in any format load_drafter reads (folder or Hub id: this project's heads, EAGLE-3, "
                        "DFlash, JetSpec, speculators; or the shipped default-jetspec / default-dflash / default-deer / "
                        "default-eagle3) attached to the model: decoding='speculative' (and dflash_transformers, for "
                        "a block head) use it unless given drafter=")


def _prompts(args, default_count):
    from pathlib import Path

    from .prompts import check_chat_option, read_prompts

    paths = args.prompts or [Path(__file__).parent / "assets" / "prompts" / "stdlib_test.jsonl"]
    prompts = [p for path in paths for p in read_prompts(path, args.prompt_column, conversations=True)]
    check_chat_option(prompts, getattr(args, "chat_template", None))  # before a model loads
    n = args.num_prompts or default_count
    return prompts[:n] if n else prompts


def _bench(args) -> int:
    from pathlib import Path

    from .bench import check_sdpa_backends, format_report, parse_strategy, plot_batch_sizes, run_benchmark

    strategies = [parse_strategy(s) for s in args.strategies]
    if args.baselines:  # stock on transformers' fast path and its prompt lookup, beside stock eager in every table
        from .bench import BASELINE_PEERS

        given = {s.decoding for s in strategies}
        strategies += [parse_strategy(p) for p in BASELINE_PEERS if p not in given]
    check_sdpa_backends(args.sdpa_backends)
    priority = None
    if args.attention_priority is not None:
        from .attention import ATTENTION_PRIORITIES, check_attention_priority

        given = args.attention_priority
        priority = check_attention_priority(given[0] if len(given) == 1 and given[0] in ATTENTION_PRIORITIES else given)
    prompts = _prompts(args, None)  # bad input fails before the model loads
    sizes = args.batch_sizes or [args.batch_size]
    if any(b < 1 for b in sizes):
        raise ValueError(f"batch sizes must be >= 1, got {sizes}.")
    settings = {k: getattr(args, k) for k in ("temperature", "top_p", "top_k") if getattr(args, k) is not None}
    if settings and not args.do_sample:
        raise ValueError("--temperature / --top-p / --top-k are sampling settings: add --do-sample.")
    sampling = settings if args.do_sample else None
    model, tokenizer, name = _load(args)
    reports = []
    for b in sizes:
        out = args.output_dir if args.output_dir is None or len(sizes) == 1 else Path(args.output_dir) / f"batch{b}"
        report = run_benchmark(
            model, tokenizer, prompts, strategies, max_new_tokens=args.max_new_tokens,
            repeats=args.repeats, batch_size=b, output_dir=out, model_name=name, sampling=sampling,
            chat_template=args.chat_template, sdpa_backends=args.sdpa_backends, attention_priority=priority,
            trace_steps=args.trace_steps,
        )
        reports.append(report)
        if len(sizes) > 1:
            print(f"\nbatch size {b}")
        print(format_report(report))
        if report.get("files"):
            print("\nwrote " + ", ".join(report["files"]))
        if args.json:
            print(json.dumps(report, indent=2, sort_keys=True))
    if len(sizes) > 1 and args.output_dir is not None:
        chart = Path(args.output_dir) / "batch_sizes.png"
        if plot_batch_sizes(reports, chart):
            print(f"\nwrote {chart}")
    return 0


def _sweep(args) -> int:
    import json as _json
    from pathlib import Path

    from .bench import format_report, grid_strategies, parse_strategy, plot_sweep, run_benchmark

    grid = _parse_grid(args.decoding, args.grid)
    fixed = parse_strategy(f"{args.decoding}:{args.fixed}") if args.fixed else None
    specs = grid_strategies(args.decoding, grid)
    if fixed is not None:
        for spec in specs:
            spec.settings.update(fixed.settings)
    prompts = _prompts(args, None)
    model, tokenizer, name = _load(args)
    report = run_benchmark(model, tokenizer, prompts, specs, max_new_tokens=args.max_new_tokens,
                           repeats=args.repeats, batch_size=args.batch_size, output_dir=args.output_dir,
                           model_name=name, chat_template=args.chat_template)
    print(format_report(report))
    if args.output_dir:
        out = Path(args.output_dir)
        files = list(report.get("files", []))
        if fixed is None and plot_sweep(report, args.decoding, grid, out / "sweep.png"):
            files.append(str(out / "sweep.png"))
        (out / "sweep_grid.json").write_text(_json.dumps({"decoding": args.decoding, "grid": grid,
                                                          "fixed": fixed.settings if fixed else {}}, indent=2))
        files.append(str(out / "sweep_grid.json"))
        print("\nwrote " + ", ".join(files))
    return 0


def _parse_grid(decoding: str, items: list[str]) -> dict:
    from .bench import parse_strategy

    grid = {}
    for item in items:
        key, eq, values = item.partition("=")
        if not eq or not values:
            raise ValueError(f"Bad --grid item {item!r}: write key=v1,v2,...")
        grid[key] = [parse_strategy(f"{decoding}:{key}={v}").settings[key] for v in values.split(",")]
    return grid


def _tune(args) -> int:
    from .tune import tune

    grid = _parse_grid(args.decoding, args.grid)
    prompts = _prompts(args, 8)  # bad input fails before the model loads
    save_to = None
    if args.save or args.save_to is not None:  # --save-to implies --save
        save_to = args.save_to or args.model
        if args.save_to is not None and Path(save_to).exists() and not Path(save_to).is_dir():
            raise ValueError(f"--save-to {save_to!r} is a file; pass a folder (a new one is created).")
        if args.save_to is None and not Path(save_to).is_dir():
            raise ValueError(f"--save writes next to a local model folder; {save_to!r} is not one. Pass --save-to DIR "
                             "(a new folder is created).")
    model, tokenizer, name = _load(args)
    report = tune(model, tokenizer, prompts, args.decoding, grid, max_new_tokens=args.max_new_tokens,
                  batch_size=args.batch_size, repeats=args.repeats, latency_budget_ms=args.latency_budget_ms,
                  output_dir=args.output_dir, save_to=save_to, model_name=name, chat_template=args.chat_template)
    roof = report["roofline"]
    print(f"forward time vs tokens per forward (context {report['context']}):")
    for n, sec in zip(roof["tokens"], roof["seconds"]):
        print(f"  {n:>5} tokens  {1e3 * sec:8.2f} ms")
    print(f"knee: {roof['knee_tokens']} tokens per forward (<= {roof['knee_factor']}x a one-token forward)")
    print(f"\n{args.decoding} grid (AR: {report['ar_tokens_per_second']:.1f} tokens/s):")
    for r in sorted(report["results"], key=lambda r: -r["tokens_per_second"]):
        flag = "" if r["exact"] else "  (not exact)"
        print(f"  {r['settings']}  TPF {r['tpf']:.2f}  {r['tokens_per_second']:.1f} tok/s  {r['step_ms']:.1f} ms/step{flag}")
    if report["choice"] is None:
        print("\nno grid point is exact and within the latency budget")
        return 1
    print(f"\nbest: {args.decoding} {report['choice']['settings']}")
    if not report["choice"]["faster_than_ar"]:
        print("(slower than stock generate on this device: no grid point beats AR here)")
    if report["files"]:
        print("wrote " + ", ".join(report["files"]))
    return 0


def _add_data_args(p) -> None:
    """What the data commands (``collect``, ``regenerate``) share: model, prompts, output, sizes, device."""
    p.add_argument("--model", default="default", help="'default' (embedded model) or a checkpoint path / id")
    p.add_argument("--prompts", required=True,
                   help=".jsonl / .json / .parquet file (the --prompt-column field) or .txt (blank-line separated)")
    p.add_argument("--prompt-column", default="prompt")
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-new-tokens", type=POSITIVE, default=256)
    p.add_argument("--batch-size", type=POSITIVE, default=8)
    p.add_argument("--seed", type=NON_NEGATIVE, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=POSITIVE, default=None)
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the tokenizer's chat template with the generation prompt (default: for "
                        "conversations, i.e. message lists; plain text stays raw, with a warning for a chat "
                        "tokenizer); --no-chat-template keeps raw text")


def _regenerate(args) -> int:
    from .prompts import read_prompts
    from .training.regenerate import regenerate

    prompts = read_prompts(args.prompts, args.prompt_column, conversations=True)  # fails before the model loads
    if args.response_column:  # the file is read once: both columns go on as a dataset
        import datasets

        prompts = datasets.Dataset.from_dict({args.prompt_column: prompts,
                                              args.response_column: read_prompts(args.prompts, args.response_column)})
    model, tokenizer, _ = _load(args)
    ds = regenerate(model, tokenizer, prompts, args.output_dir, max_new_tokens=args.max_new_tokens,
                    batch_size=args.batch_size, prompt_column=args.prompt_column, do_sample=args.do_sample,
                    temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                    response_column=args.response_column, chat_template=args.chat_template)
    tokens = sum(len(r) for r in ds["response_ids"])
    what = f"'{args.response_column}' text" if args.response_column else "regenerated"
    print(f"{len(ds)} prompts, {tokens} {what} tokens in {args.output_dir}")
    return 0


def _collect(args) -> int:

    from .prompts import read_prompts
    from .training.trajectories import collect_trajectories

    prompts = read_prompts(args.prompts, args.prompt_column, conversations=True)  # fails before the model loads
    model, tokenizer, _ = _load(args)
    ds = collect_trajectories(model, tokenizer, prompts, args.output_dir, block_size=args.block_size,
                              max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                              prompt_column=args.prompt_column, max_repeat=args.max_repeat or None, seed=args.seed,
                              chat_template=args.chat_template)
    blocks = sum(len(t) for t in ds["trajectories"])
    print(f"{len(ds)} prompts, {blocks} complete blocks of {args.block_size} tokens in {args.output_dir}")
    return 0


def _demo(args) -> int:
    from .bench import StrategySpec
    from .registry import available_decodings

    model, tokenizer, name = _load(args)
    prompts = _prompts(args, 4)
    demo_settings = {"jacobi": {"block_size": 16}}
    # strategies that need a draft model run only when the checkpoint brings one (a bundle)
    from .integration import attached_drafter

    runnable = [d for d in available_decodings() if d != "speculative" or attached_drafter(model) is not None]
    trained_config = None
    if args.model == "default" and not args.base_only:
        from .config import ParallelDecodingConfig
        from .loading import default_model_path

        trained_dir = default_model_path("default-trained")
        if (trained_dir / "model.safetensors").is_file():
            trained_config = ParallelDecodingConfig.from_pretrained(trained_dir)
            # the base model runs the trained checkpoint's decoding with the checkpoint's own settings, so the
            # before -> after comparison below compares one setting, not two under one label
            demo_settings[trained_config.decoding] = dict(trained_config.settings)
    strategies = [StrategySpec(d, demo_settings.get(d, {})) for d in runnable]
    strategies.append(StrategySpec("transformers_prompt_lookup"))  # transformers' own peer, for reference
    print(f"model: {name}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"{next(model.parameters()).device}; {len(prompts)} prompts x {args.max_new_tokens} new tokens\n")
    base = _demo_part(args, model, tokenizer, name, prompts, strategies, dict(decoding="jacobi", block_size=16))
    reports = [base]
    if trained_config is not None:
        args.model = "default-trained"
        trained_model, _, trained_name = _load(args)
        config = trained_model.parallel_decoding_config
        print(f"\n=== {trained_name}: the same model after consistency training "
              f"(docs/training.md); its checkpoint decodes with {config.decoding} {config.settings} ===\n")
        compared = [StrategySpec("jacobi", demo_settings["jacobi"]),
                    StrategySpec(config.decoding, demo_settings[config.decoding])]
        trained = _demo_part(args, trained_model, tokenizer, trained_name, prompts, compared, {})
        reports.append(trained)
        print("\nbefore -> after training, same settings on both sides (tokens per forward, speedup over AR):")
        width = max(len(spec.label) for spec in compared) + 2
        for label in (spec.label for spec in compared):
            b, a = base["results"][label], trained["results"][label]
            print(f"  {label:<{width}} TPF {b['tpf']:.2f} -> {a['tpf']:.2f}   "
                  f"speedup {b['speedup_vs_ar']:.2f}x -> {a['speedup_vs_ar']:.2f}x")
    rates = [r["exact_match_vs_ar"] for rep in reports for r in rep["results"].values()]
    if args.dtype != "float32":  # exactness is an fp32 property: report the agreement, do not fail on it
        print(f"\n{args.dtype}: rows identical to the model's own AR greedy output: {min(rates):.0%} to "
              f"{max(rates):.0%} per strategy (token-for-token equality is guaranteed in float32; see "
              "docs/benchmark.md#numerics)")
        return 0
    exact = all(rate == 1.0 for rate in rates)
    print(f"\noutputs identical to the model's own AR greedy output for every strategy: {'yes' if exact else 'NO'}")
    return 0 if exact else 1


def _demo_part(args, model, tokenizer, name, prompts, strategies, sample_kwargs):
    """One model: a sample completion, then AR vs ``strategies`` on the same prompts."""
    from .bench import format_report, run_benchmark

    enc = tokenizer(prompts[0], return_tensors="pt").to(model.device)
    out = model.generate(**enc, max_new_tokens=min(args.max_new_tokens, 64), do_sample=False, **sample_kwargs)
    print("--- prompt " + "-" * 60)
    print(prompts[0], end="")
    print("\033[1m" if sys.stdout.isatty() else "", end="")
    print(tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    print("\033[0m" if sys.stdout.isatty() else "", end="")
    print("--- end " + "-" * 63 + "\n")
    output_dir = None if args.output_dir is None else f"{args.output_dir}/{args.model}"
    report = run_benchmark(model, tokenizer, prompts, strategies, max_new_tokens=args.max_new_tokens,
                           repeats=args.repeats, batch_size=args.batch_size, output_dir=output_dir,
                           progress=False, model_name=name, chat_template=args.chat_template)
    print(format_report(report))
    return report


class _ExactParser(argparse.ArgumentParser):
    """Subcommand parser without prefix matching: ``--max-new`` is an error, not ``--max-new-tokens``."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def main(argv=None) -> int:
    """Run one command; a process group the command started (``accelerate launch``) is destroyed when it succeeds.

    Without that, gloo's worker threads can outlive the interpreter's teardown of the tensors they hold and abort
    the process (SIGABRT, "terminate called without an active exception") after the work is done. The group is
    left alone when the command fails (a rank that is still in a collective would hang on it) or when it existed
    before the call (the caller's own group).
    """
    had_group = _process_group_initialized()
    code = _main(argv)
    if code == 0 and not had_group and _process_group_initialized():
        import torch.distributed as dist

        dist.destroy_process_group()
    return code


def _process_group_initialized() -> bool:
    if "torch" not in sys.modules:  # nothing distributed can have started without torch
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # recipe + HfArgumentParser overrides: parsed by the training CLI
        from .training.cli import train_main

        try:
            return train_main(argv[1:])
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    parser = argparse.ArgumentParser(prog="hf-paralleldecode", description=__doc__, allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_ExactParser)
    sub.add_parser("train", help="train with a recipe: train --config RECIPE.yaml [--dry-run] [--key value ...]")
    p_env = sub.add_parser("env", help="print versions for bug reports")
    p_env.set_defaults(func=_env)

    p_bench = sub.add_parser("bench", help="AR vs strategies, interleaved, in one process")
    _add_model_args(p_bench)
    p_bench.add_argument("--strategies", nargs="+", default=["jacobi:block_size=4", "jacobi:block_size=16",
                                                             "jacobi:block_size=64"],
                         help="name:key=value,... e.g. jacobi:block_size=16")
    p_bench.add_argument("--repeats", type=POSITIVE, default=3)
    p_bench.add_argument("--batch-sizes", type=POSITIVE, nargs="+", default=None,
                         help="run the comparison at each batch size (overrides --batch-size); with --output-dir, "
                              "one report per size under batch<B>/ and batch_sizes.png (tokens/s and TPF vs batch size)")
    p_bench.add_argument("--output-dir", default="bench_out")
    p_bench.add_argument("--json", action="store_true", help="also print the JSON report")
    p_bench.add_argument("--do-sample", action="store_true",
                         help="sample (stock sampling is the baseline; every run of a batch starts from one seed)")
    p_bench.add_argument("--temperature", type=_positive_float, default=None, help="with --do-sample")
    p_bench.add_argument("--top-p", type=_probability, default=None, help="with --do-sample")
    p_bench.add_argument("--top-k", type=POSITIVE, default=None, help="with --do-sample")
    p_bench.add_argument("--baselines", action=argparse.BooleanOptionalAction, default=True,
                         help="add transformers' own baselines beside stock eager: stock on its fast path (static cache "
                              "+ compiled forward: transformers_fast_path) and its prompt lookup "
                              "(transformers_prompt_lookup); --no-baselines leaves them out")
    p_bench.add_argument("--sdpa-backends", nargs="+", default=None, metavar="BACKEND",
                         help="attention backends every entry may use (flash, efficient, cudnn, math; default: "
                              "torch's choice), stock generate's included: e.g. flash efficient math keeps cuDNN's "
                              "attention, which builds a graph per new shape, out of decoding on Hopper GPUs")
    p_bench.add_argument("--attention-priority", nargs="+", default=None, metavar="SETTING",
                         help="attention priority of the decoding entries (not stock's): auto (default: cuDNN's "
                              "attention after the others on GPUs where torch tries it first), torch (torch's order), "
                              "or backend names in the order to try them")
    p_bench.add_argument("--trace-steps", action="store_true",
                         help="keep every step the batch policy ran (shape, rows, committed tokens, seconds) in the "
                              "JSON report (step_traces), to see where a default slower than a fixed shape lost")
    p_bench.set_defaults(func=_bench)

    p_sweep = sub.add_parser("sweep", help="grid of one strategy's settings vs AR (TPF and tokens/s heatmaps)")
    _add_model_args(p_sweep)
    p_sweep.add_argument("--decoding", default="jacobi_forcing")
    p_sweep.add_argument("--grid", nargs="+", default=["block_size=4,8,16,32", "pool_size=0,2,4,8"],
                         help="key=v1,v2,... (two keys give a heatmap)")
    p_sweep.add_argument("--fixed", default="", help="other settings, key=value,...")
    p_sweep.add_argument("--repeats", type=POSITIVE, default=1)
    p_sweep.add_argument("--output-dir", default="sweep_out")
    p_sweep.set_defaults(func=_sweep)

    p_tune = sub.add_parser("tune", help="measure this device's roofline knee and pick a strategy's fastest settings")
    _add_model_args(p_tune)
    p_tune.add_argument("--decoding", default="jacobi_forcing")
    p_tune.add_argument("--grid", nargs="+", default=["block_size=4,8,16", "pool_size=0,4"],
                        help="key=v1,v2,... per setting (two settings also draw sweep.png)")
    p_tune.add_argument("--repeats", type=POSITIVE, default=1)
    p_tune.add_argument("--latency-budget-ms", type=_positive_float, default=None,
                        help="only settings whose time per step (ms) fits this budget")
    p_tune.add_argument("--save", action="store_true",
                        help="write the choice as parallel_decoding_config.json next to the model (a local folder)")
    p_tune.add_argument("--save-to", default=None,
                        help="folder for --save (implies it), created when missing (default: the --model folder)")
    p_tune.add_argument("--output-dir", default="tune_out")
    p_tune.set_defaults(func=_tune, max_new_tokens=64)

    p_collect = sub.add_parser("collect", help="Jacobi trajectories of a model on prompts (resumable parquet shards)")
    _add_data_args(p_collect)
    p_collect.add_argument("--block-size", type=POSITIVE, default=16)
    p_collect.add_argument("--max-repeat", type=NON_NEGATIVE, default=10,
                           help="flag responses repeating one token this many times in a row (0: never)")
    p_collect.set_defaults(func=_collect)

    p_regen = sub.add_parser("regenerate", help="the model's own continuations of prompts (draft-head training "
                                                "data; resumable parquet shards, data-parallel under accelerate)")
    _add_data_args(p_regen)
    p_regen.add_argument("--do-sample", action="store_true", help="sample instead of greedy continuations")
    p_regen.add_argument("--temperature", type=_positive_float, default=None)
    p_regen.add_argument("--top-p", type=_probability, default=None)
    p_regen.add_argument("--top-k", type=POSITIVE, default=None)
    p_regen.add_argument("--response-column", default=None,
                         help="take each continuation from this column of the prompts file instead of generating "
                              "it (the corpus-text ablation of JetSpec Table 6)")
    p_regen.set_defaults(func=_regenerate)

    p_demo = sub.add_parser("demo", help="embedded model: same prompts through AR and every strategy")
    _add_model_args(p_demo)
    p_demo.add_argument("--repeats", type=POSITIVE, default=1)
    p_demo.add_argument("--output-dir", default=None)
    p_demo.add_argument("--base-only", action="store_true",
                        help="skip the second part (the embedded model after consistency training)")
    p_demo.set_defaults(func=_demo, max_new_tokens=96)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
