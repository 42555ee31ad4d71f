"""Loader for data in the official GSM8K format (rows with ``question`` and ``answer``, the answer ending in
``#### N``), from local files only.

Accepted ``path`` values:

* a ``.jsonl`` / ``.json`` / ``.parquet`` file (the file *is* the split; ``split`` is ignored);
* a directory holding ``train.*`` / ``test.*`` files (``.jsonl``, ``.json``, ``.parquet``), also under ``main/``
  and as hub-style shards ``train-00000-of-00001.parquet``; or the output of ``datasets``' ``save_to_disk``
  (read with ``datasets.load_from_disk``, needs ``datasets``);
* a ``datasets`` hub name (``openai/gsm8k``, ``gsm8k``), only when it is already in the local Hugging Face cache:
  the call runs with ``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1``. Nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
from typing import Any, Iterable, Iterator, Optional

from stalerl.data.example import Example
from stalerl.core.errors import UserError
from stalerl.core.reward import normalize_number

__all__ = [
    "GSM8KFormatError",
    "SUPPORTED_EXTENSIONS",
    "load_gsm8k",
    "parse_final_answer",
    "rows_to_examples",
    "read_rows",
]

SUPPORTED_EXTENSIONS = (".jsonl", ".json", ".parquet")
SPLIT_ALIASES = {
    "train": ("train",),
    "test": ("test", "validation", "valid", "val", "eval"),
}
_HUB_NAME_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_HINT = (
    "Pass a local file in GSM8K format (JSON lines with 'question' and 'answer' fields, the answer ending in "
    "'#### N'): a .jsonl/.json/.parquet file, or a directory holding train/test files "
    "(e.g. train_dataset.path=/data/gsm8k valid_dataset.path=/data/gsm8k/test.jsonl), or use "
    "train_dataset.path=synthetic valid_dataset.path=synthetic for the built-in generator."
)


class GSM8KFormatError(ValueError, UserError):
    """A data file exists but its rows are not in GSM8K format."""


def parse_final_answer(answer: str) -> Optional[str]:
    """``N`` from a GSM8K answer ending in ``#### N`` (canonical number: no commas or ``$``), else None."""
    if not isinstance(answer, str) or "####" not in answer:
        return None
    return normalize_number(answer.rsplit("####", 1)[1])


# ----------------------------------------------------------------------------------------------------------- rows


def _read_jsonl(path: str) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise GSM8KFormatError(f"{path}: line {lineno} is not valid JSON ({e.msg})") from None
            yield f"{path}: line {lineno}", row


def _read_json(path: str, split: str) -> Iterator[tuple[str, Any]]:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # JSON lines in a .json file
            yield from _read_jsonl(path)
            return
        raise GSM8KFormatError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(data, dict):
        if isinstance(data.get("question"), list) and isinstance(data.get("answer"), list):  # column-oriented
            data = [{"question": q, "answer": a} for q, a in zip(data["question"], data["answer"])]
        else:
            keys = SPLIT_ALIASES.get(split, (split,)) + ("data", "rows", "examples")
            for key in keys:
                if isinstance(data.get(key), list):
                    data = data[key]
                    break
            else:
                raise GSM8KFormatError(
                    f"{path}: a JSON object, but it holds no list of rows (looked for keys {list(keys)}; "
                    f"has {sorted(data)[:10]})"
                )
    if not isinstance(data, list):
        raise GSM8KFormatError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
    for i, row in enumerate(data):
        yield f"{path}: row {i}", row


