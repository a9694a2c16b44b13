"""Dataclass schemas for every config group, registered in Hydra's ConfigStore.

YAML files under ``configs/`` only fill values (``defaults: [base_ddp]``), so an unknown key or a
wrong type fails at compose time.  ``model`` and ``data`` are typed ``Any`` at the top level: they
are the plug-in points for the user's own ``_target_``; the built-in options still carry a schema.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING


def _h(text: str, default: Any = MISSING, factory: Any = None) -> Any:
    """A dataclass field with a one-line help text (shown by `disttrain config --help`)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": text})
    return field(default=default, metadata={"help": text})


# ----------------------------------------------------------------------------------------- backend
@dataclass
class BackendConfig:
    name: str = _h("process-group backend: auto (nccl with CUDA GPUs, else gloo), gloo or nccl", "auto")
    timeout: float = _h("seconds a collective may wait before the rank fails instead of hanging", 300.0)


# ---------------------------------------------------------------------------------------- strategy
@dataclass
class StrategyConfig:
    name: str = _h("how the model is parallelised", MISSING)


@dataclass
class SingleStrategyConfig(StrategyConfig):
    name: str = "single"


@dataclass
class DDPStrategyConfig(StrategyConfig):
    name: str = "ddp"
    bucket_cap_mb: float = _h("DDP gradient bucket size in MiB", 25.0)
    find_unused_parameters: bool = _h("tolerate parameters that get no gradient (slower)", False)
    static_graph: bool = _h("promise the graph is the same every step (enables optimisations)", False)
    gradient_as_bucket_view: bool = _h("let gradients alias the all-reduce buckets (saves memory)", False)
    comm_hook: str | None = _h("gradient compression hook: null, fp16 or bf16", None)


# --------------------------------------------------------------------------------------- model/data
@dataclass
class MLPConfig:
    _target_: str = "disttrain.models.mlp.MLP"
    in_features: int = _h("input width (from the data set)", II("data.num_features"))
    num_classes: int = _h("output width (from the data set)", II("data.num_classes"))
    hidden: list[int] = _h("hidden layer widths", factory=lambda: [128, 128])
    dropout: float = _h("dropout probability after each hidden layer", 0.0)
    activation: str = _h("relu, gelu or tanh", "relu")


@dataclass
class DataConfig:
    name: str = _h("data set name (for logs)", MISSING)
    task: str = _h("classification (CE, accuracy) or regression (MSE)", "classification")
    num_features: int = _h("input width the model sees", MISSING)
    num_classes: int = _h("number of classes (output width for regression)", MISSING)
    train: Any = _h("`_target_` spec that builds the training Dataset", MISSING)
    val: Any = _h("`_target_` spec that builds the validation Dataset (null: no validation)", None)
    num_workers: int = _h("DataLoader worker processes per rank", 0)
    pin_memory: bool = _h("pin host memory (useful with CUDA)", False)
    drop_last: bool = _h("drop the last incomplete batch of an epoch", True)
    shuffle: bool = _h("reshuffle the training set every epoch (seeded)", True)


@dataclass
class DigitsDataConfig(DataConfig):
    name: str = "digits"
    num_features: int = 64
    num_classes: int = 10
    train: Any = field(
        default_factory=lambda: {
            "_target_": "disttrain.data.digits.load_digits",
            "split": "train",
            "val_fraction": 0.2,
            "seed": 0,
        }
    )
    val: Any = field(
        default_factory=lambda: {
            "_target_": "disttrain.data.digits.load_digits",
            "split": "val",
            "val_fraction": 0.2,
            "seed": 0,
        }
    )


@dataclass
class SyntheticDataConfig(DataConfig):
    name: str = "synthetic"
    num_features: int = 32
    num_classes: int = 4
    num_samples: int = _h("training samples", 2048)
    num_val_samples: int = _h("validation samples", 512)
    noise: float = _h("std of the noise added around each class centre", 1.0)
    seed: int = _h("seed of the generated data (independent of the run seed)", 1234)
    train: Any = field(
        default_factory=lambda: {
            "_target_": "disttrain.data.synthetic.make_synthetic",
            "num_samples": II("data.num_samples"),
            "num_features": II("data.num_features"),
            "num_classes": II("data.num_classes"),
            "noise": II("data.noise"),
            "seed": II("data.seed"),
            "task": II("data.task"),
            "split": "train",
        }
    )
    val: Any = field(
        default_factory=lambda: {
            "_target_": "disttrain.data.synthetic.make_synthetic",
            "num_samples": II("data.num_val_samples"),
            "num_features": II("data.num_features"),
            "num_classes": II("data.num_classes"),
            "noise": II("data.noise"),
            "seed": II("data.seed"),
            "task": II("data.task"),
            "split": "val",
        }
    )


# -------------------------------------------------------------------------------------------- amp
@dataclass
class AmpConfig:
    name: str = _h("mixed precision: off", "off")
    dtype: str = _h("compute dtype under autocast", "float32")


