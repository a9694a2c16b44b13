"""Dataclass schemas for every config group, registered in Hydra's ConfigStore.

YAML files under the top-level ``configs/`` (``disttrain/configs/`` in the wheel) only fill values
(``defaults: [base_ddp]``), so an unknown key or a wrong type fails at compose time.  ``model`` and
``data`` are typed ``Any`` at the top level: they are the plug-in points for the user's own
``_target_``; the built-in options still carry a schema.
The plug-ins' dataclasses live with their specs, beside their code (``disttrain/strategies/specs/``,
``disttrain/launch/specs/``, ``disttrain/tasks/specs.py``, ``disttrain/models/specs.py``,
``disttrain/data/specs.py``): ``register()`` stores one ``base_<name>`` node per registered spec.
This module keeps the bases they extend (``LauncherConfig``, ``TaskConfig``, ``DataConfig``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING as MISSING_FIELD
from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import II, MISSING, DictConfig

from disttrain.config.common import Block, Choice, ComputeDtype, Keyed, Switch
from disttrain.config.common import help_field as _h
from disttrain.config.errors import ConfigError, one_of
from disttrain.config.names import NO_DECAY as NO_DECAY  # optim.param_groups (the engine imports names)
from disttrain.config.names import NO_DECAY_1D as NO_DECAY_1D
from disttrain.config.registry import Registry, config_nodes
from disttrain.config.typed import check_at_least
from disttrain.strategies.specs import STRATEGIES, StrategyConfig


# ------------------------------------------------------------------------------------ closed choices
class BackendName(Choice):
    auto = "auto"
    gloo = "gloo"
    nccl = "nccl"


class Targets(Choice):
    classes = "classes"
    values = "values"


class Shard(Choice):
    none = "none"
    auto = "auto"


class ScaleLr(Choice):
    none = "none"
    linear = "linear"


class AnomalyMode(Choice):
    off = "off"
    stop = "stop"
    skip = "skip"


class OomMode(Choice):
    off = "off"
    auto_microbatch = "auto_microbatch"


class CompileMode(Switch):
    false = "false"
    true = "true"
    regional = "regional"


class CheckpointMode(Switch):
    false = "false"
    full = "full"
    selective = "selective"
    true = "full"  # an alias: `true` meant per-block recompute before `selective` existed


class Mode(Choice):
    min = "min"
    max = "max"


class Verify(Choice):
    size = "size"
    hash = "hash"


class PeftName(Choice):
    none = "none"
    lora = "lora"


class Fp8Recipe(Choice):
    """torchao's float8 recipes (Float8LinearConfig.from_recipe_name)."""

    tensorwise = "tensorwise"
    rowwise = "rowwise"


# ----------------------------------------------------------------------------------------- backend
@dataclass
class BackendConfig(Block):
    name: BackendName = _h(
        "process-group backend: auto (nccl with CUDA GPUs, else gloo), gloo or nccl", BackendName.auto
    )
    timeout: float = _h("seconds a collective may wait before its rank fails (no hang)", 300.0, at_least=1)