def _read_parquet(paths: list[str]) -> Iterator[tuple[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {paths[0]} needs pyarrow: pip install pyarrow") from None
    for path in paths:
        try:
            table = pq.read_table(path)
        except Exception as e:
            raise GSM8KFormatError(f"{path}: cannot read as parquet ({type(e).__name__}: {e})") from None
        for i, row in enumerate(table.to_pylist()):
            yield f"{path}: row {i}", row


def read_rows(path: str, split: str = "train") -> Iterator[tuple[str, Any]]:
    """``(where, row)`` pairs from one local file, ``where`` naming the file and line/row for error messages."""
    ext = _extension(path)
    if ext == ".jsonl":
        return _read_jsonl(path)
    if ext == ".json":
        return _read_json(path, split)
    if ext == ".parquet":
        return _read_parquet([path])
    raise ValueError(
        f"{path}: unknown data file extension {ext or '(none)'!r}; supported: {', '.join(SUPPORTED_EXTENSIONS)}. "
        + _HINT
    )


def _extension(path: str) -> str:
    return os.path.splitext(path)[1].lower()


def rows_to_examples(rows: Iterable[tuple[str, Any]], source: str) -> list[Example]:
    """Validate GSM8K rows and turn them into ``Example``s.

    Raises ``GSM8KFormatError`` naming the first bad row and the number of bad rows, for rows that are not
    objects or lack a string ``question``/``answer``, and for answers that do not end in ``#### N``.
    """
    examples: list[Example] = []
    missing: list[str] = []
    no_final: list[str] = []
    total = 0
    for where, row in rows:
        total += 1
        if not isinstance(row, dict):
            missing.append(f"{where} is a {type(row).__name__}, not an object with 'question' and 'answer'")
            continue
        absent = [k for k in ("question", "answer") if not isinstance(row.get(k), str)]
        if absent:
            what = ", ".join(f"'{k}'" for k in absent)
            missing.append(f"{where} lacks a string field {what} (fields: {sorted(map(str, row))})")
            continue
        final = parse_final_answer(row["answer"])
        if final is None:
            tail = row["answer"][-60:].replace("\n", "\\n")
            no_final.append(f"{where}: the answer does not end in '#### N' (ends with {tail!r})")
            continue
        examples.append(Example(question=row["question"], answer=row["answer"], final=final))
    if missing:
        raise GSM8KFormatError(f"{len(missing)} of {total} rows in {source} are not GSM8K rows; first: {missing[0]}")
    if no_final:
        raise GSM8KFormatError(
            f"{len(no_final)} of {total} rows in {source} have an answer without a final '#### N'; first: {no_final[0]}"
        )
    if not examples:
        raise GSM8KFormatError(f"{source}: no rows. " + _HINT)
    return examples


# ----------------------------------------------------------------------------------------------------- sources


def _split_names(split: str) -> tuple[str, ...]:
    return SPLIT_ALIASES.get(split, (split,))


def _is_saved_dataset(directory: str) -> bool:
    return any(
        os.path.isfile(os.path.join(directory, name))
        for name in ("dataset_dict.json", "state.json", "dataset_info.json")
    )


def _load_saved_dataset(directory: str, split: str) -> list[Example]:
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"{directory} looks like the output of datasets' save_to_disk; reading it needs the `datasets` package "
            "(pip install datasets), or export the split to .jsonl/.parquet"
        ) from None
    try:
        ds = datasets.load_from_disk(directory)
    except Exception as e:
        raise GSM8KFormatError(f"{directory}: datasets.load_from_disk failed ({type(e).__name__}: {e})") from e
    if isinstance(ds, datasets.DatasetDict):
        for name in _split_names(split):
            if name in ds:
                ds = ds[name]
                break
        else:
            raise ValueError(f"{directory}: no split {split!r} in the saved dataset (has {sorted(ds)})")
    return rows_to_examples(((f"{directory}[{split}]: row {i}", r) for i, r in enumerate(ds)), directory)


def _load_directory(directory: str, split: str) -> list[Example]:
    if _is_saved_dataset(directory):
        return _load_saved_dataset(directory, split)
    tried = []
    for sub in ("", "main", "data"):
        base = os.path.join(directory, sub) if sub else directory
        for name in _split_names(split):
            if os.path.isdir(os.path.join(base, name)) and _is_saved_dataset(os.path.join(base, name)):
                return _load_saved_dataset(os.path.join(base, name), split)
            for ext in SUPPORTED_EXTENSIONS:
                candidate = os.path.join(base, name + ext)
                tried.append(os.path.relpath(candidate, directory))
                if os.path.isfile(candidate):
                    return rows_to_examples(read_rows(candidate, split), candidate)
            shards = sorted(glob.glob(os.path.join(glob.escape(base), f"{name}-*.parquet")))
            if shards:
                return rows_to_examples(_read_parquet(shards), f"{base}/{name}-*.parquet")
    try:
        contents = sorted(os.listdir(directory))
    except OSError:
        contents = []
    shown = ", ".join(contents[:20]) + (", ..." if len(contents) > 20 else "")
    raise FileNotFoundError(
        f"{directory}: no {split!r} split found (looked for {', '.join(tried[:6])}, ... and "
        f"{split}-*.parquet shards; the directory holds: {shown or 'nothing'}). " + _HINT
    )


@contextlib.contextmanager
def _hf_offline():
    """Force the Hugging Face libraries offline for the duration (they read the env vars at import time, so the
    module-level constants are patched too)."""
    saved_env = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    os.environ.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    patched = []
    for mod_name, attrs in (("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")),
                            ("huggingface_hub.constants", ("HF_HUB_OFFLINE",))):
        try:
            mod = __import__(mod_name, fromlist=["_"])
        except ImportError:
            continue
        for attr in attrs:
            if hasattr(mod, attr):
                patched.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, True)
    try:
        yield
    finally:
        for mod, attr, value in reversed(patched):
            setattr(mod, attr, value)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _looks_like_hub_name(path: str) -> bool:
    return (
        bool(_HUB_NAME_RE.match(path))
        and _extension(path) not in SUPPORTED_EXTENSIONS
        and not path.startswith((".", "~"))
    )


def _load_hub_offline(name: str, split: str) -> list[Example]:
    no_download = (
        f"{name!r} is not a local file or directory. Loading it as a Hugging Face dataset name only works from the "
        "local cache (offline: nothing can be downloaded here)"
    )
    try:
        import datasets
    except ImportError:
        raise FileNotFoundError(f"{no_download}, and the `datasets` package is not installed. " + _HINT) from None
    config = "main" if name.rsplit("/", 1)[-1].lower() == "gsm8k" else None
    try:
        with _hf_offline():
            ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:
        msg = str(e).splitlines()[0][:300] if str(e) else ""
        raise FileNotFoundError(f"{no_download}; it is not cached ({type(e).__name__}: {msg}). " + _HINT) from None
    return rows_to_examples(((f"{name}[{split}]: row {i}", r) for i, r in enumerate(ds)), f"{name}[{split}]")


def load_gsm8k(path: str, split: str = "train") -> list[Example]:
    """Load GSM8K-format examples from ``path`` (see the module docstring). ``split`` is ``"train"`` or ``"test"``
    (``"validation"``/``"val"``/``"eval"`` files are accepted for ``"test"``); a single file ignores it."""
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"data path must be a non-empty string, got {path!r}. " + _HINT)
    expanded = os.path.expanduser(path)
    if os.path.isdir(expanded):
        return _load_directory(expanded, split)
    if os.path.isfile(expanded):
        return rows_to_examples(read_rows(expanded, split), expanded)
    if os.path.exists(expanded):
        raise ValueError(f"{path}: not a regular file or directory. " + _HINT)
    if _looks_like_hub_name(path):
        return _load_hub_offline(path, split)
    raise FileNotFoundError(f"data path {path!r} does not exist. " + _HINT)
