"""Per-rank entry of `disttrain eval` and `disttrain predict`: load a checkpoint, never train.

The command freezes the run's config (with the user's overrides) into a job folder beside a
`job.json` ({"mode": "eval"|"predict", "checkpoint": PATH, "out": PATH}) and launches this module
the way `train` launches `disttrain.worker`. Each rank builds the parts as training does (any
strategy, any world size), restores the model through the Checkpointer (DCP reshards it), and:

- eval: runs training's own validation (`engine.loop.validation`: `Strategy.eval_step`,
  `Task.eval_sums`, sums reduced across ranks); rank 0 writes the metrics to `out`;
- predict: runs the model (or the task's `predict(model, batch)` hook) over the validation set's
  shards and gathers (dataset index, output) pairs on rank 0, which writes one row per sample in
  dataset order. ShardSampler gives every sample to exactly one data-parallel rank (no padding);
  ranks that share a batch (tp, cp) hold the same indices, kept once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, default_collate

from disttrain import checkpoint, storage
from disttrain.checkpoint.manager import Checkpointer, ModelState
from disttrain.config.run import Run
from disttrain.config.schema import EmaConfig
from disttrain.dist import DistEnv, destroy_process_group, init_process_group
from disttrain.engine.ema import EMA, NullEMA
from disttrain.engine.loop import val_batches, validation
from disttrain.engine.state import TrainState
from disttrain.observe import host_memory
from disttrain.observe.log import get_logger, setup_logging, teardown_logging
from disttrain.rundir import JOB, RunDir, read_config, write_json
from disttrain.storage import ObjectPath
from disttrain.strategies.base import Strategy
from disttrain.tasks import Task
from disttrain.tasks import batch as batches

log = get_logger()

ENTRY = "disttrain.eval_worker"


def run(run_dir: str | Path) -> dict[str, Any] | None:
    """Rank entry (the launcher's `entry`): evaluate or predict as the rank the environment describes."""
    import os
    import sys

    from disttrain.strategies import specs
    from disttrain.worker import set_threads

    job_dir = Path(run_dir)
    run = Run.of(read_config(job_dir))  # once per rank: everything below takes it
    storage.configure(run.storage_options)  # s3:// and gs:// paths: the config's store options
    job = json.loads((job_dir / JOB).read_text(encoding="utf-8"))
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # the user's own modules, as in the parent; never ahead of torch
    env = DistEnv.from_env(str(run.backend.name))  # a plain string, as config.yaml holds it
    setup_logging(RunDir(job_dir).logs, env.rank, to_console=env.is_zero)
    set_threads(run, env)
    try:
        init_process_group(env, run.backend.timeout, cpu_collectives=specs.cpu_collectives(run))
        return evaluate(run, env, job)
    except BaseException:
        log.exception("rank %d failed", env.rank)
        raise
    finally:
        destroy_process_group()
        teardown_logging()


def evaluate(run: Run, env: DistEnv, job: dict[str, Any]) -> dict[str, Any]:
    """Build, restore, then eval or predict; rank 0 writes `job["out"]`. Returns what it wrote."""
    from disttrain.worker import build_parts

    base = Path(job["base"]) if job.get("base") else None  # peft=lora: the base's record, compared
    strategy, parts = build_parts(run, env, base, record=False)
    if parts.val_loader is None:  # the command checks it; a user's data module may still build None
        raise RuntimeError("the validation data set is empty or not configured (data.val)")
    # --ema: the checkpoint's averaged weights, swapped in (the decay is never used: nothing updates)
    ema = EMA(EmaConfig(decay=0.5), strategy.unwrap(parts.model)) if job.get("ema") else NullEMA()
    restored = restore(run, env, strategy, parts.model, storage.location(job["checkpoint"]), ema)
    where = {"checkpoint": str(restored[0]), "step": restored[1], "world_size": env.world_size}
    if isinstance(ema, EMA):
        where["weights"] = "ema"
    # The loops run with the setup's objects frozen, as training does (host_memory.frozen_heap): a
    # rank's first full collection would scan them all while its peers wait in a collective forward.
    if job["mode"] == "eval":
        cap = run.trainer.val_batches  # a stream's validation length (trainer.val_batches)
        with host_memory.frozen_heap(), ema.swapped_in():
            values = validation(strategy, parts.model, parts.task, parts.val_loader, env.device, cap)
        result = {**where, "metrics": values, "strategy": strategy.name}
        if env.is_zero:
            write_json(Path(job["out"]), result)
        return result
    with host_memory.frozen_heap(), ema.swapped_in():
        rows = predict(strategy, parts.model, parts.task, parts.val_loader, env)
    if env.is_zero:
        write_predictions(rows, Path(job["out"]))
        if job.get("result"):  # the command's last line names the checkpoint these rows come from
            write_json(Path(job["result"]), where)
    return {**where, "rows": len(rows)}


def restore(
    run: Run,
    env: DistEnv,
    strategy: Strategy,
    model: torch.nn.Module,
    location: Path | ObjectPath,
    ema: NullEMA | None = None,
) -> tuple[Path | ObjectPath, int]:
    """The model (through ModelState, the strategy's own sharded state dict: it reshards to this
    world size and strategy) from the newest loadable checkpoint at `location`; no scheduler, no
    train state, no RNG is applied. No optimizer: its state is neither built nor read (AdamW's
    would be twice the parameters' bytes). `ema` (an EMA): its weights too."""
    state = TrainState()
    states: dict[str, Any] = {"model": ModelState(strategy, model, None), "train": state}
    if isinstance(ema, EMA):
        states["ema"] = ema
    ckpt = Checkpointer(run.checkpoint, location, env, states, barrier=strategy.barrier)
    restored = ckpt.load(location, report=False, fallback=not checkpoint.named(location))
    if restored is None:
        raise FileNotFoundError(f"no loadable checkpoint under {location}")
    if isinstance(ema, EMA) and not ema.active:  # the command checked the newest; a fallback may lack it
        raise RuntimeError(
            f"--ema: checkpoint {restored.path} holds no EMA weights (before trainer.ema.start_step)"
        )
    if env.is_zero:
        log.info("loaded %s (step %d) on %d rank(s)", restored.path, state.step, env.world_size)
    return restored.path, state.step


# ------------------------------------------------------------------------------------ predict
@torch.no_grad()
def predict(
    strategy: Strategy, model: torch.nn.Module, task: Task, loader: DataLoader, env: DistEnv
) -> list[tuple[int, Any]]:
    """(dataset index, output) of every sample of the loader's dataset on rank 0, in dataset order
    ([] on the other ranks). Every rank runs as many forwards as the longest shard (fsdp's and tp's
    forward is a collective), and a shorter shard's extra forward is dropped."""
    model.eval()
    indices = list(loader.sampler)  # ShardSampler: this rank's samples, in order
    mine: list[tuple[int, Any]] = []
    batch: Any = None
    dropped: dict[str, str] = {}
    for batch in loader:
        n = batches.leading_size(batch)
        out = _per_sample(_to_cpu(forward(strategy, model, task, batch, env.device), dropped), n)
        for i in range(n):
            mine.append((indices[len(mine)], _row(out, i)))
    if dropped and env.is_zero:
        log.info(
            "predict: dropped what the model's dict output holds besides tensors: %s",
            ", ".join(f"{k} ({kind})" for k, kind in dropped.items()),
        )
    for _ in range(val_batches(loader) - len(loader)):
        if batch is None:
            batch = default_collate([loader.dataset[0]])
        forward(strategy, model, task, batch, env.device)
    if len(mine) != len(indices):
        raise RuntimeError(f"rank {env.rank}: {len(mine)} outputs for {len(indices)} samples")
    gathered: list[Any] = [mine]
    if dist.is_initialized() and env.world_size > 1:
        gathered = [None] * env.world_size if env.is_zero else []
        dist.gather_object(mine, gathered if env.is_zero else None, dst=0)
    if not env.is_zero:
        return []
    by_index: dict[int, Any] = {}
    for part in gathered:
        for index, row in part:
            by_index.setdefault(index, row)  # ranks sharing a batch (tp) hold the same samples
    return sorted(by_index.items(), key=lambda kv: kv[0])


def forward(strategy: Strategy, model: torch.nn.Module, task: Task, batch: Any, device: torch.device) -> Any:
    """The task's `predict(model, batch)` hook, else the task's model call on the batch's inputs."""
    batch = batches.to_device(batch, device)
    hook = getattr(task, "predict", None)
    with strategy.precision.autocast():
        if callable(hook):
            return hook(model, batch)
        inputs, target = task.unpack(batch)
        return task.forward(model, inputs, target)


def _to_cpu(out: Any, dropped: dict[str, str]) -> Any:
    """Outputs as plain CPU tensors (a DTensor, tp's output, is gathered whole first). A dict's
    values that hold no tensors (the cache object of a Hugging Face causal LM's output, None) are
    dropped, their keys and types recorded in `dropped`."""
    if isinstance(out, torch.Tensor):
        full = getattr(out, "full_tensor", None)
        return (full() if callable(full) else out).detach().cpu()
    if isinstance(out, dict):
        kept = {k: v for k, v in out.items() if _tensors(v)}
        dropped.update((str(k), type(v).__name__) for k, v in out.items() if k not in kept)
        return {k: _to_cpu(v, dropped) for k, v in kept.items()}
    if isinstance(out, (tuple, list)):
        return type(out)(_to_cpu(v, dropped) for v in out)
    raise TypeError(
        f"predict: the model (or task.predict) returned {type(out).__name__}; it must return a tensor "
        "(first dimension: the batch), a dict or a tuple of them"
    )


def _tensors(value: Any) -> bool:
    """Whether `value` is a tensor, or a dict, tuple or list of them (nested)."""
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        return all(_tensors(v) for v in value.values())
    return isinstance(value, (tuple, list)) and all(_tensors(v) for v in value)


def _per_sample(out: Any, n: int) -> Any:
    """The parts of an output that hold one entry per sample (first dimension `n`): a batch-level
    value beside them (the loss in a model's `(logits, loss)` or Hugging Face output) is dropped."""
    if isinstance(out, torch.Tensor):
        if out.dim() == 0 or out.shape[0] != n:
            raise TypeError(
                f"predict: the output's shape {tuple(out.shape)} has no first dimension of the batch's "
                f"{n} samples; give your Task a predict(model, batch) method returning per-sample values"
            )
        return out
    if isinstance(out, dict):
        kept = {
            k: v for k, v in out.items() if not isinstance(v, torch.Tensor) or (v.dim() and v.shape[0] == n)
        }
        return {k: _per_sample(v, n) for k, v in kept.items()}
    kept_items = [v for v in out if not isinstance(v, torch.Tensor) or (v.dim() and v.shape[0] == n)]
    if len(kept_items) == 1:
        return _per_sample(kept_items[0], n)  # (logits, loss): the logits
    return type(out)(_per_sample(v, n) for v in kept_items)


def _row(out: Any, i: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out[i].clone()
    if isinstance(out, dict):
        return {k: _row(v, i) for k, v in out.items()}
    return type(out)(_row(v, i) for v in out)


LARGE_OUTPUT = 64 * 2**20  # predictions from this size on are announced before they are written


def write_predictions(rows: list[tuple[int, Any]], out: Path) -> None:
    """`.pt`: one tensor stacked over the samples (or a dict of them), torch.load(weights_only=True)
    reads it; `.npy`: the stacked tensor as a NumPy array; otherwise JSON lines, one per sample:
    {"index": i, "output": [...]} (a dict output: its keys beside "index"). A file of LARGE_OUTPUT
    or more is announced with its size, and what would make it smaller, before it is written."""
    from disttrain.checkpoint.files import save_atomic
    from disttrain.safefile import write_atomic

    out.parent.mkdir(parents=True, exist_ok=True)
    values = [row for _, row in rows]
    if out.suffix in (".pt", ".npy"):
        stacked = _stack(values)
        if out.suffix == ".pt":
            _announce(out, _nbytes(stacked), len(rows), values)
            save_atomic(stacked, out)
            return
        if not isinstance(stacked, torch.Tensor):
            raise TypeError(
                f"predict --out {out}: .npy holds one array; the outputs are {type(stacked).__name__}"
            )
        import io

        import numpy as np

        buffer = io.BytesIO()
        np.save(buffer, stacked.float().numpy() if stacked.dtype == torch.bfloat16 else stacked.numpy())
        _announce(out, buffer.getbuffer().nbytes, len(rows), values)
        write_atomic(out, buffer.getvalue())
        return
    lines = [json.dumps({"index": index, **_json_row(row)}) for index, row in rows]
    payload = ("\n".join(lines) + "\n" if lines else "").encode("utf-8")
    _announce(out, len(payload), len(rows), values)
    write_atomic(out, payload)


def _nbytes(value: Any) -> int:
    """The bytes of the tensors in `value` (a tensor, or a dict, list or tuple of them)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_nbytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _announce(out: Path, size: int, rows: int, values: list[Any]) -> None:
    """A warning line before a large file is written (review 2026-11-28-ux #15: 242 MB of JSON
    logits without a word): its size, and how to make it smaller."""
    if size < LARGE_OUTPUT:
        return
    binary = (_nbytes(values[0]) if values else 0) * rows
    hint = (
        f"--out {out.with_suffix('.npy').name} (or .pt) holds the same numbers in binary: about {_size(binary)}"
        if out.suffix not in (".pt", ".npy") and binary
        else "fewer samples: data.val=FILE with a subset"
    )
    log.warning(
        "predict: writing %s to %s (%d rows, %s a row); smaller: %s; or a Task.predict that returns "
        "only what you need (e.g. the argmax class instead of every logit)",
        _size(size),
        out,
        rows,
        _size(size // max(rows, 1)),
        hint,
    )


def _size(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.1f} KiB"


def _stack(values: list[Any]) -> Any:
    if not values:
        return torch.empty(0)
    if isinstance(values[0], torch.Tensor):
        return torch.stack(values)
    if isinstance(values[0], dict):
        return {k: _stack([v[k] for v in values]) for k in values[0]}
    return type(values[0])(_stack([v[j] for v in values]) for j in range(len(values[0])))


def _json_row(row: Any) -> dict[str, Any]:
    if isinstance(row, dict):
        return {str(k): _plain(v) for k, v in row.items()}
    return {"output": _plain(row)}


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.float().tolist() if value.dtype == torch.bfloat16 else value.tolist()
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


if __name__ == "__main__":
    from disttrain.dist import exit_rank, rank_main

    exit_rank(rank_main(run, ENTRY))
