"""Config: Hydra composition, schemas in the ConfigStore, and cross-field validation."""

from disttrain.config.compose import compose, config_dir, expand_sweep, resolve
from disttrain.config.errors import ConfigError

__all__ = ["ConfigError", "compose", "config_dir", "expand_sweep", "resolve"]
