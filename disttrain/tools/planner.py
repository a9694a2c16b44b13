"""`disttrain plan`: per-rank memory of parallel layouts for the config's model; which fit; which to use.

The model is built on the meta device (shapes only, no memory). Per parameter, training holds
p + g + k bytes: fp32 training 4 + 4 + 4 x (optimizer states); mixed precision as in the ZeRO paper
(Rajbhandari et al. 2020, sec. 3.1): 2 (fp16/bf16 params) + 2 (grads) + K, K = 4 (fp32 master copy) +
4 x states, so K = 12 for Adam. With data-parallel degree N: ZeRO-1 shards k, ZeRO-2 shards g and k,
ZeRO-3 / FSDP shards all three; HSDP shards within a node and replicates across nodes; tensor (t) and
pipeline (p) parallelism split the model itself by t x p. Activations: for a transformer (config fields
n_layer, d_model, n_head, seq_len) Korthikanti et al. 2022, eq. 2: s b h (34 + 5 a s / h) bytes per layer
with 16-bit activations, split by t with sequence parallelism; for any other model a forward pass on
meta tensors sums every leaf module's output (what autograd keeps, roughly).
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from disttrain.config.run import Run
    from disttrain.strategies.specs import Layout, PlanRow

GIB = 2**30
TORCH_SGD_MOMENTUM = 0  # torch.optim.SGD's own default: a swapped `optim._target_` starts clean
SCHEMA = "disttrain.plan/1"
FIELDS = {
    "layers": ("n_layer", "n_layers", "num_layers"),
    "hidden": ("d_model", "n_embd", "hidden_size", "dim"),
    "heads": ("n_head", "n_heads", "num_heads"),
    "seq": ("seq_len", "block_size", "max_seq_len", "context_length"),
    "vocab": ("vocab_size", "n_vocab"),
}


def _field(model: dict[str, Any], role: str) -> int | None:
    for name in FIELDS[role]:
        if isinstance(model.get(name), int):
            return int(model[name])
    return None


def transformer_dims(model: dict[str, Any]) -> dict[str, int] | None:
    dims = {role: _field(model, role) for role in FIELDS}
    if dims["layers"] is None or dims["hidden"] is None:
        return None
    return {
        "layers": dims["layers"],
        "hidden": dims["hidden"],
        "heads": dims["heads"] or max(1, dims["hidden"] // 64),
        "seq": dims["seq"] or 1024,
        "vocab": dims["vocab"] or 0,
    }


def precision(run: Run) -> dict[str, Any]:
    """Bytes per parameter for params, grads and optimizer state, and per activation element."""
    amp = run.amp
    mixed = amp.name != "off" and amp.dtype in (
        "bfloat16",
        "float16",
        "bf16",
        "fp16",
    )
    target = run.optim.target
    name = target.rsplit(".", 1)[-1]
    if "adam" in name.lower() or "lamb" in name.lower():
        states = 2
    elif name == "SGD":
        states = 1 if run.optim.kwargs.get("momentum", TORCH_SGD_MOMENTUM) else 0
    elif name in ("Adagrad", "RMSprop", "Adafactor"):
        states = 1
    else:
        states = 2  # unknown optimizer: assume Adam-like
    p, g = (2, 2) if mixed else (4, 4)
    k = (4 + 4 * states) if mixed else 4 * states
    return {
        "mixed": mixed,
        "optimizer": name,
        "optimizer_states": states,
        "params": p,
        "grads": g,
        "optimizer_bytes": k,
        "activation": 2 if mixed else 4,
    }


def count_params(run: Run) -> tuple[Any, int, int]:
    """(meta model, parameters, parameter tensors): built on the meta device, no memory used."""
    import torch

    from disttrain.models import build_model

    with torch.device("meta"):
        model = build_model(run.model)
    params = list(model.parameters())
    return model, sum(p.numel() for p in params), len(params)


def activation_bytes(run: Run, model: Any, batch: int, act_bytes: int, ckpt: bool) -> tuple[float, str, int]:
    """(bytes of activations kept for backward per micro-batch, how it was estimated, layers)."""
    dims = transformer_dims(run.model)
    if dims is not None:
        s, h, a, n_layers, v = dims["seq"], dims["hidden"], dims["heads"], dims["layers"], dims["vocab"]
        scale = act_bytes / 2  # the paper counts 16-bit activations (+ 1-byte dropout masks)
        layer = s * batch * h * (34 + 5 * a * s / h) * scale
        kept = n_layers * 2 * s * batch * h * scale + layer if ckpt else n_layers * layer
        logits = 4 * s * batch * v  # fp32 logits for the loss
        how = "transformer: Korthikanti et al. 2022 eq. 2" + (" with full recomputation" if ckpt else "")
        return kept + logits, how, n_layers
    layers = sum(1 for m in model.modules() if not list(m.children()) and list(m.parameters(recurse=False)))
    elements = _meta_forward_elements(run, model, batch)
    if elements is not None:
        return elements * act_bytes, "meta forward: sum of leaf-module outputs", max(layers, 1)
    widths = sum(getattr(m, "out_features", 0) for m in model.modules())
    return batch * widths * act_bytes, "batch x sum of layer widths (forward on meta failed)", max(layers, 1)


def _meta_forward_elements(run: Run, model: Any, batch: int) -> int | None:
    import torch

    features = run.data.num_features
    if not isinstance(features, int):
        return None
    total = [batch * features]
    hooks = [
        m.register_forward_hook(lambda _m, _i, out: total.append(out.numel() if torch.is_tensor(out) else 0))
        for m in model.modules()
        if not list(m.children())
    ]
    try:
        with torch.no_grad():
            model(torch.empty(batch, features, device="meta"))
    except Exception:
        return None
    finally:
        for h in hooks:
            h.remove()
    return sum(total)


def layouts(world: int, per_node: int, nodes: int, layers: int, heads: int | None) -> list[PlanRow]:
    """Candidate layouts, from the registered strategies' specs: only what a `strategy=` runs.

    Each row has its `Layout`'s degrees (dp x cp x tp x pp = world, the ZeRO stage of the dp
    dimension), and `run`, the overrides that train it; rows are ordered by the spec's preference
    (least communication first).
    """
    from disttrain.strategies import specs

    shape = specs.PlanShape(world=world, per_node=per_node, nodes=nodes, layers=layers, heads=heads)
    rows = [row for spec in specs.all() if spec.plan is not None for row in spec.plan(shape)]
    return sorted(rows, key=lambda r: r.preference)


def per_rank(layout: Layout, params: int, prec: dict[str, Any], act: float) -> dict[str, float]:
    """Bytes one rank holds under `layout`: the model split by tp x pp, the state sharded over
    `layout.shard` ranks at its ZeRO stage, the activations split by tp and by cp (the sequence)."""
    local = params / (layout.tp * layout.pp)
    zero, shard = layout.zero, layout.shard
    b = {
        "params": local * prec["params"] / (shard if zero >= 3 else 1),
        "grads": local * prec["grads"] / (shard if zero >= 2 else 1),
        "optimizer": local * prec["optimizer_bytes"] / (shard if zero >= 1 else 1),
        "activations": act / (layout.tp * layout.cp),
    }
    b["total"] = sum(b.values())
    return b


def plan(run: Run) -> dict[str, Any]:
    """The whole plan as a JSON-ready dict."""
    model, params, tensors = count_params(run)
    prec = precision(run)

    p = run.plan
    batch = int(p.micro_batch or run.trainer.batch_size)
    ckpt = p.activation_checkpointing
    act, method, layers = activation_bytes(run, model, batch, prec["activation"], ckpt)

    world, per_node, nodes = run.world.size, run.world.nproc_per_node, run.world.nodes
    usable = p.gpu_mem_gb * GIB * p.usable_fraction
    dims = transformer_dims(run.model)
    rows = []
    for row in layouts(world, per_node, nodes, layers, dims["heads"] if dims else None):
        b = per_rank(row.layout, params, prec, act)
        rows.append({**row.as_dict(), "bytes": b, "fits": b["total"] <= usable})
    return {
        "schema": SCHEMA,
        "model": {
            "target": run.model.get("_target_"),
            "params": params,
            "param_tensors": tensors,
            "layers": layers,
        },
        "world": {"nodes": nodes, "nproc_per_node": per_node, "world_size": world},
        "precision": prec,
        "micro_batch": batch,
        "activations": {"bytes": act, "method": method, "checkpointing": ckpt},
        "gpu_mem_gb": float(p.gpu_mem_gb),
        "usable_bytes": usable,
        "layouts": rows,
        "recommendation": recommend(rows, usable),
    }


def recommend(rows: list[dict[str, Any]], usable: float) -> dict[str, Any]:
    """The first layout in preference order that fits, and why, told from its degrees (not its name)."""
    from disttrain.strategies.specs.layout import DIMS
    from disttrain.tools.render import human_bytes as gb

    world = max((math.prod(r.get(d, 1) for d in DIMS) for r in rows), default=1)
    replica = next((r for r in rows if r["zero"] == 0 and r["tp"] == r["pp"] == 1), None)
    full = replica["bytes"]["total"] if replica else None
    for r in sorted(rows, key=lambda r: r["preference"]):
        if not r["fits"]:
            continue
        name, total = r["layout"], r["bytes"]["total"]
        if r["zero"] == 0 and r["tp"] == r["pp"] == 1:
            why = f"the whole training state and activations ({gb(total)}) fit on one device: {name} has the least communication"
        elif r["zero"] in (1, 2) and full is not None:
            why = f"a full replica needs {gb(full)} per rank > {gb(usable)} usable; {name} fits ({gb(total)}) with ddp's traffic"
        elif r["zero"] == 3 and r["tp"] == r["pp"] == 1 and r["shard"] < world:
            why = f"sharding within each node fits ({gb(total)}) and keeps inter-node traffic to ddp's gradient all-reduce"
        elif r["zero"] == 3 and r["tp"] == r["pp"] == 1:
            why = f"only full sharding fits ({gb(total)} <= {gb(usable)}); it costs 1.5x ddp's traffic"
        else:
            why = f"activations ({gb(r['bytes']['activations'] * r['tp'])}) need splitting; {name} fits ({gb(total)})"
        return {"layout": name, "run": r["run"], "reason": f"{why}. Run it with {r['run']}"}
    best = min(rows, key=lambda r: r["bytes"]["total"])
    return {
        "layout": None,
        "reason": f"nothing fits in {gb(usable)}; the smallest is {best['layout']} at {gb(best['bytes']['total'])}. "
        "HINT: plan.activation_checkpointing=true, a smaller plan.micro_batch, more GPUs, or mixed precision.",
    }


def render(result: dict[str, Any]) -> None:
    from disttrain.strategies.specs.layout import DIMS
    from disttrain.tools.render import console, human_bytes, table

    m, w, pr = result["model"], result["world"], result["precision"]
    rows = []
    dims = [d for d in DIMS if any(d in r for r in result["layouts"])]
    for r in result["layouts"]:
        b = r["bytes"]
        rows.append(
            (
                r["layout"],
                "x".join(str(r.get(d, 1)) for d in dims),
                *(human_bytes(b[k]) for k in ("params", "grads", "optimizer", "activations", "total")),
                "yes" if r["fits"] else "NO",
                r["note"],
            )
        )
    out = console()
    out.print(
        f"model {m['target']}: {m['params']:,} parameters ({m['param_tensors']} tensors, {m['layers']} layers) | "
        f"{w['nodes']} node(s) x {w['nproc_per_node']} = {w['world_size']} ranks | "
        f"{'mixed precision' if pr['mixed'] else 'fp32'} {pr['optimizer']}: {pr['params']}+{pr['grads']}+"
        f"{pr['optimizer_bytes']} bytes/param | micro batch {result['micro_batch']} | activations: "
        f"{result['activations']['method']}"
    )
    cols = [
        "layout",
        " x ".join(dims),
        ">params",
        ">grads",
        ">optimizer",
        ">activations",
        ">total",
        "fits",
        "note",
    ]
    title = f"per-rank memory (usable: {human_bytes(result['usable_bytes'])} of {result['gpu_mem_gb']:g} GiB)"
    out.print(table(title, cols, rows))
    rec = result["recommendation"]
    sys.stdout.flush()
    out.print(f"recommended: {rec['layout'] or 'none'} - {rec['reason']}")
