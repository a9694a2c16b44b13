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

import argparse
import sys
from typing import Any

GIB = 2**30
SCHEMA = "disttrain.plan/1"
FIELDS = {
    "layers": ("n_layer", "n_layers", "num_layers"),
    "hidden": ("d_model", "n_embd", "hidden_size", "dim"),
    "heads": ("n_head", "n_heads", "num_heads"),
    "seq": ("seq_len", "block_size", "max_seq_len", "context_length"),
    "vocab": ("vocab_size", "n_vocab"),
}
# Preference when several layouts fit: least communication and least code first.
PREFERENCE = ("ddp", "zero1", "zero2", "hsdp", "fsdp", "tp x fsdp", "tp", "tp x pp", "pp")


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


def precision(cfg: dict[str, Any]) -> dict[str, Any]:
    """Bytes per parameter for params, grads and optimizer state, and per activation element."""
    amp = cfg.get("amp", {})
    mixed = amp.get("name", "off") != "off" and str(amp.get("dtype", "")) in (
        "bfloat16",
        "float16",
        "bf16",
        "fp16",
    )
    target = str(cfg["optim"].get("_target_", ""))
    name = target.rsplit(".", 1)[-1]
    if "adam" in name.lower() or "lamb" in name.lower():
        states = 2
    elif name == "SGD":
        states = 1 if cfg["optim"].get("momentum", 0) else 0
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


def count_params(cfg: dict[str, Any]) -> tuple[Any, int, int]:
    """(meta model, parameters, parameter tensors): built on the meta device, no memory used."""
    import torch

    from disttrain.models import build_model

    with torch.device("meta"):
        model = build_model(cfg["model"])
    params = list(model.parameters())
    return model, sum(p.numel() for p in params), len(params)


def activation_bytes(
    cfg: dict[str, Any], model: Any, batch: int, act_bytes: int, ckpt: bool
) -> tuple[float, str, int]:
    """(bytes of activations kept for backward per micro-batch, how it was estimated, layers)."""
    dims = transformer_dims(cfg["model"])
    if dims is not None:
        s, h, a, n_layers, v = dims["seq"], dims["hidden"], dims["heads"], dims["layers"], dims["vocab"]
        scale = act_bytes / 2  # the paper counts 16-bit activations (+ 1-byte dropout masks)
        layer = s * batch * h * (34 + 5 * a * s / h) * scale
        kept = n_layers * 2 * s * batch * h * scale + layer if ckpt else n_layers * layer
        logits = 4 * s * batch * v  # fp32 logits for the loss
        how = "transformer: Korthikanti et al. 2022 eq. 2" + (" with full recomputation" if ckpt else "")
        return kept + logits, how, n_layers
    layers = sum(1 for m in model.modules() if not list(m.children()) and list(m.parameters(recurse=False)))
    elements = _meta_forward_elements(cfg, model, batch)
    if elements is not None:
        return elements * act_bytes, "meta forward: sum of leaf-module outputs", max(layers, 1)
    widths = sum(getattr(m, "out_features", 0) for m in model.modules())
    return batch * widths * act_bytes, "batch x sum of layer widths (forward on meta failed)", max(layers, 1)


def _meta_forward_elements(cfg: dict[str, Any], model: Any, batch: int) -> int | None:
    import torch

    features = cfg.get("data", {}).get("num_features")
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


