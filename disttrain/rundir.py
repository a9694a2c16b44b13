"""The run directory: the frozen config and everything needed to reproduce the run from it."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from disttrain.safefile import open_append, remove_unfinished, write_atomic

if TYPE_CHECKING:
    from disttrain.config.run import Run

CONFIG = "config.yaml"
JOB = "job.json"  # an eval/predict job folder (disttrain.eval_worker)
HISTORY = "commands.txt"
STATUS = "status.json"


@dataclass(frozen=True)
class RunDir:
    """The layout of a run dir, in one place: `RunDir(path).summary`, `.checkpoints`, `.rank_log(3)`.

    The parent writes config.yaml (resolved once), overrides.yaml, command.txt, commands.txt,
    git.json (git.diff) and status.json; rank 0 writes env.json, metrics.jsonl, trackers.json and
    summary.json; every rank its logs/rankN.log and its checkpoint shards.
    """

    path: Path

    @classmethod
    def of(cls, path: Path | str | RunDir) -> RunDir:
        return path if isinstance(path, RunDir) else cls(Path(path))

    def is_run(self) -> bool:
        """A run dir holds the frozen config (Hydra's own .hydra/ copy is not one, nor the job
        folder of a `disttrain eval`/`predict`, which holds job.json beside it: it trained nothing)."""
        return self.config.is_file() and self.path.name != ".hydra" and not (self.path / JOB).is_file()

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def overrides(self) -> Path:
        return self.path / "overrides.yaml"

    @property
    def command(self) -> Path:
        return self.path / "command.txt"

    @property
    def history(self) -> Path:
        return self.path / HISTORY

    @property
    def git(self) -> Path:
        return self.path / "git.json"

    @property
    def git_diff(self) -> Path:
        return self.path / "git.diff"

    @property
    def status(self) -> Path:
        return self.path / STATUS

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def trackers(self) -> Path:
        return self.path / "trackers.json"

    @property
    def env(self) -> Path:
        return self.path / "env.json"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank{rank}.log"

    @property
    def checkpoints(self) -> Path:
        """The default place of checkpoints (`checkpoint.dir` may put them elsewhere: shared_dir)."""
        return self.path / "checkpoints"


def write_json(path: Path, data: Any) -> None:
    _write_text(path, json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")


MAX_CONFIG_NODES = 20_000  # a config has hundreds of mappings and lists; YAML aliases can nest billions


def _shape(cfg: Any) -> str | None:
    """Why `cfg` is not a tree of plain values, or None. YAML aliases make a list that holds itself
    (`a: &x [*x]`: the trust check's walk ended in a RecursionError traceback) or nest copies of copies
    (nine levels of nine expand to 387 million nodes: the walk never ends)."""
    stack: list[tuple[Any, frozenset[int]]] = [(cfg, frozenset())]
    nodes = 0
    while stack:
        value, above = stack.pop()
        if not isinstance(value, dict | list):
            continue
        if id(value) in above:
            return "it holds a mapping or list inside itself (a YAML alias within its own anchor)"
        nodes += 1
        if nodes > MAX_CONFIG_NODES:
            return f"it expands to over {MAX_CONFIG_NODES} mappings and lists (nested YAML aliases)"
        inner = above | {id(value)}
        stack.extend((child, inner) for child in (value.values() if isinstance(value, dict) else value))
    return None


def read_config(run_dir: Path) -> dict[str, Any]:
    """The frozen, fully resolved config: plain YAML, no interpolation left to re-resolve.
    A config.yaml that is not a YAML mapping (edited, truncated, a planted file) is a ConfigError."""
    from disttrain.config.errors import ConfigError

    try:
        with (run_dir / CONFIG).open(encoding="utf-8") as f:
            cfg = yaml.safe_load(f)
        problem = (
            f"it holds a {type(cfg).__name__}, not a mapping" if not isinstance(cfg, dict) else _shape(cfg)
        )
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        problem = f"it is not YAML text ({str(exc).splitlines()[0]})"
    if problem is not None:
        raise ConfigError(
            "RUN_DIR",
            str(run_dir),
            "a run dir whose config.yaml is the mapping of keys disttrain froze there",
            f"{problem}: it was edited or is not disttrain's; restore it, or train a new run.",
        )
    return cfg


def freeze(run_dir: Path, run: Run, overrides: list[str], argv: list[str]) -> None:
    """Write config.yaml (resolved once), overrides.yaml, the command line and the git state.

    command.txt keeps the command that created the run; commands.txt lists every command that
    froze into it (`disttrain resume RUN ...` included), one per line."""
    run_dir.mkdir(parents=True, exist_ok=True)
    rd = RunDir(run_dir)
    _write_text(rd.config, yaml.safe_dump(run.to_dict(), sort_keys=False))
    _write_text(rd.overrides, yaml.safe_dump(list(overrides)))
    if not rd.command.exists():  # the command that made the run stays as it was
        _write_text(rd.command, shlex.join(argv) + "\n")
    with open_append(rd.history) as f:  # every command that froze into it, resumes included
        f.write(shlex.join(argv) + "\n")
    from disttrain.trust import sign

    sign(run_dir)  # resume and rerun later build this config only if it is still the one written here
    git = git_state(Path.cwd())
    write_json(rd.git, git)
    if git.get("dirty"):  # the uncommitted changes the run used, for `git apply` after a checkout
        _write_text(rd.git_diff, git_diff(Path.cwd()))


def _write_text(path: Path, text: str) -> None:
    """Atomic replace through a fresh, randomly named temp file (O_EXCL): the nodes of a
    multi-node run write the same files into one run dir on a shared file system and must not
    rename each other's, and a symlink planted at a predictable temp name is never followed."""
    write_atomic(path, text.encode("utf-8"))


# git reads the repo's own config: a repo someone else prepared could name a program to run as its
# fsmonitor or hooks. disttrain only asks for the SHA, the dirty flag and the diff: none of that.
GIT = ("git", "-c", "core.fsmonitor=false", "-c", "core.hooksPath=/dev/null")


def git_state(directory: Path) -> dict[str, Any]:
    """SHA and dirty flag of the repo containing `directory`, if any."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(
                [*GIT, *args], cwd=directory, capture_output=True, text=True, timeout=10, check=True
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip()

    found = git("rev-parse", "--show-toplevel", "HEAD")  # one process: the top level, then the SHA
    if found is None or len(found.splitlines()) != 2:
        return {"repo": None, "sha": None, "dirty": None}
    repo, sha = found.splitlines()
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"repo": repo, "sha": sha, "dirty": bool(status)}


def program() -> list[str]:
    """How the user started disttrain: `python -m disttrain` (argv[0] is disttrain's __main__.py), or
    `disttrain`: the console script, and the shell command that does what `disttrain.cli.main` did
    when another program called it (`python -c`, a notebook, a test runner)."""
    path = Path(sys.argv[0])
    if path.name == "__main__.py" and path.parent.name == "disttrain":
        return [Path(sys.executable).name, "-m", "disttrain"]
    return ["disttrain"]


def git_diff(directory: Path) -> str:
    """`git diff HEAD` (tracked files, staged or not) of the repo containing `directory`."""
    try:
        out = subprocess.run(
            [*GIT, "diff", "--no-ext-diff", "--no-textconv", "HEAD"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout


def command_line() -> list[str]:
    return [*program(), *sys.argv[1:]]


@contextmanager
def run_status(run_dir: Path) -> Iterator[None]:
    """status.json: `running` while the ranks run, then finished, failed (with the error) or interrupted.

    Written by the parent that launches the ranks, so a crash of any rank is still recorded.
    """
    import time

    base = {"started": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
    write_json(run_dir / STATUS, {"status": "running", **base})
    end: dict[str, Any] = {"status": "finished"}
    try:
        yield
    except BaseException as exc:
        # Ctrl-C, torchrun's agent turning SIGINT/SIGTERM into SignalException, or a LaunchError
        # whose ranks stopped on a signal (exit code 128 + signal number)
        signalled = (
            isinstance(exc, KeyboardInterrupt)
            or type(exc).__name__ == "SignalException"
            or getattr(exc, "exit_code", 0) > 128
        )
        error = getattr(exc, "error", None) or (str(exc).splitlines() or [type(exc).__name__])[0]
        end = {"status": "interrupted" if signalled else "failed", "error": error or type(exc).__name__}
        if getattr(exc, "rank", None) is not None:
            end["rank"] = exc.rank  # type: ignore[attr-defined]
        if signalled and not isinstance(exc, KeyboardInterrupt) and getattr(exc, "sigval", None) == 2:
            raise KeyboardInterrupt from None  # Ctrl-C reaches the CLI as Ctrl-C: "interrupted", exit 130
        raise
    finally:
        if end["status"] != "finished":  # the ranks are gone: a write they began will not end
            remove_unfinished(run_dir)
        write_json(run_dir / STATUS, {**base, **end, "ended": time.time()})


# ------------------------------------------------------------------------- claiming a run dir
def check_path(run_dir: Path) -> None:
    """A run dir path is one line of printable text (it goes into scripts, logs, command lines)."""
    from disttrain.config.errors import ConfigError

    text = str(run_dir)
    if not text.isprintable():
        raise ConfigError(
            "hydra.run.dir",
            repr(text),
            "a path without control characters (newline, tab, escape)",
            "choose a plain folder name, e.g. hydra.run.dir=runs/my-run.",
        )


def _unusable(run_dir: Path, error: OSError) -> Exception:
    from disttrain.config.errors import ConfigError

    return ConfigError(
        "hydra.run.dir",
        str(run_dir),
        "a folder this user can create and write",
        f"{error.strerror or error} ({type(error).__name__}); choose another place, e.g. "
        "hydra.run.dir=runs/my-run (relative to the cwd).",
    )


def claim(run_dir: Path) -> Path:
    """Create `run_dir` exclusively, or, if another invocation already has it (two runs started in
    the same second with the same name), the first free `run_dir-1`, `run_dir-2`, ... Two
    invocations never share a run dir, so neither trains or freezes the other's config."""
    check_path(run_dir)
    try:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        for i in range(10_000):
            candidate = run_dir if i == 0 else run_dir.with_name(f"{run_dir.name}-{i}")
            try:
                candidate.mkdir()
            except FileExistsError:
                continue
            _probe_writable(candidate, created=True)
            from disttrain.owner import hold

            hold(candidate, candidate, "hydra.run.dir", "run dir")  # a resume racing this run waits its turn
            return candidate
    except OSError as exc:
        raise _unusable(run_dir, exc) from None
    raise _unusable(run_dir, FileExistsError(f"{run_dir}-1 .. -9999 all exist"))


def reuse(run_dir: Path, run: Run, shared: bool = False) -> Path:
    """An explicit `hydra.run.dir=PATH`: continue in it (resume=auto), but only with the same config
    and never while another launcher still runs there. `shared`: several nodes launch into it."""
    from disttrain.config.errors import ConfigError

    check_path(run_dir)
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        _probe_writable(run_dir, created)
    except OSError as exc:
        raise _unusable(run_dir, exc) from None
    if shared:
        return run_dir  # several nodes launch into one shared run dir: each node's launcher owns it
    from disttrain.owner import hold

    hold(run_dir, run_dir, "hydra.run.dir", "run dir")  # before the checks: no check-then-act race
    if (run_dir / CONFIG).is_file():
        refuse_if_running(run_dir, "hydra.run.dir")
        saved = read_config(run_dir)
        changed = changed_keys(saved, run.to_dict())
        if changed and read_status(run_dir).get("status") == "finished":
            shown = ", ".join(changed[:5]) + (", ..." if len(changed) > 5 else "")
            raise ConfigError(
                "hydra.run.dir",
                str(run_dir),
                f"a new folder, or a finished run's own config (this one changes {shown})",
                f"the run there finished with other settings; its weights and summary would no longer "
                f"match config.yaml. Continue it with `disttrain resume {run_dir} KEY=VALUE`, or train "
                "into a new folder (leave hydra.run.dir unset).",
            )
    return run_dir


def _probe_writable(run_dir: Path, created: bool) -> None:
    """Root ignores permission bits and /proc refuses files: try a real file, then remove it."""
    import tempfile

    try:
        fd, name = tempfile.mkstemp(prefix=".probe.", dir=run_dir)
        os.close(fd)
        os.unlink(name)
    except OSError:
        if created:
            with contextlib.suppress(OSError):
                run_dir.rmdir()
        raise


def changed_keys(saved: dict[str, Any], cfg: dict[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ (`resume` is how to start, not what is trained)."""
    keys = []
    for k in sorted(set(saved) | set(cfg), key=str):
        path = f"{prefix}{k}"
        if path == "resume":
            continue
        a, b = saved.get(k), cfg.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += changed_keys(a, b, f"{path}.")
        elif a != b:
            keys.append(path)
    return keys


def read_status(run_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((run_dir / STATUS).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def record_orphaned(run_dir: Path, launcher: int, what: str) -> None:
    """A rank's last word when its launcher died (SIGKILL: it could not record it): status.json
    must not stay `running`. Nothing to do while the launcher lives: it writes the status itself."""
    import logging
    import time

    from disttrain.procs import launcher_alive

    if launcher_alive(launcher):
        return
    status = read_status(run_dir)
    if status.get("status") != "running" or status.get("pid") != launcher:
        return
    status.update(
        status="interrupted", error=f"the launcher (pid {launcher}) died; {what}", ended=time.time()
    )
    write_json(run_dir / STATUS, status)
    logging.getLogger("disttrain").warning(
        "the launcher (pid %d) is gone: %s says interrupted", launcher, run_dir / STATUS
    )


def running_pid(run_dir: Path) -> int | None:
    """The pid of the launcher still running this run on this host (status.json `running`)."""
    status = read_status(run_dir)
    pid = status.get("pid")
    if status.get("status") != "running" or not isinstance(pid, int) or pid == os.getpid():
        return None
    if isinstance(pid, bool) or not 0 < pid < 2**31:  # os.kill raised OverflowError on 2**70
        import logging

        logging.getLogger("disttrain").warning(
            "%s says running with pid %s, which is no process id: taken as not running", run_dir / STATUS, pid
        )
        return None
    if status.get("host") != socket.gethostname():
        return None  # another host: its pid means nothing here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None  # died without updating status.json (SIGKILL): safe to continue
    except PermissionError:
        pass  # alive, another user's
    return pid


def refuse_if_running(run_dir: Path, key: str) -> None:
    from disttrain.config.errors import ConfigError

    pid = running_pid(run_dir)
    if pid is not None:
        raise ConfigError(
            key,
            str(run_dir),
            "a run that is not running now",
            f"process {pid} on this host is still training it (status.json: running); wait for it, "
            f"or stop it (kill -TERM {pid} saves a checkpoint) and then `disttrain resume {run_dir}`.",
        )


# The folders disttrain writes into, prunes or cleans inside a run dir (rank logs, checkpoint
# shards and keep-N, TensorBoard events, profiler traces, `export`'s default output).
OWN_FOLDERS = ("checkpoints", "logs", "tensorboard", "profile", "export")


def planted_links(run_dir: Path, cfg: dict[str, Any] | None = None) -> dict[str, str]:
    """{folder: link target} for each of the run dir's own folders that is a symbolic link.

    A run dir someone sent, or one copied with `cp -a`, may carry a link such as
    `checkpoints -> ../other_run/checkpoints`: followed, keep-N and the `.tmp-*` cleanup would
    delete the other run's checkpoints. `checkpoints` is exempt when `checkpoint.dir` names a
    folder explicitly: the run then never uses `<run dir>/checkpoints`.
    """
    block = cfg.get("checkpoint") if cfg else None  # a foreign config may lack it: no link exempted
    explicit = isinstance(block, dict) and bool(block.get("dir"))
    found = {}
    for name in OWN_FOLDERS:
        path = run_dir / name
        if path.is_symlink() and not (explicit and name == "checkpoints"):
            found[name] = os.readlink(path)
    return found


def refuse_planted_links(run_dir: Path, key: str, cfg: dict[str, Any] | None = None) -> None:
    """A ConfigError naming the first of the run dir's own folders that is a symbolic link."""
    from disttrain.config.errors import ConfigError

    links = planted_links(run_dir, cfg)
    if not links:
        return
    name, target = next(iter(links.items()))
    keep = (
        f" To keep checkpoints there on purpose, set checkpoint.dir={target}."
        if name == "checkpoints"
        else ""
    )
    raise ConfigError(
        key,
        str(run_dir),
        f"a run dir whose {', '.join(f'{n}/' for n in OWN_FOLDERS)} are real folders",
        f"{name}/ is a symbolic link to {target}: disttrain writes, prunes and deletes inside these "
        f"folders and never follows a link planted there; replace the link with a folder "
        f"(rm {shlex.quote(str(run_dir / name))}).{keep}",
    )
