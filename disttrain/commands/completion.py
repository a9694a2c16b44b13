"""Shell completion for bash and zsh: subcommands, their options, config groups and their options,
and config keys (Hydra's own completer, asked without the `train`/`config` subcommand it would choke
on).

    eval "$(disttrain completion bash)"     # in ~/.bashrc
    eval "$(disttrain completion zsh)"      # in ~/.zshrc

The script asks `disttrain __complete SHELL` with the line up to the cursor in COMP_LINE/COMP_POINT.
"""

from __future__ import annotations

import os
import sys

HYDRA_FLAGS = (
    "-m",
    "--multirun",
    "--cfg",
    "--package",
    "--config-dir",
    "--config-name",
    "--config-path",
    "--info",
    "--resolve",
    "--help",
    "--hydra-help",
    "--version",
)
TOOL_FLAGS = {
    "runs": ("--json",),
    "show": ("--json", "--plot"),
    "compare": ("--json", "--plot"),
    "env": ("--json",),
    "bench": ("--json",),
    "plan": ("--json",),
    "rerun": ("--run-dir",),
    "export": ("--out",),
    "eval": ("--out", "--trust"),
    "predict": ("--out", "--trust"),
}
BASH = """\
# disttrain completion for bash: eval "$(disttrain completion bash)"
_disttrain() {
    local IFS=$'\\n'
    COMPREPLY=($(COMP_LINE="$COMP_LINE" COMP_POINT="$COMP_POINT" "${COMP_WORDS[0]}" __complete bash 2>/dev/null))
}
complete -o nospace -o default -F _disttrain disttrain
"""
ZSH = """\
# disttrain completion for zsh: eval "$(disttrain completion zsh)"
autoload -U +X compinit && compinit
autoload -U +X bashcompinit && bashcompinit
_disttrain() {
    local IFS=$'\\n'
    COMPREPLY=($(COMP_LINE="$COMP_LINE" COMP_POINT="$COMP_POINT" "${COMP_WORDS[1]:-disttrain}" __complete zsh 2>/dev/null))
}
complete -o nospace -o default -F _disttrain disttrain
"""
SCRIPTS = {"bash": BASH, "zsh": ZSH}


def _hydra_candidates(words: list[str], current: str) -> list[str]:
    """Hydra's completer over the config: groups (`strategy=`), options (`strategy=ddp`), keys.

    The completer is `DefaultCompletionPlugin`'s query (private: config/hydra_private.py).
    """
    from disttrain.config import config_dir
    from disttrain.config.hydra_private import complete
    from disttrain.config.schema import register

    register()
    line = " ".join([*words, current]) if current else " ".join(words) + " "
    found = complete(str(config_dir()), line.lstrip())
    return [c for c in found if "base_" not in c and not c.startswith("hydra")]


def candidates(line: str) -> list[str]:
    """Completions of the last word of `line` (the command line up to the cursor)."""
    from disttrain.commands import COMMANDS

    words = line.split()
    current = "" if not words or line.endswith((" ", "\t")) else words.pop()
    if len(words) <= 1:  # the subcommand
        return [c for c in [*COMMANDS, "completion", "--help", "--version"] if c.startswith(current)]
    sub, done = words[1], words[2:]
    if sub == "completion":
        return [s for s in SCRIPTS if s.startswith(current)] if not done else []
    if current.startswith("-"):
        flags = HYDRA_FLAGS if sub in ("train", "config") else (*TOOL_FLAGS.get(sub, ()), "--help")
        return [f for f in flags if f.startswith(current)]
    if sub in ("train", "config"):
        if done and done[-1] in ("--config-dir", "--config-path", "--config-name", "--cfg", "--package"):
            return []  # a path or a name: the shell's default (files)
        overrides = [w for w in done if not w.startswith("-")]
        return _hydra_candidates(overrides, current)
    return []  # run dirs: the shell's file completion


def cmd_completion(rest: list[str]) -> int:
    shell = rest[0] if rest else ""
    if shell not in SCRIPTS:
        from disttrain.config.errors import ConfigError

        raise ConfigError(
            "completion",
            shell or None,
            "bash or zsh",
            'add eval "$(disttrain completion bash)" to ~/.bashrc.',
        )
    sys.stdout.write(SCRIPTS[shell])
    return 0


def cmd_complete(rest: list[str]) -> int:
    """`disttrain __complete bash|zsh`: the candidates, one a line, for the line in COMP_LINE."""
    line = os.environ.get("COMP_LINE", "")
    point = os.environ.get("COMP_POINT", "")
    if point.isdigit():
        line = line[: int(point)]
    words = line.split()
    current = "" if not words or line.endswith((" ", "\t")) else words[-1]
    cut = max(current.rfind("="), current.rfind(":")) + 1 if rest[:1] == ["bash"] else 0
    # bash splits words at = and : (COMP_WORDBREAKS) and replaces only the part after them
    for c in candidates(line):
        sys.stdout.write(c[cut:] + "\n")
    return 0
