"""Config values that code outside the parent reads (ranks, engine): kept out of config.schema,
whose import pulls Hydra's ConfigStore and every schema dataclass into each rank."""

NO_DECAY = "no_decay_bias_norm_embed"  # optim.param_groups: nanoGPT's / HF's weight-decay groups
