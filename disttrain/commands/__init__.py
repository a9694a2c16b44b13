"""The subcommands' entry points (`disttrain resume`, `rerun`, `export`, ...): cli.py only dispatches."""
