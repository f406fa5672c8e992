"""Fresh worker processes and the progress bar of the ROK sweep (private module of :mod:`tba.rok`)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Any

from tba.rok import _worker

__all__ = ["Interrupted", "Progress", "Runner", "raise_interrupted"]

MMAP_THRESHOLD = 64 * 1024


class Interrupted(Exception):
    pass


def raise_interrupted(signum: int, frame: Any) -> None:
    raise Interrupted(f"interrupted by signal {signum}")


class Runner:
    """Runs jobs in fresh processes forked from a forkserver with torch preloaded."""

    def __init__(self, device: str, log_dir: Path) -> None:
        if device == "cpu":  # inherited by the forkserver, hence by every worker (see the header)
            os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
            os.environ.setdefault("MALLOC_TRIM_THRESHOLD_", str(MMAP_THRESHOLD))
        methods = multiprocessing.get_all_start_methods()
        self.ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        if self.ctx.get_start_method() == "forkserver":
            self.ctx.set_forkserver_preload(["torch", "transformers.models.gpt2.modeling_gpt2", "tba", "tba.plan",
                                             "tba.rok._worker"])
        self.log_dir = log_dir

    def run(self, kind: str, spec: dict[str, Any], timeout_s: float, log_name: str) -> dict[str, Any]:
        spec = dict(spec, log_path=str(self.log_dir / log_name))
        recv, send = self.ctx.Pipe(duplex=False)
        # typeshed's BaseContext (what get_context(str) returns) lacks Process; every context has it.
        proc = self.ctx.Process(  # type: ignore[attr-defined]
            target=_worker.child_main, args=(send, kind, spec), daemon=True)
        proc.start()
        send.close()
        done = False
        try:
            if recv.poll(timeout_s):
                result, done = recv.recv(), True
            else:
                result = {"status": f"failed: timeout after {timeout_s:.0f} s"}
        except EOFError:
            proc.join(5)
            code = proc.exitcode
            why = (f"killed by signal {-code}" + (" (out of memory?)" if code == -9 else "")
                   if code is not None and code < 0 else f"exited with code {code}")
            result = {"status": f"failed: worker {why}; see {spec['log_path']}"}
        finally:
            if done:
                proc.join(30)
            if proc.is_alive():
                proc.kill()
            proc.join()
            recv.close()
            log = Path(spec["log_path"])
            if log.exists() and log.stat().st_size == 0:  # nothing to say: no file
                log.unlink()
        return result


class Progress:
    """The sweep's progress on stderr: a tqdm bar with each finished sample's line above it on
    a terminal; elsewhere (a log, CI) one line per sample with the count and elapsed time."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm  # the bench extra; _cli checks it is there

            self.bar = tqdm(total=total, unit="sample", file=sys.stderr, dynamic_ncols=True, leave=False,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}] {postfix}")

    def start(self, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label)

    def finish(self, line: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
            self.bar.update(1)
        else:
            elapsed = time.perf_counter() - self.t0
            sys.stderr.write(f"[{self.done}/{self.total} {elapsed:4.0f}s] {line}\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
