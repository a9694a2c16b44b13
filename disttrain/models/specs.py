"""The built-in models' specs and typed configs (torch-free): `model=mlp|cnn|gpt`.

Each spec is stored in Hydra's ConfigStore as `model/base_<name>`; a YAML under `configs/model/`
fills values. A model of yours needs no spec (`model._target_=mylab.Net` is enough); a package that
ships a model with a schema of its own registers a `TargetSpec` in `MODELS` through the
`disttrain.models` entry-point group, plus one `model/<name>.yaml` (`defaults: [base_<name>]`).
"""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import II

from disttrain.config.common import help_field as _h
from disttrain.config.registry import Registry, TargetSpec, target_registry

MODELS: Registry[TargetSpec] = target_registry(
    "models",
    key="model",
    module="disttrain.models.specs",
    hint="choose a model group option (model=gpt), or build your own: model._target_=mylab.Net.",
)


@dataclass
class MLPConfig:
    _target_: str = "disttrain.models.mlp.MLP"
    in_features: int = _h("input width (from the data set)", II("data.num_features"))
    num_classes: int = _h("output width (from the data set)", II("data.num_classes"))
    hidden: list[int] = _h("hidden layer widths", factory=lambda: [128, 128])
    dropout: float = _h("dropout probability after each hidden layer", 0.0)
    activation: str = _h("relu, gelu or tanh", "relu")


@dataclass
class CNNConfig:
    _target_: str = "disttrain.models.cnn.CNN"
    in_features: int = _h(
        "pixels of one square single-channel image (from the data set)", II("data.num_features")
    )
    num_classes: int = _h("output width (from the data set)", II("data.num_classes"))
    channels: list[int] = _h(
        "channels of each 3x3 conv block (each pools 2x while the side is even)", factory=lambda: [16, 32]
    )
    hidden: int = _h("width of the classifier's hidden Linear", 64)


@dataclass
class GPTConfig:
    _target_: str = "disttrain.models.gpt.GPT"
    vocab_size: int = _h("tokens (from the data set: 256 for bytes)", II("data.num_classes"))
    block_size: int = _h("context length (from the data set)", II("data.num_features"))
    dim: int = _h("embedding width", 64)
    n_layers: int = _h("transformer blocks", 2)
    n_heads: int = _h("attention heads (divide dim; a multiple of the tp degree)", 4)
    mlp_ratio: int = _h("MLP hidden width = mlp_ratio x dim", 4)
    dropout: float = _h("dropout on embeddings, attention and residual branches", 0.0)
    tie_weights: bool = _h("the head shares the token embedding (false for strategy=pipeline)", True)


MLP = MODELS.register(TargetSpec("mlp", MLPConfig, MLPConfig._target_, "a multi-layer perceptron"))
CNN = MODELS.register(TargetSpec("cnn", CNNConfig, CNNConfig._target_, "a small conv net on square images"))
GPT = MODELS.register(TargetSpec("gpt", GPTConfig, GPTConfig._target_, "a nanoGPT-style transformer"))
