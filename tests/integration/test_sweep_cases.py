"""tests/integration/sweep.py's case files compose to exactly what the runs' command lines compose
to (in this process: no rank starts), for runs of the folded modules that cover every kind of
override they use: config group choices, options, null, lists, `+` keys, a later value replacing an
earlier one (~0.5 s a pair, so a sample, not every run)."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from disttrain.config import compose

from . import (
    test_clients,
    test_engine_depth,
    test_resume,
    test_strategies_dp,
    test_strategies_mp,
    test_user_code,
)
from .sweep import case_yaml

RUNS = {
    "dp-ddp": (*test_strategies_dp.COMMON, *test_strategies_dp.RUNS["ddp"]),
    "dp-ddp_fp16": (*test_strategies_dp.COMMON, *test_strategies_dp.RUNS["ddp_fp16"]),
    "mp-interleaved": (*test_strategies_mp.COMMON, *test_strategies_mp.RUNS["pipeline-interleaved_1f1b"]),
    "depth-fp16_overflow": test_engine_depth.RUNS["fp16_overflow"],
    "depth-gpt-fsdp+tp": test_engine_depth.RUNS["gpt-fsdp+tp"],
    "resume-async": (*test_resume.RUN, *test_resume.FIRST["async"]),
    "user-net-spawn": test_user_code.RUNS["net-spawn"],
    "user-groups-zero": test_user_code.RUNS["groups-zero"],
    # a mapping whose keys hold dots and wildcards (strategy.tp_plan patterns)
    **({"clients-xt-tp": test_clients.RUNS["xt-tp"]} if test_clients.HAS_XT else {}),
}


@pytest.mark.parametrize("name", list(RUNS))
def test_case_file_composes_like_the_command_line(tmp_path: Path, name: str) -> None:
    (tmp_path / "case").mkdir()
    (tmp_path / "case" / "j0.yaml").write_text(case_yaml(RUNS[name]))
    by_file = compose(["+case=j0"], str(tmp_path))
    by_line = compose(list(RUNS[name]))
    assert OmegaConf.to_container(by_file) == OmegaConf.to_container(by_line)