# ------------------------------------------------------------------------------------------- data
@dataclass
class DataConfig(Block):
    name: str = _h("data set name (for logs)", MISSING)
    targets: Targets = _h(
        "what built-in data sets make as targets: classes (int64 labels) or values (float); "
        "set by the task group",
        Targets.classes,
    )
    num_features: int | None = _h("input width the model sees", MISSING)
    num_classes: int | None = _h("number of classes (output width for regression)", MISSING)
    train: Any = _h("`_target_` spec that builds the training Dataset", MISSING)
    val: Any = _h("`_target_` spec that builds the validation Dataset (null: no validation)", None)
    num_workers: int = _h("DataLoader worker processes per rank", 0, at_least=0)
    pin_memory: bool = _h("pin host memory (useful with CUDA)", False)
    persistent_workers: bool = _h("keep DataLoader workers alive between epochs (num_workers > 0)", True)
    prefetch_factor: int | None = _h("batches each worker loads ahead (num_workers > 0); null: 2", None)
    drop_last: bool = _h("drop the last incomplete batch of an epoch", True)
    shuffle: bool = _h("reshuffle the training set every epoch (seeded)", True)
    shard: Shard = _h(
        "a stream (IterableDataset): none (it gives each rank and worker its own part itself) or auto "
        "(disttrain splits it: element i to the reader with i % (replicas x workers) == its slot); "
        "map-style data is always split by the sampler",
        Shard.none,
    )
    stateful: bool = _h(
        "a stream's position goes into each checkpoint (torchdata StatefulDataLoader, per rank and "
        "worker): a resume continues with the next batch; false: a resumed stream starts over",
        True,
    )

    def __post_init__(self) -> None:
        self.targets = Targets.of("data.targets", self.targets)
        self.shard = Shard.of("data.shard", self.shard)
        check_at_least(self, "data")
        # torch rejects prefetch_factor without workers at the first batch: say it now
        if self.prefetch_factor is not None and (self.num_workers == 0 or self.prefetch_factor < 1):
            raise ConfigError(
                "data.prefetch_factor",
                self.prefetch_factor,
                "null, or >= 1 with data.num_workers > 0",
                "prefetching needs worker processes: set data.num_workers=2, or leave prefetch_factor null.",
            )

    @property
    def rows(self) -> tuple[str, Any] | None:
        """The key that packs documents into rows (data/packing.py) and its value; None: none does."""
        return None

    def check_run(self, run: Any) -> None:
        """The option's keys against the rest of the run, before launch: rows of documents carry
        position_ids, which a strategy whose stages pass one tensor cannot take."""
        if self.rows is not None and STRATEGIES.get(run.strategy.name).one_tensor_batches:
            raise ConfigError(
                *self.rows,
                f"false under strategy={run.strategy.name} (its stages pass one tensor: no position_ids "
                "reach them)",
                "use fsdp, ddp or tp with packed rows, or data.packing=false.",
            )


@dataclass
class Data(DataConfig, Keyed):
    """`run.data`, typed: DataConfig's keys (the loaders read them; their defaults where a node
    lacks one, None for a required one); `option`: the built-in (or registered) data option's own
    config, chosen by `name` (data/specs.py: its keys typed and checked beside their fields), None
    for data of yours; `kwargs`: the option's own keys as written (what its train and val nodes
    interpolate)."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    option: DataConfig | None = None

    @classmethod
    def of(cls, node: Mapping[str, Any] | Data, **given: Any) -> Data:
        from disttrain.data.specs import option_of

        return node if isinstance(node, Data) else super().of(node, option=option_of(node), **given)


# ------------------------------------------------------------------------------------------- task
@dataclass
class TaskConfig(Block):
    _target_: str = _h("a disttrain.tasks.Task subclass, or a function step(model, batch) -> loss", MISSING)


@dataclass
class TaskTarget(Keyed):
    """`run.task`, typed: its `target` (a Task subclass or a step function) and the target's own `kwargs`."""

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, node: Any, **given: Any) -> TaskTarget:
        if not isinstance(node, TaskTarget) and (not isinstance(node, Mapping) or not node.get("_target_")):
            raise ConfigError(
                "task",
                node,
                "a node with _target_: task=classification, regression, lm, model_loss, or your own",
                "e.g. task=model_loss 'task.call={idx: x, targets: y}', or task._target_=mylab.MyTask.",
            )
        return super().of(node, **given)


# -------------------------------------------------------------------------------------------- amp
@dataclass
class AmpConfig(Block):
    name: str = _h(
        "mixed precision: off, bf16, fp16 (dynamic loss scaling) or fp8 (torchao float8 Linear layers, "
        "bf16 for the rest)",
        "off",
    )
    dtype: ComputeDtype = _h(
        "compute dtype under autocast: float32, bfloat16 or float16", ComputeDtype.float32
    )
    init_scale: float = _h("fp16: initial loss scale", 65536.0, at_least=1)
    growth_interval: int = _h("fp16: steps without overflow before the scale doubles", 2000, at_least=1)
    tf32: bool = _h(
        "CUDA: fp32 matmuls (amp=off, and fp32 ops under autocast) on TF32 tensor cores "
        "(torch.set_float32_matmul_precision('high'); Ampere and newer); false: full fp32",
        True,
    )
    bf16_emulation: bool = _h(
        "amp=bf16 on a GPU without bf16 tensor cores (before Ampere: V100, T4) runs emulated and "
        "slowly: refused unless true (then a warning)",
        False,
    )
    fp8_recipe: Fp8Recipe = _h(
        "amp=fp8: tensorwise (one scale per tensor; float8 all-gather under fsdp/hsdp/zero2) or rowwise "
        "(one scale per row, power-of-2 scales)",
        Fp8Recipe.tensorwise,
    )
    fp8_emulate: bool = _h(
        "amp=fp8 without float8 hardware (CPU, GPUs before compute capability 8.9): torchao's emulated "
        "float8 matmuls, a numerics check, slower than bf16",
        False,
    )
    master_dtype: ComputeDtype = _h(
        "dtype of the trained parameters, and so of the optimizer state and the EMA: a model that "
        "arrives in another one (a bf16 Hugging Face checkpoint) is cast to it after it is built, "
        "before sharding, and the log says so; float32 (master weights), bfloat16 or float16",
        ComputeDtype.float32,
    )


