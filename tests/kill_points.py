"""Runs a command of this repository that stops at a named point, so that a test can SIGKILL it there (not collected
by pytest). The product has no hook: this wrapper patches one function, then runs the command as `python` would.

    python tests/kill_points.py POINT READY_FILE -m training.regenerate --out ...
    python tests/kill_points.py POINT READY_FILE -m training.run_trainer ...

At POINT the process creates READY_FILE and sleeps; the test kills it then ([`run_until_killed`]). A process that is
not killed exits with status 3 after `PAUSE_SECONDS`, so nothing is left behind. The points:

- `rows=K` (regeneration): once K answered rows are counted, K inside a shard: that shard is half answered.
- `shard-write=N` (regeneration): while shard N's file is half written (its temporary file holds half the rows).
- `manifest=N` (regeneration): once shard N's file is in place, before `progress.json` records it.
- `save=N` (training): while `checkpoint-N` is half written: weights, optimizer and scheduler saved; RNG state,
  trainer state and the completeness marker not.
- `step=N` (training): as step N + 1 starts, every checkpoint up to step N complete.
"""

import os
import runpy
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAUSE_SECONDS = 120


def pause(ready: Path) -> None:
    ready.write_text(str(os.getpid()))
    time.sleep(PAUSE_SECONDS)
    os._exit(3)


def install(point: str, ready: Path) -> None:
    name, _, value = point.partition("=")
    number = int(value)
    if name in ("rows", "shard-write", "manifest"):
        from training import answers

        if name == "rows":
            update, counted = answers._Progress.update, [0]

            def counting_update(self, rows: int, tokens: int) -> None:
                update(self, rows, tokens)
                counted[0] += rows
                if counted[0] >= number:
                    pause(ready)

            answers._Progress.update = counting_update
        elif name == "shard-write":
            write_atomic, shard = answers._write_atomic, f"shard-{number:05d}.jsonl"

            def half_write(path: Path, text: str) -> None:
                if path.name != shard:
                    return write_atomic(path, text)
                with open(path.with_name(f".{path.name}.tmp"), "w", encoding="utf-8") as f:  # as _write_atomic
                    f.write(text[: len(text) // 2])
                pause(ready)

            answers._write_atomic = half_write
        else:
            write_manifest, shard = answers._write_manifest, f"shard-{number:05d}.jsonl"

            def late_manifest(out_dir, settings, shards, *args):
                if shards and shards[-1]["file"] == shard:
                    pause(ready)
                return write_manifest(out_dir, settings, shards, *args)

            answers._write_manifest = late_manifest
    elif name == "save":
        from transformers import Trainer

        save_rng_state = Trainer._save_rng_state

        def half_saved(self, output_dir: str) -> None:
            if Path(output_dir).name == f"checkpoint-{number}":
                pause(ready)
            return save_rng_state(self, output_dir)

        Trainer._save_rng_state = half_saved
    elif name == "step":
        from transformers import Trainer

        training_step = Trainer.training_step

        def stepping(self, *args, **kwargs):
            if self.state.global_step == number:
                pause(ready)
            return training_step(self, *args, **kwargs)

        Trainer.training_step = stepping
    else:
        raise ValueError(f"expected a kill point rows=K, shard-write=N, manifest=N, save=N or step=N, got {point!r}")


def run_until_killed(point: str, command: list[str], folder: Path, env: dict, timeout: float = 300) -> str:
    """Runs `command` (`["-m", module, ...]` or `[script, ...]`) stopped at `point`, SIGKILLs it there, and returns
    its output; fails if it ends or does not reach the point within `timeout` seconds."""
    ready, log = folder / f"ready-{point}", folder / f"log-{point}.txt"
    with open(log, "w") as output:
        process = subprocess.Popen(
            [sys.executable, str(Path(__file__)), point, str(ready), *command],
            cwd=REPO,
            env=env,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout
    try:
        while not ready.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"expected the command to reach {point}, it "
                    f"{'ended' if process.poll() is not None else 'did not in time'}:\n"
                    f"{log.read_text()[-4000:]}"
                )
            time.sleep(0.05)
    finally:
        os.kill(process.pid, signal.SIGKILL)  # our own child, by its id
        process.wait()
    assert process.returncode == -signal.SIGKILL, process.returncode
    return log.read_text()


if __name__ == "__main__":
    point, ready, *command = sys.argv[1:]
    sys.path.insert(0, str(REPO))
    install(point, Path(ready))
    if command[0] == "-m":
        sys.argv = [command[1], *command[2:]]
        runpy.run_module(command[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = command
        runpy.run_path(command[0], run_name="__main__")