def layouts(world: int, per_node: int, nodes: int, layers: int, heads: int | None) -> list[dict[str, Any]]:
    """Candidate layouts: degrees dp x tp x pp = world, and the ZeRO stage of the dp dimension."""

    def row(
        name: str, tp: int = 1, pp: int = 1, zero: int = 0, shard: int = 1, note: str = ""
    ) -> dict[str, Any]:
        return {
            "layout": name,
            "dp": world // (tp * pp),
            "tp": tp,
            "pp": pp,
            "zero": zero,
            "shard": shard,
            "note": note,
        }

    out = [
        row("ddp", note="full replica per rank"),
        row("zero1", zero=1, shard=world, note="optimizer state sharded; same traffic as ddp"),
        row("zero2", zero=2, shard=world, note="gradients + optimizer state sharded; same traffic as ddp"),
        row("fsdp", zero=3, shard=world, note="zero3: everything sharded; 1.5x ddp's traffic"),
        row(
            "hsdp",
            zero=3,
            shard=per_node,
            note="sharded within a node, replicated across nodes" if nodes > 1 else "= fsdp on one node",
        ),
    ]
    tp_ok = per_node > 1 and (heads is None or heads % per_node == 0)
    if tp_ok:
        out.append(row("tp", tp=per_node, note=f"tp over the {per_node} local ranks, dp across nodes"))
    pp = max(d for d in range(1, min(world, layers) + 1) if world % d == 0)
    if pp > 1:
        out.append(row("pp", pp=pp, note=f"{pp} balanced stages; stage 0 keeps ~all activations (1F1B)"))
    if tp_ok and nodes > 1:
        out.append(
            row("tp x fsdp", tp=per_node, zero=3, shard=nodes, note="tp in the node, fsdp across nodes")
        )
        if nodes <= layers:
            out.append(
                row("tp x pp", tp=per_node, pp=nodes, note="tp in the node, one pipeline stage per node")
            )
    elif tp_ok and per_node >= 4:
        half = per_node // 2
        if heads is None or heads % half == 0:
            out.append(
                row("tp x fsdp", tp=half, zero=3, shard=world // half, note=f"tp{half} x fsdp{world // half}")
            )
    return out


def per_rank(layout: dict[str, Any], params: int, prec: dict[str, Any], act: float) -> dict[str, float]:
    """Bytes one rank holds under `layout`."""
    local = params / (layout["tp"] * layout["pp"])
    zero, shard = layout["zero"], layout["shard"]
    b = {
        "params": local * prec["params"] / (shard if zero >= 3 else 1),
        "grads": local * prec["grads"] / (shard if zero >= 2 else 1),
        "optimizer": local * prec["optimizer_bytes"] / (shard if zero >= 1 else 1),
        "activations": act / layout["tp"],
    }
    b["total"] = sum(b.values())
    return b


def plan(cfg: dict[str, Any]) -> dict[str, Any]:
    """The whole plan as a JSON-ready dict."""
    model, params, tensors = count_params(cfg)
    prec = precision(cfg)
    p = cfg.get("plan") or {}
    batch = int(p.get("micro_batch") or cfg["trainer"]["batch_size"])
    ckpt = bool(p.get("activation_checkpointing", False))
    act, method, layers = activation_bytes(cfg, model, batch, prec["activation"], ckpt)
    world, per_node, nodes = cfg["nodes"] * cfg["nproc_per_node"], cfg["nproc_per_node"], cfg["nodes"]
    usable = float(p.get("gpu_mem_gb", 80.0)) * GIB * float(p.get("usable_fraction", 0.9))
    dims = transformer_dims(cfg["model"])
    rows = layouts(world, per_node, nodes, layers, dims["heads"] if dims else None)
    for r in rows:
        r["bytes"] = per_rank(r, params, prec, act)
        r["fits"] = r["bytes"]["total"] <= usable
    return {
        "schema": SCHEMA,
        "model": {
            "target": cfg["model"].get("_target_"),
            "params": params,
            "param_tensors": tensors,
            "layers": layers,
        },
        "world": {"nodes": nodes, "nproc_per_node": per_node, "world_size": world},
        "precision": prec,
        "micro_batch": batch,
        "activations": {"bytes": act, "method": method, "checkpointing": ckpt},
        "gpu_mem_gb": float(p.get("gpu_mem_gb", 80.0)),
        "usable_bytes": usable,
        "layouts": rows,
        "recommendation": recommend(rows, usable),
    }


def recommend(rows: list[dict[str, Any]], usable: float) -> dict[str, Any]:
    by_name = {r["layout"]: r for r in rows}
    from disttrain.tools.render import human_bytes as gb

    ddp = by_name["ddp"]["bytes"]
    for name in PREFERENCE:
        r = by_name.get(name)
        if r is None or not r["fits"]:
            continue
        if name == "ddp":
            why = f"the whole training state and activations ({gb(ddp['total'])}) fit on one device: ddp has the least communication"
        elif name in ("zero1", "zero2"):
            why = f"ddp needs {gb(ddp['total'])} per rank > {gb(usable)} usable; {name} fits ({gb(r['bytes']['total'])}) with ddp's traffic"
        elif name == "hsdp":
            why = f"sharding within each node fits ({gb(r['bytes']['total'])}) and keeps inter-node traffic to ddp's gradient all-reduce"
        elif name == "fsdp":
            why = f"only full sharding fits ({gb(r['bytes']['total'])} <= {gb(usable)}); it costs 1.5x ddp's traffic"
        else:
            why = f"activations ({gb(by_name['fsdp']['bytes']['activations'])}) need splitting; {name} fits ({gb(r['bytes']['total'])})"
        return {"layout": name, "reason": why}
    best = min(rows, key=lambda r: r["bytes"]["total"])
    return {
        "layout": None,
        "reason": f"nothing fits in {gb(usable)}; the smallest is {best['layout']} at {gb(best['bytes']['total'])}. "
        "HINT: plan.activation_checkpointing=true, a smaller plan.micro_batch, more GPUs, or mixed precision.",
    }


def cmd_plan(rest: list[str]) -> int:
    """`disttrain plan [--json] [overrides]`: memory per rank for each layout, and a recommendation."""
    p = argparse.ArgumentParser(prog="disttrain plan", description=cmd_plan.__doc__)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--config-dir", default=None, help="your own config folder, as for train")
    p.add_argument(
        "overrides", nargs="*", help="config overrides, e.g. model.hidden=[4096,4096] plan.gpu_mem_gb=40"
    )
    args = p.parse_intermixed_args(rest)
    from disttrain.config import compose, resolve
    from disttrain.config.validate import check_static

    cfg = resolve(compose(args.overrides, args.config_dir), args.overrides)
    check_static(cfg)
    result = plan(cfg)
    if args.json:
        from disttrain.tools.render import print_json

        print_json(result)
    else:
        render(result)
    return 0


def render(result: dict[str, Any]) -> None:
    from disttrain.tools.render import console, human_bytes, table

    m, w, pr = result["model"], result["world"], result["precision"]
    rows = []
    for r in result["layouts"]:
        b = r["bytes"]
        rows.append(
            (
                r["layout"],
                f"{r['dp']}x{r['tp']}x{r['pp']}",
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
        "dp x tp x pp",
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