# ------------------------------------------------------------------------------------------- peft
@dataclass
class PeftConfig(Block):
    name: PeftName = _h(
        "parameter-efficient fine-tuning: none (every parameter trains) or lora (Hugging Face PEFT's LoRA "
        "adapters; only they train, have optimizer state and go into checkpoints)",
        PeftName.none,
    )
    rank: int = _h("lora: the adapters' rank r", 8)
    alpha: int = _h("lora: scaling; an adapter's update is scaled by alpha / rank", 16)
    dropout: float = _h("lora: dropout on each adapter's input", 0.0)
    target_modules: list[str] | None = _h(
        "lora: names (or dotted suffixes) of the modules that get adapters; null: GPT-2 c_attn, c_proj, "
        "c_fc; Llama q/k/v/o/gate/up/down_proj; the built-in gpt's linears; else every nn.Linear in the "
        "model's repeated blocks",
        None,
    )


# ---------------------------------------------------------------------------------------- optim
@dataclass
class OptimConfig(Block):
    """Keys disttrain reads itself; a swapped `optim._target_` starts from these (see config/clean.py)."""

    _target_: str = _h("optimizer class", MISSING)
    _partial_: bool = True
    lr: float = _h("base learning rate (before scale_lr)", 1e-3)
    weight_decay: float = _h("decoupled (AdamW) or L2 (SGD) weight decay", 0.0)
    scale_lr: ScaleLr = _h("none, or linear: lr x world size (the linear scaling rule)", ScaleLr.none)
    param_groups: Any = _h(
        "null: one group; no_decay_1d: weight decay on every >=2-D parameter, embeddings included "
        "(nanoGPT's configure_optimizers); no_decay_bias_norm_embed: on >=2-D parameters that are not "
        "nn.Embedding weights (minGPT-style: embeddings and a head tied to one exempt); or a `_target_` "
        "factory called with the model that returns torch param groups",
        None,
    )
    fused: Any = _h(
        "auto: the optimizer's fused kernels when every parameter is a floating CUDA tensor, its class "
        "takes `fused` (AdamW, Adam, SGD) and optim.foreach is unset; true or false: as set",
        "auto",
    )


@dataclass
class Optim(Keyed):
    """`run.optim`, typed: the keys disttrain reads (OptimConfig's, its defaults where a swapped
    `_target_` or an older run dir lacks one) and checks here; `kwargs`: the optimizer class's own
    other arguments (betas, momentum, foreach, ...)."""

    target: str
    lr: float = OptimConfig.lr
    weight_decay: float = OptimConfig.weight_decay
    scale_lr: ScaleLr = OptimConfig.scale_lr
    param_groups: Any = OptimConfig.param_groups
    fused: Any = OptimConfig.fused
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.lr, int | float) or self.lr <= 0:
            raise ConfigError("optim.lr", self.lr, "a number > 0", "e.g. optim.lr=3e-4.")
        self.lr = float(self.lr)
        self.scale_lr = ScaleLr.of("optim.scale_lr", self.scale_lr)
        if self.fused != "auto" and not isinstance(self.fused, bool):  # 1 == True: no `in` test
            raise ConfigError(
                "optim.fused",
                self.fused,
                "auto, true or false",
                "auto uses the optimizer's fused kernels when every parameter is on CUDA.",
            )
        groups = self.param_groups
        if groups not in (None, NO_DECAY, NO_DECAY_1D) and not (
            isinstance(groups, dict) and "_target_" in groups
        ):
            raise ConfigError(
                "optim.param_groups",
                groups,
                f"null (one group), {NO_DECAY_1D}, {NO_DECAY}, or a node with _target_ (a factory called "
                "with the model)",
                f"optim.param_groups={NO_DECAY_1D} exempts biases and norms from weight decay (nanoGPT), "
                f"{NO_DECAY} embeddings too; "
                "optim.param_groups._target_=mylab.groups calls your function with the model.",
            )


