"""The subcommands: where each is implemented ("module:function"), imported only when it runs.

cli.py only dispatches over this table; `disttrain --help` and shell completion list it.
"""

from __future__ import annotations

COMMANDS: dict[str, str] = {
    "train": "disttrain.commands.train:cmd_train",
    "config": "disttrain.commands.config:cmd_config",
    "resume": "disttrain.commands.resume:cmd_resume",
    "rerun": "disttrain.commands.rerun:cmd_rerun",
    "export": "disttrain.commands.export:cmd_export",
    "eval": "disttrain.commands.evaluate:cmd_eval",
    "predict": "disttrain.commands.evaluate:cmd_predict",
    "env": "disttrain.tools.envreport:cmd_env",
    "bench": "disttrain.tools.benchcmd:cmd_bench",
    "plan": "disttrain.tools.plan_command:cmd_plan",
    "runs": "disttrain.tools.runs:cmd_runs",
    "show": "disttrain.tools.runs:cmd_show",
    "compare": "disttrain.tools.runs:cmd_compare",
    "completion": "disttrain.commands.completion:cmd_completion",
}

# Commands that build the user's `_target_`s (`_target_: mylab.nets.Net` from the working directory).
# The read-only ones (config, runs, show, compare, env, plan) never import from the cwd.
USER_CODE_COMMANDS = ("train", "resume", "export", "eval", "predict", "bench")
