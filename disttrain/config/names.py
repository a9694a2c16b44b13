"""Config values that code outside the parent reads (ranks, engine): kept out of config.schema,
whose import pulls Hydra's ConfigStore and every schema dataclass into each rank."""

NO_DECAY = "no_decay_bias_norm_embed"  # optim.param_groups: minGPT-style (1-D and embeddings exempt)
NO_DECAY_1D = "no_decay_1d"  # optim.param_groups: nanoGPT's rule (every >= 2-D parameter decays)