@dataclass
class AdamWConfig(OptimConfig):
    _target_: str = "torch.optim.AdamW"
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: list[float] = _h("Adam betas", factory=lambda: [0.9, 0.999])
    eps: float = _h("added to the denominator for numerical stability", 1e-8)


@dataclass
class SGDConfig(OptimConfig):
    _target_: str = "torch.optim.SGD"
    lr: float = 0.05
    momentum: float = _h("momentum factor (0: plain SGD)", 0.9)
    nesterov: bool = _h("Nesterov momentum", False)


# ---------------------------------------------------------------------------------------- sched
@dataclass
class SchedConfig(Block):
    name: str = _h("constant or cosine", MISSING)
    warmup_steps: int = _h("linear warm-up from 0 to the base lr over this many optimizer steps", 0)


@dataclass
class TargetSchedConfig(Block):
    """Any torch.optim.lr_scheduler class (or your own): built with the optimizer, stepped once per
    optimizer step. A swapped `sched._target_` starts from these keys."""

    _target_: str = _h("scheduler class, e.g. torch.optim.lr_scheduler.StepLR", MISSING)
    _partial_: bool = True


@dataclass
class OneCycleSchedConfig(TargetSchedConfig):
    _target_: str = "torch.optim.lr_scheduler.OneCycleLR"
    max_lr: float = _h("peak lr of the cycle", II("optim.lr"))
    pct_start: float = _h("share of the steps spent increasing the lr", 0.3)
    anneal_strategy: str = _h("cos or linear", "cos")
    div_factor: float = _h("initial lr = max_lr / div_factor", 25.0)
    final_div_factor: float = _h("final lr = initial lr / final_div_factor", 1e4)
    three_phase: bool = _h("a third phase annihilates the lr", False)
    cycle_momentum: bool = _h("cycle momentum (beta1) inversely to the lr", True)


@dataclass
class ConstantSchedConfig(SchedConfig):
    name: str = "constant"


@dataclass
class CosineSchedConfig(SchedConfig):
    name: str = "cosine"
    warmup_steps: int = 20
    min_lr_ratio: float = _h("final lr as a fraction of the base lr", 0.0)


SCHEDULES = ("constant", "cosine")  # the built-in schedules (sched.name)


@dataclass
class Sched(Keyed):
    """`run.sched`, typed: a built-in schedule (`name`, `warmup_steps`, `min_lr_ratio`: SchedConfig's
    and CosineSchedConfig's keys, their defaults where a node lacks one), checked here; or a
    `target` scheduler class with its own `kwargs` (checked when it is built)."""

    name: str | None = None
    warmup_steps: int = SchedConfig.warmup_steps
    min_lr_ratio: float = CosineSchedConfig.min_lr_ratio
    target: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, node: Mapping[str, Any] | Sched, **given: Any) -> Sched:
        if isinstance(node, Mapping) and "_target_" in node:  # every other key is the class's argument
            given = {k: getattr(cls, k) for k in ("warmup_steps", "min_lr_ratio")} | given
        return super().of(node, **given)

    def __post_init__(self) -> None:
        if self.target is not None:
            return
        if self.name not in SCHEDULES:
            raise ConfigError(
                "sched.name",
                self.name,
                one_of(SCHEDULES),
                "cosine decays to min_lr_ratio x lr after warm-up.",
            )
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError("sched.warmup_steps", self.warmup_steps, "a number >= 0", "0 disables warm-up.")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(
                "sched.min_lr_ratio", self.min_lr_ratio, "0..1", "0 decays to zero; 0.1 keeps 10% of lr."
            )


# -------------------------------------------------------------------------------------- launcher
@dataclass
class LauncherConfig(Block):
    name: str = _h(
        "the launcher's registered name: torchrun, spawn, slurm, k8s, or one a package registers "
        "(disttrain.launch.specs)",
        MISSING,
    )
    max_restarts: int = _h("torchrun: restarts of the whole group after a rank fails", 0, at_least=0)
    monitor_interval: float = _h("torchrun: seconds between worker health checks", 0.1)
    rdzv_timeout: float = _h("seconds to wait for all nodes to join the rendezvous", 900.0)
    min_nodes: int = _h("elastic: train once this many of `nodes` have joined; 0: all of them", 0)
    rdzv_last_call: float = _h(
        "elastic: once min_nodes have joined, seconds to wait for more (torchrun)", 30.0
    )
    stop_grace_s: float = _h(
        "SIGTERM/SIGINT: seconds the ranks get to finish the step and save before SIGKILL (torchrun)",
        120.0,
    )


