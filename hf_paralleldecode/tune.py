"""``hf-paralleldecode tune``: find the knee of the device at hand and the settings that are fastest on it.

What it measures (the Jacobi Forcing seed's Figures 7a and 7b, on this device)
    1. The roofline curve: the target forward's time against the tokens it feeds (1 to 1024 by
       default, after a context as long as the prompts plus half the new tokens), and the *knee*:
       the largest measured token count whose forward costs at most ``knee_factor`` (1.5) times a
       one-token forward. Below it extra tokens are nearly free.
    2. The strategy's TPF and tokens/s over a grid of its main settings, against AR, in one
       interleaved run (``bench.run_benchmark``).
It picks the grid point with the highest tokens/s among those whose output equalled AR's and
whose time per step fits ``latency_budget_ms`` (when given). The choice is written as a
``ParallelDecodingConfig`` (``save_to``: next to the model, where loading picks it up and it wins
over the paper presets), with ``tune.json``, ``roofline.png`` and ``sweep.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["tune", "knee_of"]

TUNE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def knee_of(points: list[tuple[int, float]], factor: float = 1.5) -> int:
    """Largest token count whose forward time is at most ``factor`` x the smallest count's."""
    base = points[0][1]
    return max(n for n, s in points if s <= factor * base)


def _plot_roofline(points, knee, title, path) -> bool:
    from .bench import _pyplot, _save

    plt = _pyplot("roofline")
    if plt is None:
        return False
    ns = [n for n, _ in points]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    axes[0].plot(ns, [1e3 * s for _, s in points], marker="o")
    axes[0].set_ylabel("forward time (ms)")
    axes[1].plot(ns, [n / s for n, s in points], marker="o")
    axes[1].set_ylabel("tokens fed per second")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per forward (batch x width)")
        ax.axvline(knee, linestyle="--", color="gray", linewidth=1)
    axes[0].set_title(f"knee (<= 1.5x one token): {knee} tokens", fontsize=10)
    fig.suptitle(title, fontsize=10)
    return _save(plt, fig, path)


def tune(model, tokenizer, prompts: list[str], decoding: str, grid: dict[str, list], max_new_tokens: int = 64,
         batch_size: int = 1, repeats: int = 1, latency_budget_ms: float | None = None,
         output_dir: str | Path | None = None, save_to: str | Path | None = None, tokens=TUNE_TOKENS,
         knee_factor: float = 1.5, model_name: str = "model", progress: bool = True,
         chat_template: bool | None = None) -> dict:
    """Measure the roofline curve and the grid, pick the fastest exact setting; return (and write) the report.
    ``prompts`` and ``chat_template`` as :func:`~hf_paralleldecode.bench.run_benchmark` takes them."""
    from .bench import grid_strategies, plot_sweep, run_benchmark
    from .config import ParallelDecodingConfig
    from .decoding.policy import forward_cost
    from .registry import settings_class

    if not grid:
        raise ValueError("tune needs a grid of at least one setting, e.g. block_size=4,8,16.")
    if latency_budget_ms is not None and latency_budget_ms <= 0:
        raise ValueError(f"latency_budget_ms must be > 0, got {latency_budget_ms}.")
    specs = grid_strategies(decoding, grid)
    settings = settings_class(decoding)
    for spec in specs:  # every point of the grid, checked by the strategy's settings class before anything is measured
        settings.from_dict(spec.settings, decoding=decoding)
    from .prompts import chat_prompts

    texts, prompt_format = chat_prompts(tokenizer, list(prompts), chat_template)
    lengths = [len(tokenizer(p, add_special_tokens=prompt_format != "chat_template").input_ids) for p in texts]
    context = int(sum(lengths) / max(len(lengths), 1)) + max_new_tokens // 2  # the model's real context length
    curve = forward_cost(model, context=context, repeats=3, tokens=tokens)
    knee = knee_of(curve.points, knee_factor)
    report = run_benchmark(model, tokenizer, prompts, specs, max_new_tokens=max_new_tokens, repeats=repeats,
                           batch_size=batch_size, output_dir=None, progress=progress, model_name=model_name,
                           chat_template=chat_template)
    rows = []
    for spec in specs:
        r = report["results"][spec.label]
        step_ms = 1e3 * r["seconds"] / max(r["forward_passes"], 1)
        rows.append(dict(settings=spec.settings, tpf=r["tpf"], tokens_per_second=r["tokens_per_second"],
                         speedup_vs_ar=r["speedup_vs_ar"], exact=r["exact_match_vs_ar"] == 1.0, step_ms=step_ms))
    allowed = [r for r in rows if r["exact"] and (latency_budget_ms is None or r["step_ms"] <= latency_budget_ms)]
    best = max(allowed, key=lambda r: r["tokens_per_second"]) if allowed else None
    out = dict(model=model_name, device=report["device"], dtype=report["dtype"], batch_size=batch_size,
               context=context, roofline=dict(tokens=[n for n, _ in curve.points], seconds=[s for _, s in curve.points],
                                              knee_tokens=knee, knee_factor=knee_factor),
               decoding=decoding, grid=grid, latency_budget_ms=latency_budget_ms, results=rows,
               ar_tokens_per_second=report["results"]["ar"]["tokens_per_second"],
               choice=None if best is None else dict(decoding=decoding, settings=best["settings"],
                                                     faster_than_ar=best["speedup_vs_ar"] > 1.0))
    files = []
    if output_dir is not None:
        path = Path(output_dir)
        path.mkdir(parents=True, exist_ok=True)
        title = f"{model_name} on {report['device']} ({report['dtype']}), context {context}"
        if _plot_roofline(curve.points, knee, title, path / "roofline.png"):
            files.append(str(path / "roofline.png"))
        if len(grid) == 2 and plot_sweep(report, decoding, grid, path / "sweep.png"):
            files.append(str(path / "sweep.png"))
        files.append(str(path / "tune.json"))
    if best is not None and save_to is not None:
        files.append(str(ParallelDecodingConfig(decoding, best["settings"]).save_pretrained(save_to)))
    out["files"] = files
    if output_dir is not None:
        (Path(output_dir) / "tune.json").write_text(json.dumps(out, indent=2, sort_keys=True) + "\n")
    return out
