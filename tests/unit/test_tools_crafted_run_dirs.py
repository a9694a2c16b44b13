"""`runs`, `show`, `compare` and `--plot` on run dirs someone else made (reliability review
2026-11-25, D8-D11, D21): crafted values are data, never shell text, rich markup, terminal escapes or
a traceback; a FIFO or /dev/zero never hangs them; one bad run never hides the others."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml
from unit_support import disttrain_in_process

from disttrain.config import compose, resolve

pytestmark = pytest.mark.timeout(120)

METRICS = [
    {"step": 10, "time": 1.0, "train/loss": 0.9},
    {"step": 20, "time": 2.0, "train/loss": 0.7, "val/loss": 0.6, "val/acc": 0.75},
    {"step": 30, "time": 3.0, "train/loss": 0.5, "val/loss": 0.5, "val/acc": 0.8},
]
STATUS = {"status": "finished", "started": 1_700_000_000.0, "ended": 1_700_000_060.0, "host": "h", "pid": 9}


@pytest.fixture(scope="module")
def config_text() -> str:
    return yaml.safe_dump(resolve(compose([])), sort_keys=False)


def make_run(folder: Path, config_text: str, **files: str | bytes) -> Path:
    """A finished run dir written by hand, as disttrain writes one; `files` replace or add files."""
    folder.mkdir(parents=True)
    base = {
        "config.yaml": config_text,
        "overrides.yaml": yaml.safe_dump(["trainer.max_steps=30"]),
        "command.txt": "disttrain train trainer.max_steps=30\n",
        "metrics.jsonl": "".join(json.dumps(r) + "\n" for r in METRICS),
        "status.json": json.dumps(STATUS),
        "env.json": json.dumps({"started": 1_700_000_000.0}),
        "git.json": json.dumps({"repo": "/src/my repo", "sha": "0123abc", "dirty": False}),
    }
    for name, text in {**base, **files}.items():
        (folder / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    return folder


def cli(*args: str, cwd: Path) -> str:
    """stdout of an in-process `disttrain ARGS`; an exception escaping it fails the test."""
    proc = disttrain_in_process(*args, cwd=cwd)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout


def line(out: str, prefix: str) -> str:
    [found] = [ln for ln in out.splitlines() if ln.startswith(prefix)]
    return found


def test_d8_the_rerun_line_quotes_every_word_and_leaves_out_a_sha_that_is_not_one(
    tmp_path: Path, config_text: str
) -> None:
    """git.json `sha: "HEAD; touch PWNED #"` printed `git checkout HEAD; touch ...` unquoted in the
    command the docs say to run; the line stays one physical line however long the path."""
    deep = tmp_path / ("a-long-folder-name-" * 6) / "run with space"
    good = make_run(deep, config_text)
    out = cli("show", str(good), cwd=tmp_path)
    assert line(out, "rerun:") == (
        f"rerun:     cd '/src/my repo' && git checkout 0123abc && disttrain rerun '{good}'"
    )
    crafted = make_run(
        tmp_path / "craft1",
        config_text,
        **{"git.json": json.dumps({"repo": "/tmp", "sha": "HEAD; touch /tmp/PWNED_show #", "dirty": True})},
    )
    out = cli("show", str(crafted), cwd=tmp_path)
    assert line(out, "rerun:") == f"rerun:     disttrain rerun {crafted}"
    assert "left out: git.json: sha = 'HEAD; touch /tmp/PWNED_show #' is not a commit SHA" in out
    data = json.loads(cli("show", str(crafted), "--json", cwd=tmp_path))
    assert data["rerun"] == f"disttrain rerun {crafted}" and "touch" not in data["rerun"]


def test_d9_markup_and_escape_codes_from_a_run_dir_print_as_plain_text(
    tmp_path: Path, config_text: str
) -> None:
    """`[mlflow]` vanished as a style tag, `[/data/a.npz,...]` and `finished[/bold]` raised
    MarkupError, and ESC sequences (clear screen, window title, hidden text) reached the terminal."""
    command = "disttrain train 'observe.sinks=[mlflow]' '+data.train.paths=[/data/a.npz,/data/b.npz]'\n"
    legit = make_run(
        tmp_path / "runs" / "legit",
        config_text,
        **{
            "command.txt": command,
            "overrides.yaml": yaml.safe_dump(
                ["observe.sinks=[mlflow]", "+data.train.paths=[/data/a.npz,/data/b.npz]"]
            ),
        },
    )
    out = cli("show", str(legit), cwd=tmp_path)
    assert line(out, "command:") == (
        "command:   disttrain train 'observe.sinks=[mlflow]' '+data.train.paths=[/data/a.npz,/data/b.npz]'"
    )
    assert line(out, "recompose:").endswith(
        "'observe.sinks=[mlflow]' '+data.train.paths=[/data/a.npz,/data/b.npz]'"
    )
    status = {
        **STATUS,
        "status": "failed",
        "error": "boom \x1b[2J\x1b]0;owned-title\x07\x1b[8mHIDDEN\x1b[0m end",
    }
    escapes = make_run(tmp_path / "runs" / "esc", config_text, **{"status.json": json.dumps(status)})
    bold = make_run(
        tmp_path / "runs" / "bold",
        config_text,
        **{"status.json": json.dumps({**STATUS, "status": "finished[/bold]"})},
    )
    shows = [cli("show", str(escapes), cwd=tmp_path), cli("compare", str(legit), str(bold), cwd=tmp_path)]
    listing = cli("runs", str(tmp_path / "runs"), cwd=tmp_path)
    for out in [*shows, listing]:
        assert "\x1b" not in out and "\x07" not in out
    assert (
        line(shows[0], str(escapes)) == f"{escapes}  status: failed (boom [2J]0;owned-title[8mHIDDEN[0m end)"
    )
    assert "status 'finished[/bold]' is not one of running, finished, failed, interrupted" in shows[1]
    assert "3 runs under" in listing and "bold: status.json: status 'finished[/bold]'" in listing


def crafted_cases(config_text: str) -> dict[str, dict[str, str | bytes]]:
    """The review's D10 table: one changed file per run (each was a traceback)."""
    cfg = yaml.safe_load(config_text)
    metric = "".join(json.dumps(r) + "\n" for r in METRICS)
    deep = "[" * 100_000 + "]" * 100_000
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 9)}]\n" for i in range(8)
    )
    return {
        "strategy_str": {"config.yaml": yaml.safe_dump({**cfg, "strategy": "ddp"})},
        "nodes_abc": {"config.yaml": yaml.safe_dump({**cfg, "nodes": "abc"})},
        "nodes_list": {"config.yaml": yaml.safe_dump({**cfg, "nodes": [1]})},
        "config_latin1": {"config.yaml": b"name: caf\xe9\n"},
        "config_alias_bomb": {"config.yaml": bomb},
        "config_list": {"config.yaml": "- 1\n- 2\n"},
        "metrics_scalars": {"metrics.jsonl": "5\n[1,2]\n" + metric},
        "metrics_bad_step": {"metrics.jsonl": metric + '{"step": "abc", "train/loss": 1}\n{"step": 1e400}\n'},
        "metrics_no_step": {"metrics.jsonl": metric + '{"train/loss": 0.1}\n'},
        "metrics_str_value": {"metrics.jsonl": metric + '{"step": 31, "val/acc": "high"}\n'},
        "metrics_deep": {"metrics.jsonl": metric + deep + "\n"},
        "started_yesterday": {"status.json": json.dumps({**STATUS, "started": "yesterday"})},
        "started_huge": {"status.json": json.dumps({**STATUS, "started": 1e20})},
        "started_nan": {"status.json": '{"status": "finished", "started": NaN, "ended": 5}'},
        "pid_huge": {
            "status.json": json.dumps(
                {**STATUS, "status": "running", "host": os.uname().nodename, "pid": 2**70}
            )
        },
        "env_started_x": {"status.json": "", "env.json": json.dumps({"started": "x"})},
        "git_list": {"git.json": "[1]"},
        "overrides_nested": {"overrides.yaml": "[1, [2], {a: 1}]\n"},
    }