# --------------------------------------------------------------------------------------- trainer
@dataclass
class EarlyStopConfig(Block):
    monitor: str = _h("the validation metric watched (val/loss, val/acc, val/ppl, ...)", "val/loss")
    mode: Mode = _h("min: lower is better (a loss); max: higher is better (accuracy)", Mode.min)
    patience: int = _h(
        "stop after this many validations in a row without improvement (all ranks agree: the "
        "metric is reduced across ranks); 0: never stop early",
        0,
        at_least=0,
    )
    min_delta: float = _h("an improvement must beat this (absolute, in the metric's units)", 0.0, at_least=0)


@dataclass
class EmaConfig(Block):
    decay: float | None = _h(
        "exponential moving average of the weights: ema = decay x ema + (1 - decay) x weights after an "
        "update (0.999 is common); null or 0: off. Sharded like the parameters, checkpointed, "
        "validated as val_ema/*, exported with `disttrain export --ema`",
        None,
    )
    every: int = _h("update the EMA every N optimizer steps", 1, at_least=1)
    start_step: int = _h(
        "first optimizer step that updates the EMA (the first update copies the weights)", 0, at_least=0
    )

    def __post_init__(self) -> None:
        if self.decay and not 0 < self.decay < 1:
            raise ConfigError(
                "trainer.ema.decay", self.decay, "null or 0 (off), or between 0 and 1", "0.999 is common."
            )


@dataclass
class TrainerConfig(Block):
    max_epochs: int = _h("epochs to train when max_steps is -1", 10)
    max_steps: int = _h("optimizer steps to train (epochs continue as needed); -1: run max_epochs", -1)
    batch_size: int = _h(
        "samples per rank per micro-step (global batch = this x world x grad_accum)", 32, at_least=1
    )
    grad_accum: int = _h("micro-steps per optimizer step; all-reduce only on the last", 1, at_least=1)
    clip_grad_norm: float | None = _h("clip the global gradient norm to this; null: no clipping", 1.0)
    log_every: int = _h("optimizer steps between train-metric logs", 10, at_least=1)
    val_every: int = _h("optimizer steps between validations; 0: at the end of each epoch", 0, at_least=0)
    ckpt_every: int = _h("optimizer steps between checkpoints; 0: only the final one", 0, at_least=0)
    val_batches: int | None = _h(
        "validation batches per rank (required for a stream validation set); null: the whole set",
        None,
        at_least=1,
    )
    progress: bool = _h(
        "rich progress bar on rank 0 when stderr is a terminal (plain lines every log_every otherwise)", True
    )
    activation_checkpointing: Any = _h(  # bool | str: see Switch
        "recompute the repeated blocks' activations in backward (any model: the blocks FSDP wraps): "
        "full keeps each block's input only, selective also its matmul and attention outputs; "
        "true is full",
        False,
        choices=CheckpointMode,
    )
    compile: Any = _h(  # bool | str: see Switch
        "torch.compile: true the whole model (after the strategy wraps it), regional each repeated "
        "block before (one graph per block class, far less compile time); inductor needs a host C "
        "compiler, e.g. gcc (slim CUDA images without one fail at the first compiled step)",
        False,
        choices=CompileMode,
    )
    compile_backend: str = _h(
        "torch.compile's backend: inductor (generated kernels), aot_eager (traced, no code "
        "generation: isolates an inductor problem), cudagraphs, ...",
        "inductor",
    )
    detect_anomaly: AnomalyMode = _h(
        "non-finite loss/grad norm: off, stop (fail naming step and rank) or skip", AnomalyMode.off
    )
    oom: OomMode = _h(
        "out-of-memory in a step: off (fail) or auto_microbatch (halve micro-batch, same math; "
        "strategy=single or dp only)",
        OomMode.off,
    )
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    val_at_start: bool = _h(
        "validate once before the first step (step 0): the loss the run starts from, e.g. after "
        "init.path (early_stop counts it like any validation)",
        False,
    )
    ema: EmaConfig = _h(
        "exponential moving average of the weights (off unless ema.decay is set)", factory=EmaConfig
    )
    count_flops: bool | None = _h(
        "count a model's FLOPs on the first step (FlopCounterMode) for tflops and mfu; null: only "
        "where the device's peak is known (MFU; a CPU has none), true: always (TFLOP/s on CPU too); "
        "counting imports torch's tracing machinery in each rank (~0.4 CPU-s once)",
        None,
    )

    def __post_init__(self) -> None:
        # YAML's booleans (the fields' old type) and the members' names: a closed choice from here on
        self.compile = CompileMode.of("trainer.compile", self.compile)
        self.activation_checkpointing = CheckpointMode.of(
            "trainer.activation_checkpointing", self.activation_checkpointing
        )
        if self.max_steps == 0 or self.max_steps < -1:
            raise ConfigError(
                "trainer.max_steps", self.max_steps, "-1 (use max_epochs) or >= 1", "e.g. 1000."
            )
        if self.max_steps == -1 and self.max_epochs < 1:
            hint = "train at least one epoch, or set trainer.max_steps."
            raise ConfigError("trainer.max_epochs", self.max_epochs, "a number >= 1", hint)
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise ConfigError(
                "trainer.clip_grad_norm",
                self.clip_grad_norm,
                "null (no clipping) or > 0",
                "1.0 is a common value.",
            )


