"""Tokenizing `data=hf` rows once, cached on disk: `data.tokenizer=FOLDER`.

Rows are read in one of three forms (TRL's names), each row by the fields it holds (JSON lines may mix
them: a field a row lacks reads as null):

- `messages`: a chat (a list of {role, content}) rendered by the tokenizer's chat template; only the
  assistant turns are trained (each turn's tokens are what the template adds after the prompt it
  renders for that turn with `add_generation_prompt=True`);
- `prompt` and `completion`: the prompt's tokens, then the completion's and EOS; only the
  completion (and EOS) is trained;
- `text`: every token is trained (EOS appended).

Each row becomes `input_ids` and `labels` (unshifted, IGNORE = -100 where not trained). The result is
saved with `save_to_disk` in `data.cache_dir/<key>`, the key a hash of the data files (path, size,
modification time), the tokenizer's files and the settings, and read back memory-mapped. The
launcher builds the data sets before any rank starts (the pre-launch checks), so it tokenizes and
every rank reads the cache; a lock and an atomic rename keep two writers from meeting anyway.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from disttrain.config.errors import ConfigError
from disttrain.data.packing import IGNORE

VERSION = 1  # bump when what a cached folder holds changes
FORMS = "a messages field (chat), prompt and completion fields, or a text field"


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "disttrain" / "tokenized"


def load_tokenizer(path: str) -> Any:
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except ImportError:
        raise ConfigError(
            "data.tokenizer",
            path,
            "a tokenizer folder, with transformers installed",
            "pip install transformers.",
        ) from None
    except Exception as exc:
        raise ConfigError(
            "data.tokenizer",
            path,
            "a folder written by a tokenizer's save_pretrained (tokenizer.json, tokenizer_config.json)",
            f"transformers could not load it ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}).",
        ) from None


def cache_key(data_path: str, split: str, tokenizer_path: str, form: str) -> str:
    """A hash of what the tokenized rows depend on: the files, the tokenizer and the settings."""
    h = hashlib.sha256(json.dumps({"version": VERSION, "split": split, "form": form}).encode())
    for file in _files(data_path):
        st = file.stat()
        h.update(f"{file.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    for file in _files(tokenizer_path):
        h.update(f"{file.name}\0".encode())
        h.update(file.read_bytes())
    return h.hexdigest()[:24]


def _files(path: str) -> list[Path]:
    root = Path(path)
    found = (
        sorted(p for p in root.rglob("*") if p.is_file())
        if root.is_dir()
        else sorted(map(Path, glob.glob(path)))
    )
    return [p for p in found if p.is_file()]


def form_of(columns: list[str], key_value: str) -> str:
    if "messages" in columns:
        return "messages"
    if "prompt" in columns and "completion" in columns:
        return "prompt_completion"
    if "text" in columns:
        return "text"
    raise ConfigError(
        "data.tokenizer",
        key_value,
        f"rows with {FORMS}",
        f"the rows have {', '.join(columns)}: rename the fields (data.map), or tokenize beforehand "
        "and leave data.tokenizer null.",
    )


def tokenized(ds: Any, data_path: str, split: str, tokenizer_path: str, cache_dir: str | None) -> Any:
    """`ds` (a map-style data set of text rows) as `input_ids` and `labels` rows, from the cache."""
    import datasets

    form = form_of(list(ds.column_names), tokenizer_path)  # the richest form the columns allow
    root = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    final = root / cache_key(data_path, split, tokenizer_path, form)
    if not (final / "dataset_info.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        with _locked(root / f"{final.name}.lock"):
            if not (final / "dataset_info.json").exists():  # another process may have written it
                _write(ds, form, tokenizer_path, final)
    return datasets.load_from_disk(str(final))


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _write(ds: Any, form: str, tokenizer_path: str, final: Path) -> None:
    tok = load_tokenizer(tokenizer_path)
    if form == "messages" and not getattr(tok, "chat_template", None):
        raise ConfigError(
            "data.tokenizer",
            tokenizer_path,
            "a tokenizer with a chat template, for rows with a messages field",
            "set tokenizer.chat_template before save_pretrained, or give rows prompt and completion fields.",
        )
    out = ds.map(
        lambda row: _encode(tok, row),
        remove_columns=list(ds.column_names),
        desc="tokenizing (data.tokenizer)",
    )
    tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    out.save_to_disk(str(tmp))
    os.replace(tmp, final)  # whole or not at all: a reader never sees half a folder


def _encode(tok: Any, row: dict[str, Any]) -> dict[str, list[int]]:
    """One row by the fields it has (not null)."""
    if row.get("messages") is not None:
        return _chat(tok, row)
    if row.get("prompt") is not None and row.get("completion") is not None:
        return _prompt_completion(tok, row)
    if row.get("text") is not None:
        return _text(tok, row)
    have = [k for k, v in row.items() if v is not None]
    raise ValueError(f"data.tokenizer: a row has none of {FORMS} (it has {', '.join(have)})")


def _ids(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _with_eos(tok: Any, ids: list[int]) -> list[int]:
    eos = tok.eos_token_id
    return [*ids, eos] if eos is not None and (not ids or ids[-1] != eos) else ids


def _text(tok: Any, row: dict[str, Any]) -> dict[str, list[int]]:
    ids = _with_eos(tok, _ids(tok, row["text"]))
    return {"input_ids": ids, "labels": ids}


def _prompt_completion(tok: Any, row: dict[str, Any]) -> dict[str, list[int]]:
    prompt, completion = _ids(tok, row["prompt"]), _with_eos(tok, _ids(tok, row["completion"]))
    return {"input_ids": prompt + completion, "labels": [IGNORE] * len(prompt) + completion}


def _render(tok: Any, messages: list[dict[str, Any]], prompt: bool) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)
    ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
    return [int(i) for i in ids]


def _chat(tok: Any, row: dict[str, Any]) -> dict[str, list[int]]:
    """Every assistant turn trained, the rest (system, user, the template's markup) not."""
    messages = row["messages"]
    ids = _render(tok, messages, prompt=False)
    labels = [IGNORE] * len(ids)
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        start, end = (
            len(_render(tok, messages[:k], prompt=True)),
            len(_render(tok, messages[: k + 1], prompt=False)),
        )
        if _render(tok, messages[: k + 1], prompt=False) != ids[:end]:
            raise ValueError(
                "data.tokenizer: the chat template renders a conversation's start differently once "
                "later turns follow: the assistant turns cannot be told from the prompt"
            )
        labels[start:end] = ids[start:end]
    return {"input_ids": ids, "labels": labels}
