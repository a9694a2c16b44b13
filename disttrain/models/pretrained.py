"""The local folder a Hugging Face `*.from_pretrained` model block names: read by the run dir's copy
of the base config (preflight/hf_base.py) and by peft=lora's record of its base (models/adapters.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _path_of(spec: dict[str, Any]) -> Any:
    args = list(spec.get("_args_") or [])
    return spec.get("pretrained_model_name_or_path", args[0] if args else None)


def base_folder(spec: dict[str, Any]) -> Path | None:
    """The local folder a `*.from_pretrained` model block names, when it holds a config.json."""
    if not str(spec.get("_target_")).endswith(".from_pretrained") or isinstance(spec.get("config"), dict):
        return None
    path = _path_of(spec)
    if not isinstance(path, str) or not path:
        return None
    folder = Path(path).expanduser()
    return folder if (folder / "config.json").is_file() else None