# ------------------------------------------------------------------------------------------ init
@dataclass
class InitConfig(Block):
    path: str | None = _h(
        "start from these weights (the model's only: optimizer, schedule and step start fresh): a "
        ".safetensors or .pt file (disttrain export, checkpoints/final.pt), a Hugging Face model folder, "
        "or a checkpoint (step_N/, a checkpoints/ or run dir: its newest); null: the model's own init",
        None,
    )
    strict: bool = _h(
        "every model key must be in init.path with its shape, and every key there used; false: "
        "load what matches and log the rest",
        True,
    )
    prefix: str = _h(
        "a prefix the source's keys carry and the model's lack, stripped (e.g. 'module.'); "
        "'+P' adds P to the source's keys instead",
        "",
    )
    map: dict[str, str] = _h(
        "renamed keys, source key -> model key (after prefix; a key ending in '.' renames that prefix)",
        factory=dict,
    )


# ------------------------------------------------------------------------------------- debug/prof
@dataclass
class DebugConfig(Block):
    check_sync_every: int = _h("every N steps compare parameter checksums of replicas; 0: off", 0, at_least=0)
    log_grad_stats: bool = _h("log per-parameter gradient norms (grad_norm/NAME) at log steps", False)


@dataclass
class ProfilerConfig(Block):
    wait: int = _h("profile=true: steps skipped before the window", 1, at_least=0)
    warmup: int = _h("profile=true: steps traced but discarded (profiler warm-up)", 1, at_least=0)
    active: int = _h("profile=true: steps recorded into the trace", 3, at_least=1)


# --------------------------------------------------------------------------------------- observe
@dataclass
class ObserveConfig(Block):
    sinks: list[Any] = _h(
        "metric sinks besides metrics.jsonl: names (tensorboard, csv, mlflow, wandb) or {_target_: ...} "
        "dicts with the sink's arguments, e.g. [tensorboard,{_target_:mlflow,tracking_uri:'file:///tmp/ml'}]",
        factory=lambda: ["tensorboard"],
    )


# ------------------------------------------------------------------------------------------ plan
@dataclass
class PlanConfig(Block):
    """Read only by `disttrain plan` (training ignores it)."""

    gpu_mem_gb: float = _h("memory of one accelerator in GiB that the plan must fit", 80.0)
    usable_fraction: float = _h("share of gpu_mem_gb for params, grads, optimizer state, activations", 0.9)
    micro_batch: int | None = _h("samples per rank per micro-step; null: trainer.batch_size", None)
    activation_checkpointing: bool = _h(
        "transformers: keep only each layer's input, recompute the rest", False
    )


# ----------------------------------------------------------------------------------------- sweep
@dataclass
class SweepConfig(Block):
    """Read by `disttrain train -m` (one value per sweep: every job of a sweep shares it)."""

    max_parallel: int = _h(
        "jobs of a sweep that run at once on a scheduler (launcher=slurm: the job array's % limit; "
        "launcher=k8s: Jobs alive at once); 0: no limit. Local sweeps run one job at a time",
        0,
        at_least=0,
    )
    stop_on_failure: bool = _h(
        "a local sweep stops at the first failed job; false: every job runs, then a table of their states",
        False,
    )