EXPECTED = {  # the line naming what was left out, per case
    "strategy_str": "config.yaml: strategy = 'ddp' is not a strategy block with a name",
    "nodes_abc": "config.yaml: nodes = 'abc', nproc_per_node = 2: not a world size",
    "nodes_list": "config.yaml: nodes = [1], nproc_per_node = 2: not a world size",
    "config_latin1": "config.yaml: not UTF-8 text: not read",
    "config_alias_bomb": "config.yaml: not read (a YAML alias (*a) is not read here)",
    "config_list": "config.yaml: a list, not a mapping: not read",
    "metrics_scalars": "metrics.jsonl: 2 record(s) skipped (line 1: a int, not an object; line 2: a list, not",
    "metrics_bad_step": "metrics.jsonl: 2 record(s) skipped (line 4: step 'abc' is not a step number; line 5: step inf",
    "metrics_no_step": "metrics.jsonl: 1 record(s) skipped (line 4: step None is not a step number)",
    "metrics_str_value": "metrics.jsonl: 1 record(s) skipped (line 4: 'val/acc' = 'high' is not a number)",
    "metrics_deep": "metrics.jsonl: 1 record(s) skipped (line 4: not JSON)",
    "started_yesterday": "status.json: started = 'yesterday' is not valid: left out",
    "started_huge": "status.json: started = 1e+20 is not valid: left out",
    "started_nan": "status.json: started = nan is not valid: left out",
    "pid_huge": "status.json: pid = 1180591620717411303424 is not valid: left out",
    "env_started_x": "env.json: started = 'x' is not a time: left out",
    "git_list": "git.json: a list, not a mapping: not read",
    "overrides_nested": "overrides.yaml: 3 entr(ies) not key=value text, e.g. 1: left out",
}