# ---------------------------------------------------------------------------------------- optim
@dataclass
class OptimConfig:
    _target_: str = _h("optimizer class", MISSING)
    _partial_: bool = True
    lr: float = _h("base learning rate (before scale_lr)", 1e-3)
    weight_decay: float = _h("decoupled (AdamW) or L2 (SGD) weight decay", 0.0)
    scale_lr: str = _h("none, or linear: lr x world size (the linear scaling rule)", "none")


@dataclass
class AdamWConfig(OptimConfig):
    _target_: str = "torch.optim.AdamW"
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: list[float] = _h("Adam betas", factory=lambda: [0.9, 0.999])
    eps: float = 1e-8


@dataclass
class SGDConfig(OptimConfig):
    _target_: str = "torch.optim.SGD"
    lr: float = 0.05
    momentum: float = 0.9
    nesterov: bool = False


# ---------------------------------------------------------------------------------------- sched
@dataclass
class SchedConfig:
    name: str = _h("constant or cosine", MISSING)
    warmup_steps: int = _h("linear warm-up from 0 to the base lr over this many optimizer steps", 0)


@dataclass
class ConstantSchedConfig(SchedConfig):
    name: str = "constant"


@dataclass
class CosineSchedConfig(SchedConfig):
    name: str = "cosine"
    warmup_steps: int = 20
    min_lr_ratio: float = _h("final lr as a fraction of the base lr", 0.0)


# -------------------------------------------------------------------------------------- launcher
@dataclass
class LauncherConfig:
    name: str = _h("torchrun (torch.distributed.run / elastic) or spawn (torch.multiprocessing)", MISSING)
    max_restarts: int = _h("torchrun: restarts of the whole group after a rank fails", 0)
    monitor_interval: float = _h("torchrun: seconds between worker health checks", 0.1)
    rdzv_timeout: float = _h("seconds to wait for all nodes to join the rendezvous", 900.0)


@dataclass
class TorchrunLauncherConfig(LauncherConfig):
    name: str = "torchrun"


@dataclass
class SpawnLauncherConfig(LauncherConfig):
    name: str = "spawn"


# --------------------------------------------------------------------------------------- trainer
@dataclass
class TrainerConfig:
    max_epochs: int = _h("epochs to train when max_steps is -1", 10)
    max_steps: int = _h("optimizer steps to train (epochs continue as needed); -1: run max_epochs", -1)
    batch_size: int = _h("samples per rank per micro-step (global batch = this x world x grad_accum)", 32)
    grad_accum: int = _h("micro-steps per optimizer step; all-reduce only on the last", 1)
    clip_grad_norm: float | None = _h("clip the global gradient norm to this; null: no clipping", 1.0)
    log_every: int = _h("optimizer steps between train-metric logs", 10)
    val_every: int = _h("optimizer steps between validations; 0: at the end of each epoch", 0)
    ckpt_every: int = _h("optimizer steps between checkpoints; 0: only the final one", 0)
    progress: bool = _h("rich progress bar on rank 0", True)


@dataclass
class Config:
    backend: BackendConfig = MISSING
    strategy: StrategyConfig = MISSING
    model: Any = MISSING
    data: Any = MISSING
    amp: AmpConfig = MISSING
    optim: OptimConfig = MISSING
    sched: SchedConfig = MISSING
    launcher: LauncherConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    name: str = _h("run name (used in the run directory)", "default")
    nodes: int = _h("number of nodes (machines)", 1)
    nproc_per_node: int = _h("ranks per node (one per GPU; CPU: any)", 2)
    node_rank: int = _h("this node's rank, 0..nodes-1", 0)
    master_addr: str = _h("address of node 0 (multi-node)", "127.0.0.1")
    master_port: int = _h("rendezvous port on master_addr; 0: pick a free one (single node)", 0)
    seed: int = _h("global seed: model init is identical on every rank, data order too", 0)
    threads_per_rank: int | None = _h("intra-op threads per rank; null: cores / local ranks", None)


def register() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    groups: dict[str, dict[str, type]] = {
        "backend": {"base_backend": BackendConfig},
        "strategy": {"base_single": SingleStrategyConfig, "base_ddp": DDPStrategyConfig},
        "model": {"base_mlp": MLPConfig},
        "data": {"base_digits": DigitsDataConfig, "base_synthetic": SyntheticDataConfig},
        "amp": {"base_amp": AmpConfig},
        "optim": {"base_adamw": AdamWConfig, "base_sgd": SGDConfig},
        "sched": {"base_constant": ConstantSchedConfig, "base_cosine": CosineSchedConfig},
        "launcher": {"base_torchrun": TorchrunLauncherConfig, "base_spawn": SpawnLauncherConfig},
    }
    for group, nodes in groups.items():
        for name, node in nodes.items():
            cs.store(group=group, name=name, node=node)