# ------------------------------------------------------------------------------------ checkpoint
def _keyword_field(name: str, type_name: str, default: Any, text: str) -> Any:
    """Add a field whose name is a Python keyword (`checkpoint.async`) to a dataclass.

    A normal dataclass cannot declare `async: bool`; the schema field is added after the class body
    and the dataclass gets a keyword-only __init__ of its own (a generated one would spell `self.async`).
    OmegaConf reads only `fields()` and the defaults, so the key still fails on typos and wrong types.
    """

    def decorate(cls: Any) -> Any:
        cls.__annotations__[name] = type_name
        setattr(cls, name, _h(text, default))
        cls = dataclass(init=False, repr=False, eq=False)(cls)

        def __init__(self: Any, **values: Any) -> None:
            for f in fields(cls):
                if f.name in values:
                    setattr(self, f.name, values.pop(f.name))
                elif f.default_factory is not MISSING_FIELD:
                    setattr(self, f.name, f.default_factory())
                else:
                    setattr(self, f.name, f.default)
            if values:
                raise TypeError(f"{cls.__name__}: unexpected fields {sorted(values)}")
            if hasattr(self, "__post_init__"):
                self.__post_init__()

        cls.__init__ = __init__
        return cls

    return decorate


@_keyword_field(
    "async", "bool", False, "save in a background thread (DCP async_save); training waits only to stage"
)
class CheckpointConfig(Block):
    dir: str | None = _h(
        "where checkpoints go; null: <run dir>/checkpoints. With several nodes every node must see "
        "it (a shared file system): checked before training",
        None,
    )
    keep: int = _h("committed checkpoints to keep (the newest N; older ones are deleted)", 3, at_least=1)
    verify: Verify = _h(
        "check at load: size (file sizes vs manifest) or hash (+ xxh3_64 of every byte)", Verify.hash
    )
    on_signal: bool = _h("SIGTERM/SIGINT: every rank saves a checkpoint, then exits", True)
    on_error: bool = _h("an exception on every rank at the same step saves an emergency checkpoint", True)
    export_final: bool = _h(
        'also write checkpoints/final.pt, {"model": state_dict, "step", "epoch"}: the consolidated '
        'model for plain PyTorch, torch.load(path, weights_only=True)["model"]',
        True,
    )
    keep_best: int = _h(
        "also keep the K best checkpoints by checkpoint.monitor, saved at the validations that rank "
        "among them and never pruned by `keep` while they do; checkpoints/best names the best. 0: off",
        0,
        at_least=0,
    )
    monitor: str | None = _h(
        "the validation metric keep_best ranks by; null: trainer.early_stop.monitor", None
    )
    mode: Mode | None = _h("min or max for checkpoint.monitor; null: trainer.early_stop.mode", None)

    def __post_init__(self) -> None:
        if self.dir is not None and not str(self.dir).strip():
            raise ConfigError(
                "checkpoint.dir",
                self.dir,
                "null (<run dir>/checkpoints), a path, or an object-store URL (s3://BUCKET/KEY, gs://BUCKET/KEY)",
                "give the folder (or bucket prefix) that checkpoints go to, or leave it null.",
            )


