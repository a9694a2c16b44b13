"""Every `disttrain` command line of README.md and docs/*.md runs as written (issue 26 item 7).

The commands are read from the docs themselves: each line of a fenced code block that runs
`disttrain <command>` (continuation lines joined), and each inline code span that does so with at
least one argument. The files the docs tell the user to create (code blocks headed `# path`:
`mylab/data.py`, `mylab/tasks.py`, `hfmodels.py`, `conf/model/*.yaml`, ...) are written from the docs
too, so a doc edit that breaks a recipe breaks this test; the test writes no code of its own. `PLAN` says how each command runs; a
command in the docs that is not in `PLAN`, or a `PLAN` entry no longer in the docs, fails
`test_every_doc_command_is_planned`, and the counts are asserted.

How a command runs (the CI budget: ~60 CPU-s for the whole file, each separate `disttrain train`
process costs ~4):
- `Run`: `disttrain ARGS` in this process (tests/shared_support.py), its placeholders replaced
  (`SUBS`: run dirs, hosts, paths) and shortened only by appended overrides: `trainer.max_steps`,
  and `nproc_per_node=1` where the line's point is not the ranks (a world of one trains in the
  CLI's own process; the entry says `one=True`). Outcome: the exit code (0, or the error exit the
  doc documents) and, where the doc claims something checkable, that claim.
- `Job`: a job of ONE `disttrain train -m` sweep (tests/integration/sweep.py), as 2 real gloo ranks:
  the lines whose point is the 2-rank run (and the run dir the resume/eval/export lines read).
- `Check`: the config composition and every pre-launch check, the dry step included, in this
  process, no rank: strategy lines (each strategy's training is proven multi-rank by
  tests/integration/test_strategies_dp.py and test_strategies_mp.py with these options, and the
  user models' by test_clients.py) and data lines whose point is reading the config.
- `Skip`: what needs a cluster, a second machine or a long-running server, and synopses (`RUN_DIR
  [key=value ...]`); each with its reason. The skip list is asserted exactly.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from .conftest import cli_in_process, find_run_dirs
from .sweep import Sweep, run_sweep

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
# docs/config-reference.md is generated from the schema (its own test: tests/unit/test_tools_configref.py);
# the commands in its help texts are the schema's words, not recipes
DOCS = [
    ROOT / "README.md",
    *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "config-reference.md"),
]
SUBCOMMANDS = (
    "train", "config", "resume", "rerun", "export", "eval", "predict", "env", "bench", "plan", "runs",
    "show", "compare", "completion", "sweep",
)  # fmt: skip
FILE_HEADER = re.compile(r"^# ([\w./-]+\.(?:py|yaml))(?:\s+\((continued)\))?(?:\s|$)")


# ----------------------------------------------------------------------------------- the docs
def _argv(text: str) -> list[str] | None:
    """`disttrain <command> ...` of a shell line (from `disttrain` on), or None."""
    try:
        tokens = shlex.split(text, comments=True)
    except ValueError:
        return None
    if "|" in tokens:  # `disttrain train | tee result.txt`: the pipe is the shell's
        tokens = tokens[: tokens.index("|")]
    for i, token in enumerate(tokens[:-1]):
        if token == "disttrain" and tokens[i + 1] in SUBCOMMANDS:
            return tokens[i:]
    return None


def doc_commands() -> dict[str, tuple[str, list[str]]]:
    """`file: disttrain ...` (the shell words joined by blanks) -> (`file:line`, the shell words)
    for every disttrain command line of the docs."""
    found: dict[str, tuple[str, list[str]]] = {}
    for doc in DOCS:
        name, in_block, pending = doc.relative_to(ROOT).as_posix(), False, ""
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                in_block, pending = not in_block, ""
                continue
            if in_block:
                text = pending + line.strip()
                if text.endswith("\\"):
                    pending = text[:-1] + " "
                    continue
                pending = ""
                argv = _argv(text)
                if argv:
                    found.setdefault(f"{name}: {' '.join(argv)}", (f"{name}:{number}", argv))
                continue
            for span in re.findall(r"`([^`]+)`", line):
                argv = _argv(span)
                if argv and len(argv) > 2:  # a command with arguments, not the name of one
                    found.setdefault(f"{name}: {' '.join(argv)}", (f"{name}:{number}", argv))
    return found


def doc_files() -> dict[str, str]:
    """path -> text of every file a doc shows as a code block headed `# path` (`(continued)`
    blocks append to it), written as a reader copies the block: the `# path` line included. A Hydra
    `# @package` line must open its file, so it may come before the `# path` line."""
    files: dict[str, str] = {}
    for doc in DOCS:
        lines = doc.read_text().splitlines()
        for i, line in enumerate(lines[:-2]):
            package = line.startswith("```") and lines[i + 1].startswith("# @package ")
            at = i + 2 if package else i + 1
            match = FILE_HEADER.match(lines[at]) if line.startswith("```") else None
            if not match:
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            body = "\n".join(lines[i + 1 : end]) + "\n"  # as a reader copies it, the path line too
            path = match.group(1)
            files[path] = files.get(path, "") + "\n\n" + body if match.group(2) else body
    return files


# ------------------------------------------------------------------------------------ the plan
SHORT = ("trainer.max_steps=2", "trainer.val_batches=1")
ONE = ("nproc_per_node=1",)


@dataclass(frozen=True)
class Run:
    """In this process. `append`: overrides after the doc's; `one`: nproc_per_node=1 appended
    (the line's point survives one rank); `fill`: what a `...` of the line stands for."""

    append: tuple[str, ...] = SHORT
    one: bool = True
    rc: int = 0
    fill: tuple[str, ...] = ()
    run: str = "base"  # which run a RUN placeholder names (RUNS)


@dataclass(frozen=True)
class Job:
    """A 2-rank job of the module's sweep."""

    append: tuple[str, ...] = SHORT


@dataclass(frozen=True)
class Check:
    """Composition and every pre-launch check (the dry step too), no rank."""

    fill: tuple[str, ...] = ()
    rc: int = 0


@dataclass(frozen=True)
class Skip:
    reason: str


Plan = Run | Job | Check | Skip

STRATEGY = Check()  # trained multi-rank with these options by test_strategies_dp.py / test_strategies_mp.py
CLIENT = Check()  # trained under ddp/fsdp/tp on 2 ranks by test_clients.py
HF_LM = ("data.columns=[input_ids,labels]", "data.num_features=128", "data.num_classes=50304",
         "task.inputs=input_ids", "task.target=labels")  # fmt: skip
SLURM = ("experiment=digits_sgd", "nproc_per_node=2", "nodes=2", "launcher=slurm", "launcher.partition=gpu",
         "launcher.time=04:00:00", "launcher.gpus_per_node=2")  # fmt: skip
K8S = ("nodes=2", "nproc_per_node=8", "launcher=k8s", "launcher.image=ghcr.io/lab/train:1.4",
       "launcher.gpus_per_node=8", "launcher.pvc=runs", "launcher.namespace=ml")  # fmt: skip
DRY = ("launcher.dry_run=true",)
SYNOPSIS = "a synopsis (placeholders in brackets), not a command line; its command runs as"
NANOGPT_SMALL = ("model.config.n_layer=1", "model.config.n_head=2", "model.config.n_embd=32")

PLAN: dict[str, Plan] = {
    # README.md
    "README.md: disttrain train strategy=ddp optim.lr=3e-4 trainer.max_epochs=5": Run(),  # 2 ranks: the next line
    "README.md: disttrain train": Job(),
    "README.md: disttrain train ...": Skip(
        "`torchrun -m disttrain train ...` (a rank torchrun started): the launched mode is run by "
        "tests/integration/test_launch_modes.py"
    ),
    "README.md: disttrain eval RUN": Run(one=False),
    "README.md: disttrain config data=synthetic model.hidden=[256,256]": Run(append=(), one=False),
    "README.md: disttrain train --help": Run(append=(), one=False),
    "README.md: disttrain config --help strategy=fsdp": Run(append=(), one=False),
    "README.md: disttrain train -m optim.lr=1e-3,1e-2": Run(),
    "README.md: disttrain plan model=gpt nodes=4 nproc_per_node=8": Run(append=(), one=False),
    "README.md: disttrain plan --simulate model=gpt nodes=4 strategy=fsdp": Run(append=(), one=False),
    "README.md: disttrain train --config-dir conf model=nanogpt task.call={idx: x, targets: y}": Run(
        append=(*SHORT, *NANOGPT_SMALL)
    ),
    "README.md: disttrain train data=text task=model_loss model._target_=hfmodels.tiny_gpt2 "
    "task.call={input_ids: x, labels: x}": Run(),
    "README.md: disttrain train task.criterion.label_smoothing=0.1": Run(),
    "README.md: disttrain train data.train._target_=mylab.data.DictDigits data.val._target_=mylab.data.DictDigits "
    "data.val.split=val task.inputs=image task.target=label": Run(),
    "README.md: disttrain train data.train._target_=mylab.data.Weighted data.val._target_=mylab.data.Weighted "
    "data.val.split=val task._target_=mylab.tasks.WeightedCE": Run(),
    # docs/architecture.md
    "docs/architecture.md: disttrain train ...": Skip(
        "`torchrun -m disttrain train ...`: the launched mode is run by tests/integration/test_launch_modes.py"
    ),
    # docs/checkpoints-and-faults.md
    "docs/checkpoints-and-faults.md: disttrain config --help checkpoint=default": Run(append=(), one=False),
    "docs/checkpoints-and-faults.md: disttrain train trainer.ckpt_every=100 launcher.max_restarts=3": Job(
        append=("trainer.max_steps=4", "trainer.ckpt_every=2")
    ),
    "docs/checkpoints-and-faults.md: disttrain resume runs/default/2026-01-01_12-00-00 nproc_per_node=1": Run(
        append=(), one=False
    ),
    "docs/checkpoints-and-faults.md: disttrain train resume=PATH/checkpoints/step_00000500": Run(),
    "docs/checkpoints-and-faults.md: disttrain export runs/default/2026-01-01_12-00-00 --out model.safetensors": Run(
        append=(), one=False
    ),
    "docs/checkpoints-and-faults.md: disttrain eval runs/default/2026-01-01_12-00-00 nproc_per_node=1": Run(
        append=(), one=False
    ),
    "docs/checkpoints-and-faults.md: disttrain train init.path=runs/default/2026-01-01_12-00-00 data=other": Run(),
    "docs/checkpoints-and-faults.md: disttrain train trainer.val_every=100 trainer.early_stop.patience=5 "
    "checkpoint.keep_best=2": Run(append=("trainer.max_steps=6", "trainer.val_every=2")),
    "docs/checkpoints-and-faults.md: disttrain eval runs/default/2026-01-01_12-00-00/checkpoints/"
    "$(cat runs/default/2026-01-01_12-00-00/checkpoints/best)": Run(append=(), one=False, run="best"),
    "docs/checkpoints-and-faults.md: disttrain export runs/gpt/2026-01-01_12-00-00 --format hf --out tiny-finetuned": Run(
        append=(), one=False, run="gpt"
    ),
    "docs/checkpoints-and-faults.md: disttrain train init.path=runs/src/2026-01-01_12-00-00/checkpoints/"
    "step_00000500 data=mydata trainer.val_at_start=true": Run(),
    "docs/checkpoints-and-faults.md: disttrain train model._target_=mylab.hf.load model.path=./tiny "
    "init.path=./tiny-finetuned strategy=fsdp": CLIENT,
    "docs/checkpoints-and-faults.md: disttrain resume RUN KEY=VALUE": Skip(
        f"{SYNOPSIS} `disttrain resume runs/default/... nproc_per_node=1` (this file)"
    ),
    "docs/checkpoints-and-faults.md: disttrain show RUN": Run(append=(), one=False),
    # docs/clusters.md
    "docs/clusters.md: disttrain train experiment=digits_sgd nproc_per_node=2": Run(),  # the ranks: README's Job
    "docs/clusters.md: disttrain train experiment=digits_sgd nproc_per_node=2 nodes=2 node_rank=0 "
    "master_addr=10.0.0.1": Skip(
        "node 0 of two nodes started by hand: it waits for node 1 (the next line) on another machine; "
        "both run, on one host and in two network namespaces, in tests/integration/test_multinode.py"
    ),
    "docs/clusters.md: disttrain train experiment=digits_sgd nproc_per_node=2 nodes=2 node_rank=1 "
    "master_addr=10.0.0.1": Skip("node 1 of the line above (tests/integration/test_multinode.py)"),
    "docs/clusters.md: disttrain plan ... nodes=4": Run(append=(), one=False, fill=("model=gpt",)),
    "docs/clusters.md: disttrain train experiment=digits_sgd checkpoint.dir=/mnt/shared/ckpt/digits": Skip(
        "the ranks of `torchrun --nnodes=2 ...` on two machines (tests/integration/test_multinode_private.py "
        "runs this torchrun command on two nodes)"
    ),
    "docs/clusters.md: disttrain train experiment=digits_sgd nproc_per_node=2 nodes=2 launcher=slurm "
    "launcher.partition=gpu launcher.time=04:00:00 launcher.gpus_per_node=2": Run(append=DRY, one=False),
    "docs/clusters.md: disttrain train ... launcher=slurm launcher.dry_run=true": Run(
        append=(), one=False, fill=tuple(o for o in SLURM if o != "launcher=slurm")
    ),
    "docs/clusters.md: disttrain train nodes=2 ...": Skip(
        "`srun ... disttrain train nodes=2 ...` runs inside a Slurm allocation (tests/unit/test_launch_slurm.py "
        "fakes one)"
    ),
    "docs/clusters.md: disttrain train launcher=slurm strategy=fsdp nodes=2 nproc_per_node=1": Run(
        append=DRY, one=False
    ),
    "docs/clusters.md: disttrain train -m optim.lr=1e-3,3e-3,1e-2,3e-2 launcher=slurm sweep.max_parallel=2": Skip(
        "a Slurm cluster: tests/integration/test_slurm.py runs this sweep (with QUICK settings) on its two nodes"
    ),
    "docs/clusters.md: disttrain sweep status runs/default/multirun_2026-01-01_12-00-00": Skip(
        "the Slurm sweep above's folder: tests/integration/test_slurm.py runs it there (a local sweep's: "
        "tests/unit/test_sweeps.py)"
    ),
    "docs/clusters.md: disttrain sweep resume runs/default/multirun_2026-01-01_12-00-00": Skip(
        "the Slurm sweep above's folder after a scancel: tests/integration/test_slurm.py runs it there"
    ),
    "docs/clusters.md: disttrain train nodes=2 nproc_per_node=8 launcher=k8s launcher.image=ghcr.io/lab/train:1.4 "
    "launcher.gpus_per_node=8 launcher.pvc=runs launcher.namespace=ml": Run(append=DRY, one=False),
    "docs/clusters.md: disttrain train ... launcher=k8s launcher.dry_run=true": Run(
        append=(), one=False, fill=tuple(o for o in K8S if o != "launcher=k8s")
    ),
    "docs/clusters.md: disttrain train ... launcher=k8s launcher.api=pytorchjob": Run(
        append=DRY, one=False, fill=tuple(o for o in K8S if o != "launcher=k8s")
    ),
    # docs/configuration.md
    "docs/configuration.md: disttrain config data=synthetic model.hidden=[256,256]": Run(
        append=(), one=False
    ),
    "docs/configuration.md: disttrain train --cfg job": Run(append=(), one=False),
    "docs/configuration.md: disttrain train --help": Run(append=(), one=False),
    "docs/configuration.md: disttrain config --help strategy=fsdp": Run(append=(), one=False),
    "docs/configuration.md: disttrain train -m optim.lr=1e-3,1e-2": Run(),
    "docs/configuration.md: disttrain train -m hydra/sweeper=optuna hydra.sweeper.n_trials=20 "
    "optim.lr=interval(1e-4,1e-2)": Run(append=(*SHORT, "hydra.sweeper.n_trials=2")),
    "docs/configuration.md: disttrain train hydra.run.dir=/tmp/myrun": Run(),
    "docs/configuration.md: disttrain train --config-dir ./myconfigs experiment=paper": Run(),
    "docs/configuration.md: disttrain train experiment=digits_sgd": Run(),
    "docs/configuration.md: disttrain train model=gpt": Run(),
    "docs/configuration.md: disttrain train model=gpt data=text data.path=book.txt model.n_layers=6 model.dim=256": Check(),
    "docs/configuration.md: disttrain train model=cnn": Run(),
    "docs/configuration.md: disttrain train data=files data.path=train.npz data.val_path=val.npz "
    "data.num_features=20 data.num_classes=3": Run(),
    "docs/configuration.md: disttrain train model=gpt data=tokens data.path=train.bin data.num_classes=50304 "
    "trainer.max_steps=5000": Check(),
    "docs/configuration.md: disttrain train model=gpt data=hf data.path=shards/*.jsonl "
    "data.columns=[input_ids,labels] data.num_features=128 data.num_classes=50304 task.inputs=input_ids "
    "task.target=labels": Check(),
    "docs/configuration.md: disttrain train --config-dir conf data=mix ...": Skip(
        "`...` points to docs/data.md's mixture, whose sources (`web/`, `mylab.data.code_set`) the doc "
        "does not show; data=mix trains in tests/unit/test_data_mix.py"
    ),
    "docs/configuration.md: disttrain train strategy=fsdp model=gpt amp=bf16 optim.lr=3e-4": STRATEGY,
    # docs/data.md
    "docs/data.md: disttrain train model=gpt data=tokens data.path=data/train.bin data.val_path=data/val.bin "
    "data.num_classes=50304 data.block_size=256 trainer.max_steps=5000 trainer.val_batches=50": Check(),
    "docs/data.md: disttrain train model=gpt data=hf data.path=tokenized/ data.columns=[input_ids,labels] "
    "data.num_features=128 data.num_classes=50304 task.inputs=input_ids task.target=labels": Check(),
    "docs/data.md: disttrain train model=gpt data=hf data.path=shards/*.jsonl data.split='train[:90%]' "
    "data.val_split='train[90%:]' strategy=fsdp ...": Check(fill=HF_LM),
    "docs/data.md: disttrain train model=gpt data=hf data.path=shards/*.jsonl data.streaming=true "
    "trainer.max_steps=5000 ...": Check(fill=HF_LM),
    "docs/data.md: disttrain plan --simulate": Run(append=(), one=False),
    "docs/data.md: disttrain train model=gpt data=tokens data.path=train.bin data.num_classes=50304 "
    "data.packing=true data.eos_id=50256": Check(),
    "docs/data.md: disttrain train model=gpt data=hf data.path=shards/*.jsonl data.packing=true "
    "data.block_size=256 data.num_classes=50304": Check(),
    "docs/data.md: disttrain train data=hf data.path=chats.jsonl data.tokenizer=tok/ data.packing=true "
    "data.block_size=1024 task=model_loss model._target_=transformers.AutoModelForCausalLM.from_pretrained "
    "+model.pretrained_model_name_or_path=base/": Skip(
        "needs a tokenizer folder and a pretrained model; tests/unit/test_data_packing.py tokenizes chat "
        "and prompt/completion rows and trains packed rows of GPT-2 and Llama models built there"
    ),
    # docs/development.md
    "docs/development.md: disttrain bench comm": Skip(
        "the benchmark's name; the command is the next line's (same file)"
    ),
    "docs/development.md: disttrain bench comm nproc_per_node=2 backend=gloo": Skip(
        "2 ranks timing collectives (~8 s); run with these arguments by tests/integration/test_tools.py"
    ),
    # docs/eval-and-predict.md
    "docs/eval-and-predict.md: disttrain eval runs/default/2026-01-01_12-00-00": Run(append=(), one=False),
    "docs/eval-and-predict.md: disttrain eval runs/default/2026-01-01_12-00-00/checkpoints/step_00000500 "
    "nproc_per_node=1": Run(append=(), one=False),
    "docs/eval-and-predict.md: disttrain eval RUN data.val=holdout.npz --out holdout.json": Run(append=()),
    "docs/eval-and-predict.md: disttrain predict RUN --out preds.jsonl": Run(append=()),
    "docs/eval-and-predict.md: disttrain predict RUN --out logits.pt strategy=single nproc_per_node=1": Run(
        append=(), one=False
    ),
    # docs/observability.md
    "docs/observability.md: disttrain train ...": Run(),
    "docs/observability.md: disttrain train observe.sinks=[tensorboard,{_target_:mlflow,tracking_uri:"
    '"file:///data/mlruns"}]': Run(),
    "docs/observability.md: disttrain train observe.sinks=[{_target_:wandb,project:digits}]": Skip(
        "W&B starts its own service process (several CPU-s); `WANDB_MODE=offline` runs with this sink "
        "are tests/integration/test_observe.py's"
    ),
    "docs/observability.md: disttrain runs [DIR]": Run(append=(), one=False),
    "docs/observability.md: disttrain show RUN_DIR": Run(append=(), one=False),
    "docs/observability.md: disttrain compare RUN_A RUN_B ... --plot curves.png": Run(append=(), one=False),
    "docs/observability.md: disttrain rerun RUN_DIR [key=value ...] [--run-dir NEW]": Run(
        append=(), one=False
    ),
    # docs/precision-and-guards.md
    "docs/precision-and-guards.md: disttrain export RUN --ema": Run(append=(), one=False, run="ema"),
    # docs/strategies.md
    "docs/strategies.md: disttrain train strategy=ddp strategy.comm_hook=fp16": STRATEGY,
    "docs/strategies.md: disttrain train strategy=zero": STRATEGY,
    "docs/strategies.md: disttrain train strategy=zero2": STRATEGY,
    "docs/strategies.md: disttrain train strategy=fsdp": STRATEGY,
    "docs/strategies.md: disttrain train strategy=fsdp strategy.wrap_classes=[Linear]": STRATEGY,
    "docs/strategies.md: disttrain train strategy=fsdp strategy.min_num_params=1000000 strategy.cpu_offload=true": STRATEGY,
    "docs/strategies.md: disttrain train strategy=hsdp nproc_per_node=4": STRATEGY,
    "docs/strategies.md: disttrain train strategy=localsgd strategy.sync_every=8 strategy.warmup_steps=100": STRATEGY,
    "docs/strategies.md: disttrain train strategy=dp nproc_per_node=1": Run(one=False),
    "docs/strategies.md: disttrain train strategy=pipeline strategy.schedule=gpipe strategy.n_microbatches=8": STRATEGY,
    "docs/strategies.md: disttrain train strategy=pipeline strategy.schedule=interleaved_1f1b "
    "strategy.stages_per_rank=2": STRATEGY,
    "docs/strategies.md: disttrain train strategy=pipeline strategy.split_points=[layers.5] "
    "model.hidden=[256,256,256,256]": STRATEGY,
    "docs/strategies.md: disttrain train strategy=tp": STRATEGY,
    "docs/strategies.md: disttrain train strategy=fsdp+tp nproc_per_node=4 strategy.tp_degree=2": STRATEGY,
    "docs/strategies.md: disttrain train strategy=tp model=gpt "
    "strategy.tp_plan={blocks.*.fc: colwise, blocks.*.fc_out: rowwise}": STRATEGY,
    "docs/strategies.md: disttrain plan [overrides]": Run(append=(), one=False),
    "docs/strategies.md: disttrain plan --simulate [overrides]": Run(append=(), one=False),
    "docs/strategies.md: disttrain plan --simulate model=gpt model.dim=4096 model.n_layers=32 model.n_heads=32 "
    "data.block_size=2048 amp=bf16 trainer.batch_size=1 nodes=8 nproc_per_node=8 strategy=fsdp+tp "
    "strategy.tp_degree=8": Skip(
        "~20 CPU-s by the doc's own count (25 of 64 ranks simulated); the simulation is "
        "tests/unit/test_tools_simulate.py's, and the next lines run it on README's small layout"
    ),
    "docs/strategies.md: disttrain plan --simulate --json --no-step ...": Run(
        append=(), one=False, fill=("model=gpt", "nodes=4", "strategy=fsdp")
    ),
    "docs/strategies.md: disttrain plan --simulate [overrides] --load-at OVERRIDES": Skip(
        f"{SYNOPSIS} the two `--load-at` lines below (same file)"
    ),
    "docs/strategies.md: disttrain plan --simulate nodes=8 nproc_per_node=8 strategy=fsdp+tp strategy.tp_degree=8 "
    "... --load-at nodes=1 strategy=fsdp": Skip(
        "`...` is line 197's 64-rank layout (~3 CPU-s even shrunk); --load-at runs on README's small "
        "layout in the next line (exit 2 documented), and the load planning in tests/unit/test_tools_simulate_load.py"
    ),
    "docs/strategies.md: disttrain plan --simulate --json ... --load-at model.dim=2048": Run(
        append=(), one=False, rc=2, fill=("model=gpt", "nodes=4", "strategy=fsdp", "--no-step")
    ),
    # docs/first-run.md
    "docs/first-run.md: disttrain train": Skip("README.md's quick start, the same command: its 2-rank Job"),
    "docs/first-run.md: disttrain plan model=gpt nodes=4 nproc_per_node=8": Run(append=(), one=False),
    "docs/first-run.md: disttrain train strategy=ddp optim.lr=3e-4 trainer.max_epochs=5": Run(),
    "docs/first-run.md: disttrain show RUN_DIR": Run(append=(), one=False),
    # docs/gpu-quickstart.md: CUDA GPUs; tests/integration/test_gpu.py runs these paths on one
    "docs/gpu-quickstart.md: disttrain env": Skip(
        "this machine's report; `env --json` is run by tests/unit/test_tools_envreport.py"
    ),
    "docs/gpu-quickstart.md: disttrain train": Skip(
        "README.md's default job (its 2-rank Job); on CUDA, test_gpu.py::test_the_default_command_on_a_one_gpu_machine"
    ),
    "docs/gpu-quickstart.md: disttrain train model=gpt strategy=fsdp amp=bf16": Skip(
        "on CUDA: test_gpu.py::test_fsdp_bf16_two_steps; on CPU configuration.md's `strategy=fsdp model=gpt "
        "amp=bf16` line is checked"
    ),
    "docs/gpu-quickstart.md: disttrain train model=gpt strategy=fsdp amp=bf16 trainer.compile=regional": Skip(
        "regional compile of gpt under single, ddp and fsdp: tests/unit/test_blocks.py (eager losses, one graph)"
    ),
    "docs/gpu-quickstart.md: disttrain train model=gpt strategy=fsdp amp=bf16 "
    "trainer.activation_checkpointing=selective": Skip(
        "activation checkpointing of gpt under fsdp: tests/unit/test_blocks.py (same losses, less memory)"
    ),
    "docs/gpu-quickstart.md: disttrain train model=gpt strategy=fsdp amp=fp8": Skip(
        "float8 needs compute capability >= 8.9 (refused on CPU); emulated under fsdp in tests/unit/test_amp_fp8.py"
    ),
    # docs/migrate-from-torchrun.md
    "docs/migrate-from-torchrun.md: disttrain train model._target_=simple.SimpleModel model.input_size=64 "
    "model.hidden_size=256 model.num_classes=10 optim._target_=torch.optim.Adam optim.lr=1e-3 sched=constant "
    "trainer.clip_grad_norm=null trainer.max_epochs=10": Run(),
    "docs/migrate-from-torchrun.md: disttrain train model._target_=simple.SimpleModel model.input_size=64 "
    "model.hidden_size=256 model.num_classes=10": Skip(
        "`torchrun ... -m disttrain train ...` (ranks torchrun started): the launched mode is run by "
        "tests/integration/test_launch_modes.py"
    ),
    # docs/troubleshooting.md
    "docs/troubleshooting.md: disttrain resume RUN_DIR [key=value ...] [--trust]": Skip(
        "the usage line inside a quoted error message, not a command"
    ),
    "docs/troubleshooting.md: disttrain show RUN_DIR": Run(append=(), one=False),
    # docs/your-own-code.md
    "docs/your-own-code.md: disttrain train --config-dir conf model=nanogpt task.call={idx: x, targets: y} "
    "task.tokens=idx strategy=fsdp amp=bf16": CLIENT,
    "docs/your-own-code.md: disttrain train data=text task=model_loss model._target_=hfmodels.tiny_gpt2 "
    "task.call={input_ids: x, labels: x} strategy=fsdp": CLIENT,
    "docs/your-own-code.md: disttrain train data=text task=model_loss task.call={input_ids: x, labels: x} "
    "strategy=fsdp amp=bf16 model._target_=transformers.AutoModelForCausalLM.from_pretrained "
    "model.pretrained_model_name_or_path=./tiny": Run(),
    # trained with these options by tests/unit/test_peft_lora.py and tests/integration/test_lora.py
    "docs/your-own-code.md: disttrain train data=text task=model_loss task.call={input_ids: x, labels: x} "
    "strategy=fsdp model._target_=transformers.AutoModelForCausalLM.from_pretrained "
    "model.pretrained_model_name_or_path=./tiny init.path=./tiny peft=lora peft.rank=8": Check(),
    "docs/your-own-code.md: disttrain train data=text task=model_loss task.call={x: x} model._target_=mylm.tiny_lm "
    "strategy=tp strategy.tp_plan={net.attn_layers.layers.*.1.ff.0.0: colwise, "
    "net.attn_layers.layers.*.1.ff.2: rowwise}": CLIENT,
    "docs/your-own-code.md: disttrain train --config-dir conf model=cnn_images": Run(),
    "docs/your-own-code.md: disttrain train task.criterion.label_smoothing=0.1": Run(),
    "docs/your-own-code.md: disttrain train task.criterion._target_=mylab.losses.Focal task.criterion.gamma=2": Run(),
    "docs/your-own-code.md: disttrain train data=synthetic task=regression "
    "task.criterion._target_=torch.nn.SmoothL1Loss": Run(),
    "docs/your-own-code.md: disttrain train data.train._target_=mylab.data.DictDigits "
    "data.val._target_=mylab.data.DictDigits data.val.split=val task.inputs=image task.target=label": Run(),
    "docs/your-own-code.md: disttrain train data.train._target_=mylab.data.Weighted "
    "data.val._target_=mylab.data.Weighted data.val.split=val task._target_=mylab.tasks.WeightedCE": Run(),
    "docs/your-own-code.md: disttrain train task._target_=mylab.tasks.contrastive task.temperature=0.05 "
    "data.train._target_=mylab.data.Pairs data.val._target_=mylab.data.Pairs data.val.split=val": Run(),
    "docs/your-own-code.md: disttrain train model._target_=mylab.nets.Net model.width=512 "
    "model.num_classes=${data.num_classes}": Run(),
    "docs/your-own-code.md: disttrain train data.train._target_=mylab.data.make_train data.val=null": Run(),
    "docs/checkpoints-and-faults.md: disttrain export --out": Skip(
        "a flag named in prose; export to a store: tests/unit/test_objstore.py"
    ),
    "docs/observability.md: disttrain compare A B [C ...]": Skip(
        "the usage line; N-run compare: tests/unit/test_tools_runs.py"
    ),
}

COVERED, SKIPPED = 108, 29  # asserted: a doc edit that adds or drops a command updates these


def test_every_doc_command_is_planned() -> None:
    found = doc_commands()
    missing = sorted(f"{found[k][0]}: {k}" for k in found if k not in PLAN)
    stale = sorted(k for k in PLAN if k not in found)
    assert not missing, "doc commands neither run nor skipped (add them to PLAN):\n" + "\n".join(missing)
    assert not stale, "PLAN entries no doc holds any more:\n" + "\n".join(stale)
    skipped = [k for k, p in PLAN.items() if isinstance(p, Skip)]
    assert (len(PLAN) - len(skipped), len(skipped)) == (COVERED, SKIPPED)


# Which doc command makes each run a later command names (RUN, PATH, runs/<name>/<date>), and what
# must exist before a command runs.
RUNS = {
    "base": "docs/checkpoints-and-faults.md: disttrain train trainer.ckpt_every=100 launcher.max_restarts=3",
    "other": "README.md: disttrain train",
    "best": "docs/checkpoints-and-faults.md: disttrain train trainer.val_every=100 trainer.early_stop.patience=5 "
    "checkpoint.keep_best=2",
    "gpt": "docs/your-own-code.md: disttrain train data=text task=model_loss task.call={input_ids: x, labels: x} "
    "strategy=fsdp amp=bf16 model._target_=transformers.AutoModelForCausalLM.from_pretrained "
    "model.pretrained_model_name_or_path=./tiny",
}
NEEDS = {  # command -> commands whose outputs (files) it reads
    "docs/checkpoints-and-faults.md: disttrain train model._target_=mylab.hf.load model.path=./tiny "
    "init.path=./tiny-finetuned strategy=fsdp": [
        "docs/checkpoints-and-faults.md: disttrain export runs/gpt/2026-01-01_12-00-00 --format hf --out tiny-finetuned"
    ],
}


def _write_data(cwd: Path) -> None:
    """book.txt, train.npz/val.npz (20 features, 3 classes), holdout.npz (digits-shaped), token
    files, JSON lines and a save_to_disk folder of token rows."""
    import numpy as np

    rng = np.random.default_rng(0)
    (cwd / "book.txt").write_text(
        (ROOT / "LICENSE").read_text() * 4 if (ROOT / "LICENSE").is_file() else "abc " * 8000
    )
    for name, n in (("train", 96), ("val", 32)):
        np.savez(cwd / f"{name}.npz", x=rng.normal(size=(n, 20)).astype("float32"), y=rng.integers(0, 3, n))
    np.savez(cwd / "holdout.npz", x=rng.random((40, 64)).astype("float32"), y=rng.integers(0, 10, 40))
    (cwd / "data").mkdir()
    for path in (cwd / "train.bin", cwd / "data/train.bin", cwd / "data/val.bin"):
        rng.integers(0, 50304, 40_000).astype(np.uint16).tofile(path)
    rows = [{"input_ids": [int(t) for t in rng.integers(0, 50304, 128)]} for _ in range(160)]
    for row in rows:
        row["labels"] = [*row["input_ids"][1:], 0]
    (cwd / "shards").mkdir()
    (cwd / "shards/part0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from datasets import Dataset

    Dataset.from_list(rows).save_to_disk(str(cwd / "tokenized"))


def _run_python_lines(cwd: Path) -> None:
    """The docs' `python -c "..."` lines that make files a command reads (your-own-code.md's
    save_pretrained of `tiny`), run as written in `cwd`."""
    import os

    for doc in DOCS:
        text = doc.read_text().replace("\\\n", " ")
        for line in text.splitlines():
            if line.startswith('python -c "'):
                code = shlex.split(line)[2]
                here = os.getcwd()
                os.chdir(cwd)
                try:
                    exec(code, {})
                finally:
                    os.chdir(here)


class Workspace:
    """The user's folder: the docs' files, the data; the runs the commands made."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.runs: dict[str, Path] = {}
        self.done: dict[str, Any] = {}  # command -> its result
        self.sweep: Sweep | None = None


@pytest.fixture(scope="module")
def ws(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    cwd = tmp_path_factory.mktemp("docs")
    for path, text in doc_files().items():  # every file a command needs is in the docs
        (cwd / path).parent.mkdir(parents=True, exist_ok=True)
        (cwd / path).write_text(text)
    shutil.copy(ROOT / "tests/clients/nanogpt/model.py", cwd / "model.py")
    _write_data(cwd)
    _run_python_lines(cwd)
    return Workspace(cwd)


def _sweep(ws: Workspace) -> Sweep:
    """Every `Job` of PLAN as a job of one 2-rank sweep (made when a test first needs one)."""
    if ws.sweep is None:
        jobs = {k: (*_doc_args(k)[1:], *p.append) for k, p in PLAN.items() if isinstance(p, Job)}
        (ws.cwd / "sweep").mkdir()
        ws.sweep = run_sweep(ws.cwd / "sweep", jobs, config_dir=ws.cwd / "sweep_conf")
    return ws.sweep


def _doc_args(key: str) -> list[str]:
    """The command's arguments as the doc writes them (`train`, ..., without `disttrain`)."""
    return DOC_COMMANDS[key][1][1:]


def _run_dir(ws: Workspace, name: str) -> Path:
    if name == "ema" and name not in ws.runs:  # a run with trainer.ema set, as the doc's RUN
        proc = cli_in_process(
            "train", *SHORT, *ONE, "trainer.ema.decay=0.9", "trainer.progress=false", cwd=ws.cwd
        )
        assert proc.returncode == 0, proc.stderr
        ws.runs[name] = Path(proc.stdout.rpartition("run dir: ")[2].strip())
    if name not in ws.runs:
        key = RUNS[name]
        if isinstance(PLAN[key], Job):
            ws.runs[name] = _sweep(ws)[key]
        else:
            _execute(ws, key)
            ws.runs[name] = ws.done[key][1]
    return ws.runs[name]


def _substitute(ws: Workspace, key: str, plan: Run | Check) -> list[str]:
    """The doc's arguments with the placeholders replaced, `...` filled, the appended overrides."""
    args: list[str] = []
    run = getattr(plan, "run", "base")
    for word in _doc_args(key):
        if word == "...":
            args += plan.fill
            continue
        if word in ("[DIR]", "...]", "[overrides]"):
            args += ["runs"] if word == "[DIR]" else []
            continue
        if word == "[key=value":
            args.append("nproc_per_node=1")
            continue
        if word in ("[--run-dir", "NEW]"):
            args.append("--run-dir" if word == "[--run-dir" else str(ws.cwd / "rerun-new"))
            continue
        if word in ("RUN", "RUN_DIR", "RUN_A"):
            word = str(_run_dir(ws, run))
        elif word == "RUN_B":
            word = str(_run_dir(ws, "other"))
        for placeholder in ("runs/default/2026-01-01_12-00-00", "runs/src/2026-01-01_12-00-00", "PATH"):
            word = word.replace(placeholder, str(_run_dir(ws, run))) if placeholder in word else word
        word = word.replace(
            "runs/gpt/2026-01-01_12-00-00", str(_run_dir(ws, "gpt")) if "runs/gpt/" in word else ""
        )
        word = word.replace("step_00000500", "step_00000002")
        word = word.replace("file:///data/mlruns", f"file://{ws.cwd}/mlruns").replace(
            "/tmp/myrun", str(ws.cwd / "myrun")
        )
        word = {"data=other": "data=digits", "data=mydata": "data=digits"}.get(word, word)
        args.append(word)
    # `$(cat FILE)`: the shell's substitution
    joined = list(args)
    for i, word in enumerate(joined):
        if word.endswith("$(cat") and i + 1 < len(joined):
            joined[i] = word[: -len("$(cat")] + Path(joined[i + 1].rstrip(")")).read_text().strip()
            del joined[i + 1]
            break
    if isinstance(plan, Run):
        joined += [*plan.append, *(ONE if plan.one else ())]
    if joined[0] in ("train", "resume", "rerun") or (
        joined[0] in ("eval", "predict") and isinstance(plan, Run)
    ):
        joined.append("trainer.progress=false")
    return joined


def _checks_only(rest: list[str]) -> int:
    """`disttrain train ARGS` up to the launch: compose, the static and runtime checks, the dry step."""
    import sys

    from disttrain.commands.config import compose_checked
    from disttrain.commands.hydra_app import parse_args
    from disttrain.preflight.checks import check_runtime

    args = parse_args(rest)
    run, _ = compose_checked(args.overrides, args, runtime=False)
    check_runtime(run)
    sys.stdout.write("checked\n")
    return 0


def _execute(ws: Workspace, key: str) -> tuple[Any, Path | None]:
    """Run the command of `key` once (in this process); its result and the run dir it made."""
    if key in ws.done:
        return ws.done[key]
    same = next(
        (k for k in ws.done if k.partition(": ")[2] == key.partition(": ")[2] and PLAN[k] == PLAN[key]), None
    )
    if same:  # the same command in another doc (README repeats docs/ lines): run once
        ws.done[key] = ws.done[same]
        return ws.done[key]
    for first in NEEDS.get(key, []):
        _execute(ws, first)
    plan = PLAN[key]
    assert isinstance(plan, Run | Check), plan
    args = _substitute(ws, key, plan)
    before = set(find_run_dirs(ws.cwd))
    if isinstance(plan, Check):
        import disttrain.cli

        saved = disttrain.cli.COMMANDS["train"]
        disttrain.cli.COMMANDS["train"] = _checks_only
        try:
            proc = cli_in_process(*args, cwd=ws.cwd)
        finally:
            disttrain.cli.COMMANDS["train"] = saved
    else:
        proc = cli_in_process(*args, cwd=ws.cwd)
    assert proc.returncode == plan.rc, (
        f"`disttrain {shlex.join(args)}` exited {proc.returncode}, expected {plan.rc}\n"
        f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    )
    new = sorted(set(find_run_dirs(ws.cwd)) - before, key=lambda d: d.stat().st_mtime)
    ws.done[key] = (proc, new[-1] if new else None)
    return ws.done[key]


RUNNABLE = [k for k, p in PLAN.items() if not isinstance(p, Skip)]
DOC_COMMANDS = doc_commands()


@pytest.mark.parametrize("key", RUNNABLE, ids=[DOC_COMMANDS.get(k, (k,))[0] for k in RUNNABLE])
def test_doc_command(ws: Workspace, key: str) -> None:
    plan = PLAN[key]
    if isinstance(plan, Job):
        run_dir = _sweep(ws)[key]  # fails naming the job unless it finished
        assert (run_dir / "summary.json").is_file()
        return
    proc, run_dir = _execute(ws, key)
    args = proc.args[1:]
    flags = {"-m", "--help", "--cfg", "launcher.dry_run=true"}
    if args[0] == "train" and isinstance(plan, Run) and plan.rc == 0 and not flags & set(args):
        assert (
            run_dir is not None and json.loads((run_dir / "status.json").read_text())["status"] == "finished"
        )
        # stdout carries the result only (observability.md: `| tee result.txt`): user code's print
        # (nanoGPT's `number of parameters`) goes to the rank logs (docs-as-written review 3.8)
        assert [ln for ln in proc.stdout.splitlines() if not ln.startswith("done: ")] == [], proc.stdout
    command = key.partition(": ")[2]
    if command.startswith("disttrain resume ") and "nproc_per_node=1" in command:
        # review 2A: a finished 2-rank run resumed on 1 rank trains nothing ("continue, resharded")
        resumed = Path(args[1])
        assert json.loads((resumed / "summary.json").read_text())["steps"] == 4, "the job's max_steps=4"
        assert max(json.loads(ln)["step"] for ln in (resumed / "metrics.jsonl").read_text().splitlines()) == 4
    if (
        command == "disttrain train --config-dir ./myconfigs experiment=paper"
    ):  # the doc's file, as a reader copies it
        assert run_dir is not None and run_dir.parent.name == "paper", run_dir
    if command == "disttrain train --cfg job":  # review 2E: what config.yaml will hold
        assert "${" not in proc.stdout and "in_features: 64" in proc.stdout, proc.stdout
    if command.startswith("disttrain show "):  # review 3.6: the rerun command is one whole line
        assert any(ln.rstrip().endswith(f"disttrain rerun {args[1]}") for ln in proc.stdout.splitlines()), (
            proc.stdout
        )
