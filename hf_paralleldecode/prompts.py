"""One prompt reader for every command (``bench``, ``sweep``, ``demo``, ``collect``, ``regenerate``).

Accepted sources: a ``datasets.Dataset``, a list of strings, or a file:

* ``.jsonl``: one JSON object per line (the ``column`` field) or one JSON string per line;
* ``.json``: a list of strings or of objects (the ``column`` field);
* ``.parquet``: a table with a ``column`` column;
* ``.txt``: prompts separated by blank lines.

With ``conversations=True`` (``collect`` and ``regenerate``) a row may also be a conversation: a
non-empty list of ``{"role": ..., "content": ...}`` messages (a ``messages`` column, or a JSONL file
whose lines are message lists); :func:`chat_prompts` turns the rows into the text the model sees.

Errors name the file and the fix: a missing file, an unsupported suffix, a missing column (the
columns that exist are listed), an empty file, a row that is not a non-empty string.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["read_prompts", "chat_prompts", "check_chat_option", "is_conversation", "PROMPT_FORMATS"]

PROMPT_FORMATS = (".jsonl", ".json", ".parquet", ".txt")


def _rows_from_file(path: Path, column: str) -> list:
    if not path.is_file():
        raise ValueError(f"Prompt file {path} does not exist.")
    if path.suffix not in PROMPT_FORMATS:
        raise ValueError(f"Unsupported prompt file {path.name}: use one of {', '.join(PROMPT_FORMATS)}.")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as err:  # noqa: BLE001 - a foreign or truncated file: name it
            raise ValueError(f"Could not read prompts from {path}: {err}") from None
        if column not in table.column_names:
            raise ValueError(f"{path} has no column {column!r} (columns: {table.column_names}).")
        return table.column(column).to_pylist()
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"Could not read prompts from {path}: it is not UTF-8 text ({err.reason} at byte "
                         f"{err.start}). Save it as UTF-8.") from None
    except OSError as err:
        raise ValueError(f"Could not read prompts from {path}: {err.strerror or err}.") from None
    if path.suffix == ".txt":
        return [p for p in text.split("\n\n") if p.strip()]
    try:
        data = json.loads(text) if path.suffix == ".json" else [json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as err:
        raise ValueError(f"Could not read prompts from {path}: {err}") from None
    if path.suffix == ".json" and not isinstance(data, list):
        raise ValueError(f"{path} must hold a JSON list of prompts (strings or objects with a {column!r} field).")
    rows = []
    for i, item in enumerate(data):
        if isinstance(item, dict):
            if column not in item:
                raise ValueError(f"Row {i} of {path} has no column {column!r} (columns: {sorted(item)}); "
                                 "pass the column name (--prompt-column).")
            item = item[column]
        rows.append(item)
    return rows


def is_conversation(row) -> bool:
    """A non-empty list of ``{"role": str, "content": str}`` messages."""
    return isinstance(row, list) and bool(row) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in row)


def read_prompts(source, column: str = "prompt", conversations: bool = False) -> list:
    """The prompts of ``source`` (see the module docstring) as a list of non-empty strings (and, with
    ``conversations=True``, of message lists)."""
    where = "the prompts"
    if isinstance(source, (str, os.PathLike)):
        where = str(source)
        rows = _rows_from_file(Path(source), column)
    elif isinstance(source, list):
        rows = source
    else:  # a datasets.Dataset (or anything with column_names and column access)
        names = getattr(source, "column_names", None)
        if names is None:
            raise ValueError(f"Prompts must be a file path, a list of strings or a datasets.Dataset, got "
                             f"{type(source).__name__}.")
        if column not in names:
            raise ValueError(f"The prompts have no column {column!r} (columns: {names}).")
        rows = source[column]
    if not rows:
        raise ValueError(f"No prompts in {where} (it is empty).")
    bad = [i for i, p in enumerate(rows) if not (isinstance(p, str) and p) and not (conversations and is_conversation(p))]
    if bad:
        what = "non-empty strings or conversations (lists of {'role', 'content'} messages)" if conversations else \
            "non-empty strings"
        raise ValueError(f"Prompts must be {what}; rows {bad[:5]} of {where} are not.")
    return list(rows)


def check_chat_option(rows: list, chat_template: bool | None) -> bool:
    """``ValueError`` for conversations with ``chat_template=False``; else whether ``rows`` hold conversations (what
    commands check before a model loads, and :func:`chat_prompts` again)."""
    convs = any(is_conversation(r) for r in rows)
    if chat_template is False and convs:
        raise ValueError("The prompts hold conversations (message lists), which need a chat template: drop "
                         "chat_template=False (--no-chat-template), or give plain text prompts.")
    return convs


def chat_prompts(tokenizer, rows: list, chat_template: bool | None = None) -> tuple[list[str], str]:
    """The text the model sees for each prompt row, and the format used (``"chat_template"`` or ``"raw"``).

    ``chat_template``: ``True`` applies the tokenizer's chat template with the generation prompt to every
    row (a plain string becomes one user message); ``False`` keeps raw text (conversations are refused);
    ``None`` (default) applies it when the rows hold conversations, and keeps plain strings raw, with a
    warning when the tokenizer has a chat template (a chat model sees that template at inference).
    Templated text already holds the template's special tokens: encode it with ``add_special_tokens=False``.
    """
    import warnings

    has_template = bool(getattr(tokenizer, "chat_template", None))
    convs = check_chat_option(rows, chat_template)
    use = chat_template if chat_template is not None else convs
    if use and not has_template:
        raise ValueError("The prompts need a chat template (conversations, or chat_template=True / --chat-template), "
                         "but this tokenizer has none. Give plain text prompts, or use the chat model's tokenizer.")
    if not use:
        if has_template:
            warnings.warn("This tokenizer has a chat template, and the prompts are collected as raw text: a chat "
                          "model sees its template at inference. Pass chat_template=True (--chat-template) to collect "
                          "data in that format.", UserWarning, stacklevel=2)
        return list(rows), "raw"
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": r}] if isinstance(r, str) else r,
                                           tokenize=False, add_generation_prompt=True) for r in rows]
    return texts, "chat_template"
