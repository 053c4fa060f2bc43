"""Write the benchmark/demo prompts from the held-out ``test/`` package of the standard library.

    python recipes/demo_model/make_prompts.py --out hf_paralleldecode/assets/prompts/stdlib_test.jsonl
    python recipes/demo_model/make_prompts.py --style midfile --out hf_paralleldecode/assets/prompts/stdlib_test_midfile.jsonl

``--style def`` (default): each prompt is up to ``--context_lines`` lines ending with a ``def`` line
and the indentation of its body. ``--style midfile``: each prompt is a window of ``--window_chars``
characters cut from the middle of a file (starting at a line boundary), the way an editor asks for
a completion in the middle of existing code. Files of the ``test/`` package are never seen in training.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from train_demo_model import read_text, stdlib_files  # noqa: E402

DEF = re.compile(r"^(\s*)def \w+\(.*\):\s*$")


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="hf_paralleldecode/assets/prompts/stdlib_test.jsonl")
    p.add_argument("--num_prompts", type=int, default=32)
    p.add_argument("--context_lines", type=int, default=12)
    p.add_argument("--split", choices=["test", "train"], default="test",
                   help="test: the held-out test/ package (benchmarks); train: the training files (trajectories)")
    p.add_argument("--per_file", type=int, default=1, help="function openings (or mid-file windows) taken per file")
    p.add_argument("--style", choices=["def", "midfile"], default="def")
    p.add_argument("--window_chars", type=int, default=240, help="--style midfile: characters per prompt")
    p.add_argument("--continuation_lines", type=int, default=0,
                   help="also write the file's next N lines as `continuation` (the corpus text after the prompt: "
                        "`regenerate --response-column continuation` trains a head on it, the Table 6 ablation)")
    args = p.parse_args(argv)
    files = [f for f in stdlib_files(held_out=args.split == "test") if f.stat().st_size > 2000]
    step = max(len(files) * args.per_file // args.num_prompts, 1)
    prompts = []
    for f in files[::step]:
        if args.style == "midfile":
            text = read_text(f)
            for k in range(args.per_file):  # one window: from the middle; more: evenly spread through the file
                start = text.find("\n", len(text) * (k + 1) // (args.per_file + 1)) + 1  # the next line boundary
                window = text[start : start + args.window_chars]
                if start > 0 and len(window) == args.window_chars:
                    prompts.append({"prompt": window, "source": f"{args.split}:{f.name}:char{start}"})
            if len(prompts) >= args.num_prompts:
                break
            continue
        lines = read_text(f).splitlines()
        taken = 0
        for i, line in enumerate(lines[args.context_lines :], start=args.context_lines):
            m = DEF.match(line)
            if m and len(line) < 100:
                body_indent = m.group(1) + "    "
                text = "\n".join(lines[i - args.context_lines : i + 1]) + "\n" + body_indent
                row = {"prompt": text, "source": f"{args.split}:{f.name}:{i + 1}"}
                if args.continuation_lines:
                    # the prompt already ends with the body's indentation: continue after it
                    rest = "\n".join(lines[i + 1 : i + 1 + args.continuation_lines])
                    row["continuation"] = rest[len(body_indent) :] if rest.startswith(body_indent) else rest
                prompts.append(row)
                taken += 1
                if taken == args.per_file:
                    break
        if len(prompts) >= args.num_prompts:
            break
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(x) + "\n" for x in prompts))
    print(f"wrote {len(prompts)} prompts to {out}")


if __name__ == "__main__":
    main()
