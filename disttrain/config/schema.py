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


@dataclass
class DPStrategyConfig(StrategyConfig):
    name: str = "dp"


@dataclass
class FSDPStrategyConfig(StrategyConfig):
    name: str = "fsdp"
    wrap_classes: list[str] = _h(
        "module class names that each get their own FSDP unit, e.g. [Linear]", factory=list
    )
    min_num_params: int = _h(
        "also wrap submodules holding >= this many not-yet-wrapped params; 0: off", 100_000
    )
    reshard_after_forward: bool = _h(
        "free gathered params after forward (less memory, one more all-gather)", True
    )
    cpu_offload: bool = _h("keep sharded params, grads and optimizer state in CPU memory", False)
    replicate: int = _h("HSDP: replicas R; mesh (R, world/R), sharded within a replica; 1: plain FSDP", 1)
    param_dtype: str = _h("dtype of gathered params for compute: float32, bfloat16, float16", II("amp.dtype"))
    reduce_dtype: str = _h("dtype of the gradient reduce-scatter: float32, bfloat16, float16", "float32")


@dataclass
class ZeroStrategyConfig(DDPStrategyConfig):
    name: str = "zero"
    parameters_as_bucket_view: bool = _h("ZeRO: pack params into contiguous buckets per rank", False)


@dataclass
class LocalSGDStrategyConfig(DDPStrategyConfig):
    name: str = "localsgd"
    sync_every: int = _h("average parameters across ranks every N optimizer steps (1: every step)", 4)
    warmup_steps: int = _h("plain DDP steps (gradients all-reduced) before local SGD starts", 0)


@dataclass
class PipelineStrategyConfig(StrategyConfig):
    name: str = "pipeline"
    schedule: str = _h("gpipe, 1f1b or interleaved_1f1b (needs stages_per_rank >= 2)", "1f1b")
    n_microbatches: int = _h("micro-batches each batch is cut into (must divide trainer.batch_size)", 4)
    stages_per_rank: int = _h("stages (virtual stages) per rank; >= 2 only with interleaved_1f1b", 1)
    split_points: list[str] | None = _h(
        "layer names that start a new stage, e.g. [layers.4]; null: an even split of the layers", None
    )


@dataclass
class TPStrategyConfig(StrategyConfig):
    name: str = "tp"


@dataclass
class FSDPTPStrategyConfig(StrategyConfig):
    name: str = "fsdp+tp"
    tp_degree: int = _h("ranks per tensor-parallel group (the fast, inner mesh dimension)", 2)
    dp_degree: int = _h("FSDP replicas (outer mesh dimension); -1: world size / tp_degree", -1)
    reshard_after_forward: bool = _h(
        "free gathered params after forward (less memory, one more all-gather)", True
    )


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


# ------------------------------------------------------------------------------------------ plan
@dataclass
class PlanConfig:
    """Read only by `disttrain plan` (training ignores it)."""

    gpu_mem_gb: float = _h("memory of one accelerator in GiB that the plan must fit", 80.0)
    usable_fraction: float = _h("share of gpu_mem_gb for params, grads, optimizer state, activations", 0.9)
    micro_batch: int | None = _h("samples per rank per micro-step; null: trainer.batch_size", None)
    activation_checkpointing: bool = _h(
        "transformers: keep only each layer's input, recompute the rest", False
    )


# ------------------------------------------------------------------------------------ checkpoint
def _keyword_field(name: str, type_name: str, default: Any, text: str) -> Any:
    """Add a field whose name is a Python keyword (`checkpoint.async`) to a dataclass.

    A normal dataclass cannot declare `async: bool`; the schema field is added after the class body
    and the dataclass gets no generated __init__/__repr__/__eq__ (they would spell `self.async`).
    OmegaConf reads only `fields()` and the defaults, so the key still fails on typos and wrong types.
    """

    def decorate(cls: Any) -> Any:
        cls.__annotations__[name] = type_name
        setattr(cls, name, _h(text, default))
        return dataclass(init=False, repr=False, eq=False)(cls)

    return decorate


@_keyword_field(
    "async", "bool", False, "save in a background thread (DCP async_save); training waits only to stage"
)
class CheckpointConfig:
    keep: int = _h("committed checkpoints to keep (the newest N; older ones are deleted)", 3)
    verify: str = _h("check at load: size (file sizes vs manifest) or hash (sizes + sha256)", "hash")
    on_signal: bool = _h("SIGTERM/SIGINT: every rank saves a checkpoint, then exits", True)
    on_error: bool = _h("an exception on every rank at the same step saves an emergency checkpoint", True)
    export_final: bool = _h("also write checkpoints/final.pt: the consolidated model for plain PyTorch", True)


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
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    name: str = _h("run name (used in the run directory)", "default")
    nodes: int = _h("number of nodes (machines)", 1)
    nproc_per_node: int = _h("ranks per node (one per GPU; CPU: any)", 2)
    node_rank: int = _h("this node's rank, 0..nodes-1", 0)
    master_addr: str = _h("address of node 0 (multi-node)", "127.0.0.1")
    master_port: int = _h("rendezvous port on master_addr; 0: pick a free one (single node)", 0)
    seed: int = _h("global seed: model init is identical on every rank, data order too", 0)
    threads_per_rank: int | None = _h("intra-op threads per rank; null: cores / local ranks", None)
    resume: str | None = _h(
        "auto (the run dir's latest checkpoint, if any), a checkpoint or run dir PATH, or null", "auto"
    )


def register() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    groups: dict[str, dict[str, type]] = {
        "backend": {"base_backend": BackendConfig},
        "strategy": {
            "base_single": SingleStrategyConfig,
            "base_ddp": DDPStrategyConfig,
            "base_dp": DPStrategyConfig,
            "base_fsdp": FSDPStrategyConfig,
            "base_zero": ZeroStrategyConfig,
            "base_localsgd": LocalSGDStrategyConfig,
            "base_pipeline": PipelineStrategyConfig,
            "base_tp": TPStrategyConfig,
            "base_fsdp+tp": FSDPTPStrategyConfig,
        },
        "model": {"base_mlp": MLPConfig},
        "data": {"base_digits": DigitsDataConfig, "base_synthetic": SyntheticDataConfig},
        "amp": {"base_amp": AmpConfig},
        "optim": {"base_adamw": AdamWConfig, "base_sgd": SGDConfig},
        "sched": {"base_constant": ConstantSchedConfig, "base_cosine": CosineSchedConfig},
        "launcher": {"base_torchrun": TorchrunLauncherConfig, "base_spawn": SpawnLauncherConfig},
        "checkpoint": {"base_checkpoint": CheckpointConfig},
    }
    for group, nodes in groups.items():
        for name, node in nodes.items():
            cs.store(group=group, name=name, node=node)