def test_d10_crafted_values_are_skipped_and_named_and_one_bad_run_never_breaks_the_listing(
    tmp_path: Path, config_text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each case of the review's table was a traceback in show/compare/runs; `runs` of a folder
    with one of them failed for the whole folder (--json too)."""
    from disttrain.tools import runs as tool

    defaults = yaml.safe_load(config_text)  # composing today's defaults per `show` is not under test
    monkeypatch.setattr(tool, "default_config", lambda run_dir, files=None: defaults)
    folder = tmp_path / "many"
    ref = make_run(folder / "ref", config_text)
    runs = {
        name: make_run(folder / name, config_text, **files)
        for name, files in crafted_cases(config_text).items()
    }
    (runs["env_started_x"] / "status.json").unlink()
    for name, run in runs.items():
        out = cli("show", str(run), cwd=tmp_path)
        assert f"left out: {EXPECTED[name]}" in out, (name, out)
        assert EXPECTED[name] in "\n".join(
            json.loads(cli("show", str(run), "--json", cwd=tmp_path))["problems"]
        )
    shown = json.loads(cli("show", str(runs["metrics_bad_step"]), "--json", cwd=tmp_path))
    assert shown["run"]["step"] == 30 and shown["run"]["best_val"] == {
        "metric": "val/acc",
        "value": 0.8,
        "step": 30,
    }
    assert shown["run"]["strategy"] == "ddp" and shown["run"]["world_size"] == 2
    compared = cli("compare", str(ref), str(runs["strategy_str"]), cwd=tmp_path)
    assert f"b: left out: {EXPECTED['strategy_str']}" in compared
    listing = json.loads(cli("runs", str(folder), "--json", cwd=tmp_path))
    rows = {Path(r["run_dir"]).name: r for r in listing["runs"]}
    assert set(rows) == {"ref", *runs} and rows["ref"]["problems"] == []
    assert (
        rows["started_yesterday"]["status"] == "finished" and rows["started_yesterday"]["duration_s"] is None
    )
    assert rows["pid_huge"]["status"] == "running"  # no pid to check: not called dead
    table = cli("runs", str(folder), cwd=tmp_path)
    assert (
        f"{len(rows)} runs under {folder}" in table and f"strategy_str: {EXPECTED['strategy_str']}" in table
    )


def test_d10_a_run_that_cannot_be_read_at_all_is_listed_as_unreadable(
    tmp_path: Path, config_text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever slips past the checks raises inside that run's row only."""
    from disttrain.tools import runs

    folder = tmp_path / "runs"
    make_run(folder / "good", config_text)
    make_run(folder / "odd", config_text)
    real = runs.run_info

    def run_info(run_dir: Path) -> dict:
        if run_dir.name == "odd":
            raise RuntimeError("something unforeseen\nsecond line")
        return real(run_dir)

    monkeypatch.setattr(runs, "run_info", run_info)
    rows = {
        Path(r["run_dir"]).name: r
        for r in json.loads(cli("runs", str(folder), "--json", cwd=tmp_path))["runs"]
    }
    assert rows["good"]["status"] == "finished" and rows["odd"]["status"] == "unreadable"
    assert rows["odd"]["problems"] == ["unreadable: RuntimeError: something unforeseen"]
    assert "odd: unreadable: RuntimeError: something unforeseen" in cli("runs", str(folder), cwd=tmp_path)


def test_d11_a_fifo_or_dev_zero_never_hangs_or_fills_memory(
    tmp_path: Path, config_text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mkfifo metrics.jsonl/status.json blocked show/compare/runs forever; a symlink to /dev/zero
    read without bound. Only regular files are read, size-capped."""
    folder = tmp_path / "runs"
    fifo = make_run(folder / "fifo", config_text)
    for name in ("metrics.jsonl", "status.json"):
        (fifo / name).unlink()
        os.mkfifo(fifo / name)
    zero = make_run(folder / "zero", config_text)
    (zero / "metrics.jsonl").unlink()
    (zero / "metrics.jsonl").symlink_to("/dev/zero")
    (zero / "env.json").unlink()
    (zero / "env.json").symlink_to("/dev/zero")
    out = cli("show", str(fifo), cwd=tmp_path)
    assert "left out: metrics.jsonl: not a regular file (a FIFO): not read" in out
    assert "left out: status.json: not a regular file (a FIFO): not read" in out
    out = cli("compare", str(fifo), str(zero), cwd=tmp_path)
    assert "b: left out: metrics.jsonl: a symbolic link (only regular files are read): not read" in out
    rows = json.loads(cli("runs", str(folder), "--json", cwd=tmp_path))["runs"]
    assert [r["status"] for r in rows] == ["unknown", "finished"]

    from disttrain.tools import rundata

    big = make_run(folder / "big", config_text, **{"summary.json": "{}" + " " * (2 << 20)})
    monkeypatch.setattr(rundata, "METRICS_CAP", 100)
    data = json.loads(cli("show", str(big), "--json", cwd=tmp_path))
    assert "metrics.jsonl: larger than 100 bytes: only its first 100 bytes read" in data["problems"]
    assert "summary.json: larger than 1 MiB (disttrain writes a few KB): not read" in data["problems"]
    assert data["run"]["step"] == 10  # the records within the cap


def test_d21_plot_labels_are_text_not_mathtext(tmp_path: Path, config_text: str) -> None:
    """A run dir named `x$\\frac{$` raised matplotlib's ParseSyntaxException."""
    pytest.importorskip("matplotlib")
    from disttrain.tools.plot import series

    a = make_run(tmp_path / "ref", config_text)
    b = make_run(tmp_path / "pl" / "x$\\frac{$", config_text)
    proc = disttrain_in_process("compare", str(a), str(b), "--plot", str(tmp_path / "p.png"), cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert (tmp_path / "p.png").stat().st_size > 5000
    (b / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in METRICS) + "[1]\n")
    proc = disttrain_in_process("show", str(b), "--plot", str(tmp_path / "p.png"), cwd=tmp_path)
    assert f"{b}: metrics.jsonl: 1 record(s) skipped (line 4: a list, not an object)" in proc.stderr
    drawn = series([a, b])
    # the runs' name and, both alike, their folders: drawn as written, not as mathtext
    assert set(drawn["train/loss"]) == {"default · ref", "default · x\\$\\frac{\\$"}
