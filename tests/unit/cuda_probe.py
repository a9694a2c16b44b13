"""Import the fork server's preloads and record every CUDA or accelerator probe they make.

    python tests/unit/cuda_probe.py     # prints one JSON object per preload (ddp's, then fsdp's)

Run in a fresh interpreter (test_launch_forkserver.py, scripts/check_forkserver_cuda.sh): a profile
hook set before `import torch` sees, from torch's own import on, every call into torch.cuda or
torch.accelerator from outside them (a module or class body defining things is not a call) and
every call of a torch._C builtin whose name mentions cuda or accelerator, with its caller. It
imports `forkserver.preload(cfg)`, what `warm_up(cfg)` hands the server, for ddp and then for
fsdp (the same list since issue 25; torch._dynamo in it: on a CUDA build it imports triton).
Nothing is replaced: the hook only watches.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

PROBED = tuple(os.sep + os.path.join("torch", d) + os.sep for d in ("cuda", "accelerator"))
CO_NEWLOCALS = 0x2  # set for functions; unset for module and class bodies


def _inside(code: Any) -> bool:
    return any(d in code.co_filename for d in PROBED)


def _where(frame: Any) -> str:
    return f"{frame.f_code.co_filename.rsplit('site-packages' + os.sep, 1)[-1]}:{frame.f_lineno}"


def main() -> list[dict[str, Any]]:
    seen: dict[str, str] = {}

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code, back = frame.f_code, frame.f_back
            if code.co_flags & CO_NEWLOCALS and _inside(code) and not (back and _inside(back.f_code)):
                name = code.co_filename.rsplit("torch" + os.sep, 1)[-1]
                seen.setdefault(f"torch/{name}:{code.co_name}", _where(back) if back else "?")
        elif event == "c_call":
            name = str(getattr(arg, "__name__", ""))
            if ("cuda" in name.lower() or "accelerator" in name.lower()) and str(
                getattr(arg, "__module__", "")
            ).startswith("torch"):
                seen.setdefault(f"torch._C.{name}", _where(frame))

    from disttrain.launch.forkserver import preload  # imports no torch

    results, done = [], set()
    for strategy in ("ddp", "fsdp"):  # the server's list is the same for every strategy (and peft=none)
        modules = preload()
        sys.setprofile(hook)
        try:
            for module in modules:
                if module not in done:
                    importlib.import_module(module)
                    done.add(module)
        finally:
            sys.setprofile(None)
        import torch

        results.append(
            {
                "strategy": strategy,
                "modules": modules,
                "probes": [f"{name} (called from {where})" for name, where in seen.items()],
                "cuda_initialized": torch.cuda.is_initialized(),
                "triton_imported": "triton" in sys.modules,
                "torch": torch.__version__,
                "cuda_build": torch.version.cuda,
            }
        )
    return results


if __name__ == "__main__":
    for result in main():
        print(json.dumps(result))
