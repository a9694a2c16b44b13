"""docs/config-reference.md is the schema's: regenerated here, it must equal the page on disk, list
every key a composition holds, and a schema key without a help text must stop the generator."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from disttrain.config import compose
from disttrain.config.common import help_field
from disttrain.config.keyhelp import key_rows
from disttrain.tools import configref


@pytest.fixture(scope="module")
def page() -> str:
    return configref.render()


def test_the_checked_in_page_is_the_generated_one(page: str) -> None:
    assert configref.PAGE.read_text() == page, f"docs/config-reference.md is stale: run {configref.COMMAND}"


def test_every_key_of_a_composed_config_has_a_described_line(page: str) -> None:
    """The default composition (what `disttrain config --help` lists, via Hydra) against the page
    (built without Hydra's composition): each leaf key has its own row with a description."""
    rows = key_rows(compose(["strategy=fsdp", "model=gpt"]))
    lines = {ln.split(" | ")[0].strip("| `"): ln for ln in page.splitlines() if ln.startswith("| `")}
    missing = [key for key, kind, _, _ in rows if kind != "group" and key not in lines]
    assert not missing and len(rows) > 100, missing
    assert all(
        lines[key].rstrip(" |").rsplit(" | ", 1)[1].strip() for key, kind, _, _ in rows if kind != "group"
    )


def test_a_schema_key_without_help_stops_the_generator() -> None:
    @dataclass
    class Block:
        described: int = help_field("what it does", 1)
        bare: int = 2

    node = OmegaConf.structured(Block)
    with pytest.raises(configref.UndescribedKey, match=r"no help text for block\.bare:"):
        configref.option_rows(node, {}, "block")

    @dataclass
    class Described:
        described: int = help_field("what it does", 1)

    rows = configref.option_rows(OmegaConf.structured(Described), {"described": 3}, "blk")
    assert rows == [("blk.described", "int", "3", "what it does")]


def test_check_fails_on_a_stale_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, page: str) -> None:
    stale = tmp_path / "config-reference.md"
    stale.write_text(page.replace("| `trainer.max_steps` |", "| `trainer.max_stepz` |"))
    monkeypatch.setattr(configref, "PAGE", stale)
    monkeypatch.setattr(configref, "render", lambda: page)
    assert configref.main(["--check"]) == 1
    stale.write_text(page)
    assert configref.main(["--check"]) == 0
