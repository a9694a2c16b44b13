"""The one build setting pyproject.toml cannot say: the top-level `configs/` ships as `disttrain/configs`.

Researchers find and commit configs at the top of the repo (beside `disttrain/`), and the wheel
must still carry them inside the package, where `disttrain.config.compose.config_dir()` finds them
with no checkout. That takes `package_dir={"disttrain.configs": "configs"}` plus `disttrain.configs`
in the package list. pyproject.toml can hold either a package list written out by hand
(`packages = [...]`: a new subpackage, or a new config group, would silently be missing from the
wheel) or `packages.find` (which cannot add a package from another folder). This file keeps
discovery for both and adds the mapping; metadata and package data stay in pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

# Every folder is listed as a package, data-only ones too (configs/strategy, disttrain/data/text):
# setuptools warns about data in an importable-looking folder that is not in `packages`.
SKIP = ["*__pycache__*"]
CONFIGS = [f"disttrain.configs.{g}" for g in find_namespace_packages(where="configs", exclude=SKIP)]

setup(
    packages=[*find_namespace_packages(include=["disttrain*"], exclude=SKIP), "disttrain.configs", *CONFIGS],
    package_dir={"disttrain.configs": "configs"},
)