@dataclass
class Config:
    backend: BackendConfig = MISSING
    strategy: StrategyConfig = MISSING
    model: Any = MISSING
    data: Any = MISSING
    task: Any = _h(
        "batch -> loss and metrics: classification, regression, lm, model_loss, or your _target_", MISSING
    )
    amp: AmpConfig = MISSING
    peft: PeftConfig = field(default_factory=PeftConfig)
    optim: Any = MISSING  # the options carry their schema; Any lets a swapped `_target_` start clean
    sched: Any = MISSING
    launcher: LauncherConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    init: InitConfig = field(default_factory=InitConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)
    profiler: ProfilerConfig = field(default_factory=ProfilerConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    profile: bool = _h("record a torch.profiler window into RUN_DIR/profile (TensorBoard traces)", False)
    name: str = _h("run name (used in the run directory)", "default")
    nodes: Any = _h(
        'number of nodes (machines); MIN:MAX for elastic membership (nodes=1:2; in YAML quote it: "1:2")', 1
    )
    nproc_per_node: Any = _h(
        "ranks per node: auto (one per visible GPU when the backend resolves to nccl, else 2) or a number",
        "auto",
    )
    node_rank: int = _h("this node's rank, 0..nodes-1", 0)
    master_addr: str = _h("address of node 0 (multi-node)", "127.0.0.1")
    master_port: int = _h("rendezvous port on master_addr; 0: pick a free one (single node)", 0)
    seed: int = _h("global seed: model init is identical on every rank, data order too", 0)
    threads_per_rank: int | None = _h("intra-op threads per rank; null: cores / local ranks", None)
    resume: str | None = _h(
        "auto (the run dir's latest checkpoint, if any), a checkpoint or run dir PATH, or null", "auto"
    )
    storage_options: Any = _h(
        "options of the object stores that s3:// and gs:// paths name, by protocol: {s3: {endpoint_url: URL, "
        "profile: NAME}, gs: {project: P}} (fsspec's s3fs/gcsfs options); empty: the standard environment "
        "(AWS_ENDPOINT_URL, AWS_PROFILE, ~/.aws, GOOGLE_APPLICATION_CREDENTIALS)",
        factory=dict,
    )


_REGISTERED: list[Any] = []  # what the ConfigStore holds: [key of the registries' contents]


def register() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent). Every composition calls it, and
    storing costs about a quarter of a composition: done again only when a registry (strategies,
    launchers, tasks, models, data) changed since (the ConfigStore hands out copies, so its nodes
    stay as stored). The plug-in groups hold one `base_<name>` per registered spec."""
    from hydra.core.config_store import ConfigStore  # ranks read the dataclasses only

    cs = ConfigStore.instance()
    plugins = {group: config_nodes(registry) for group, registry in plugin_registries().items()}
    key = (id(cs.repo), tuple((g, tuple(n.items())) for g, n in plugins.items()))
    if _REGISTERED and _REGISTERED[0] == key:
        return
    cs.store(name="base_config", node=Config)
    groups: dict[str, dict[str, type]] = {
        "backend": {"base_backend": BackendConfig},
        **plugins,  # strategy, launcher, task, model, data: one `base_<name>` per registered spec
        "amp": {"base_amp": AmpConfig},
        "peft": {"base_peft": PeftConfig},
        "optim": {"base_adamw": AdamWConfig, "base_sgd": SGDConfig},
        "sched": {
            "base_constant": ConstantSchedConfig,
            "base_cosine": CosineSchedConfig,
            "base_onecycle": OneCycleSchedConfig,
        },
        "checkpoint": {"base_checkpoint": CheckpointConfig},
    }
    for group, nodes in groups.items():
        for name, node in nodes.items():
            cs.store(group=group, name=name, node=_open(group, node))
    _REGISTERED[:] = [key]


def plugin_registries() -> dict[str, Registry[Any]]:
    """Config group -> the registry of its plug-ins (each spec's module is imported lazily: the
    launchers', tasks', models' and data's spec modules are torch-free, as the strategies' are)."""
    from disttrain.data.specs import DATA
    from disttrain.launch.specs import LAUNCHERS
    from disttrain.models.specs import MODELS
    from disttrain.tasks.specs import TASKS

    return {"strategy": STRATEGIES, "model": MODELS, "data": DATA, "task": TASKS, "launcher": LAUNCHERS}


# Groups whose node (or, for data, whose train/val nodes) is a `_target_` plug-in point.
OPEN_GROUPS = ("model", "optim", "sched", "task")
OPEN_DATA_NODES = ("train", "val", "map", "mix")  # map, mix: data=hf's function, data=mix's sources


def _open(group: str, node: type) -> Any:
    """`_target_` nodes are open: a key the built-in option lacks may be set without `+` (from the
    command line or a YAML), so swapping `_target_` needs no gymnastics. Declared fields keep their
    types; config/clean.py then checks the keys or, for a swapped `_target_`, starts a clean node."""
    from omegaconf import OmegaConf

    if group not in (*OPEN_GROUPS, "data"):
        return node
    cfg = OmegaConf.structured(node)
    if group == "data":
        for key in OPEN_DATA_NODES:
            if isinstance(cfg.get(key), DictConfig):
                OmegaConf.set_struct(cfg[key], False)
    else:
        OmegaConf.set_struct(cfg, False)
    return cfg
