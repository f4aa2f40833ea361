"""A process that imports vLLM once and forks the parent process of every vLLM run from it.

A vLLM run (``runner.run_vllm``) is three processes: the runner's own (``python runner.py
args.json``, which builds the ``LLM``) and the engine-core and worker processes vLLM starts from
it with ``spawn`` (vLLM's CPU platform always uses spawn). Each imports torch and vLLM: on
2 cores that is 15-20 s per process. The zygote does the first of the three imports once per
test session: ``python runner.py --zygote`` imports what the runner's child imports, then for
every run forks a child that becomes exactly what ``python runner.py args.json`` would be: its
own session (process group), stdin from /dev/null, stdout and stderr to the run's log, the run's
environment, ``sys.argv``, and the same ``_child(args.json)``. The engine-core and worker
processes are still spawned afresh by vLLM from that child, so every run has its own new
engine core, worker, connector instances and KV caches; only the already-imported modules of the
frontend process are shared, never a vLLM object.

What an import changes in ``os.environ`` (torch inductor settings, a library path) is given to
every child on top of the run's environment, as a fresh import would leave it. A run whose
environment differs from the zygote's in anything but :data:`PER_RUN_VARS` (which only the
engine-core and worker processes read, after their own start) gets a zygote of its own
environment; ``VLLM_E2E_ZYGOTE=0`` (or a ``python=`` other than this interpreter) starts every run
as a fresh process instead.

Parent side: :func:`run_in_zygote`. Zygote side: :func:`serve` (called by ``runner.py --zygote``).
Both ways of starting a run wait and clean up with :func:`wait_no_reap` and :func:`kill_group`.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

#: Variables a run may set differently from the zygote: read only by vLLM's engine-core and
#: worker processes (spawned afresh per run) or by kvstrata in them, never at import time
#: (``PYTEST_CURRENT_TEST``, which pytest sets per test, is read by nothing here at all).
PER_RUN_VARS = frozenset({"VLLM_CPU_OMP_THREADS_BIND", "XDG_CACHE_HOME", "PYTEST_CURRENT_TEST"})

_READY = "zygote-ready"

#: What importing vLLM did to ``os.environ``: the variables it set or changed, those it removed.
ImportEnv = tuple[dict[str, str], list[str]]


def kill_group(pgid: int) -> None:
    """Kill what is left of a run's session (its engine-core and worker processes)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def wait_no_reap(pid: int, deadline: float) -> bool:
    """Wait until ``pid`` (a child of this process) exits, without reaping it; False if
    ``deadline`` passed first. While it is an unreaped zombie its id (its group's id) cannot be
    reused, so killing the group afterwards only hits what that run started."""
    while True:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is not None:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)


def enabled() -> bool:
    return os.environ.get("VLLM_E2E_ZYGOTE", "1") != "0"


def _env_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k not in PER_RUN_VARS))


class Zygote:
    """The parent's handle of one zygote process (started with the environment ``env``)."""

    def __init__(self, script: Path, env: Mapping[str, str], log: Path) -> None:
        self.key = _env_key(env)
        self.log = log
        with open(log, "ab") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, str(script), "--zygote"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=logf,
                env=dict(env),
                start_new_session=True,
                text=True,
            )
        line = self._read_line(time.monotonic() + 600)
        if line != _READY:
            self.close()
            raise RuntimeError(f"the vLLM zygote did not start ({line!r}); its log: {log}")

    def _read_line(self, deadline: float) -> str | None:
        import selectors

        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                return None
        line = self.proc.stdout.readline()
        return line.strip() if line else None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def run(self, args_path: Path, log: Path, env: Mapping[str, str], timeout: float) -> tuple[int | None, bool]:
        """(exit code, timed out) of one run; the zygote waits, and kills the run's group. If this
        side is interrupted meanwhile (Ctrl-C, a pytest timeout), the run's group is killed here
        and the zygote closed."""
        assert self.proc.stdin is not None
        job = {"args": str(args_path), "log": str(log), "env": dict(env), "timeout": timeout}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        started = self._read_line(time.monotonic() + 60)
        if started is None:
            self.close()
            raise RuntimeError(f"the vLLM zygote did not start the run; its log: {self.log}")
        pid = int(json.loads(started)["pid"])
        try:
            line = self._read_line(time.monotonic() + timeout + 60)
        except BaseException:
            kill_group(pid)
            self.close()
            raise
        if line is None:
            kill_group(pid)
            self.close()
            raise RuntimeError(f"the vLLM zygote stopped answering; its log: {self.log}")
        reply = json.loads(line)
        return reply["rc"], bool(reply["timed_out"])

    def close(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


_current: Zygote | None = None


def run_in_zygote(
    script: Path, args_path: Path, log: Path, env: Mapping[str, str], timeout: float
) -> tuple[int | None, bool]:
    """Run ``script``'s child for ``args_path`` in a process forked from the session's zygote
    (started, or restarted for another environment, as needed)."""
    global _current
    key = _env_key(env)
    if _current is not None and (_current.key != key or not _current.alive()):
        _current.close()
        _current = None
    if _current is None:
        zlog = log.parent / "zygote.log"
        _current = Zygote(script, env, zlog)
        atexit.register(_current.close)
    return _current.run(args_path, log, env, timeout)


# ----------------------------------------------------------------------------------------------
# Zygote side
# ----------------------------------------------------------------------------------------------


def _become_run(job: Mapping[str, Any], child: Callable[[str], None], import_env: ImportEnv) -> int:
    """In the forked child: turn into ``python runner.py ARGS`` and run it; the exit code."""
    os.setsid()
    fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    env = dict(job["env"])
    # As the import leaves them: the run's variables outside PER_RUN_VARS are the zygote's.
    changed, removed = import_env
    env.update({k: v for k, v in changed.items() if k not in PER_RUN_VARS})
    for k in removed:
        env.pop(k, None)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [sys.argv[0], job["args"]]
    try:
        child(job["args"])
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1


def _one(job: Mapping[str, Any], child: Callable[[str], None], import_env: ImportEnv, proto: IO[str]) -> dict[str, Any]:
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = _become_run(job, child, import_env)
        finally:
            # What a normal interpreter exit runs (vLLM's shutdown hooks among them), then out.
            with contextlib.suppress(BaseException):
                atexit._run_exitfuncs()
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    print(json.dumps({"pid": pid}), file=proto, flush=True)
    timed_out = not wait_no_reap(pid, time.monotonic() + float(job["timeout"]))
    kill_group(pid)  # what outlived the run: its engine core and worker, if any
    _, status = os.waitpid(pid, 0)
    return {"rc": os.waitstatus_to_exitcode(status), "timed_out": timed_out}


def serve(child: Callable[[str], None], imports: Callable[[], None]) -> None:
    """The zygote's main: ``imports()``, then one forked ``child(args)`` per job line on stdin,
    one reply line per job. Replies go to the original stdout; everything else to stderr."""
    proto: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    before = dict(os.environ)
    imports()
    import_env = (
        {k: v for k, v in os.environ.items() if before.get(k) != v},
        [k for k in before if k not in os.environ],
    )
    print(_READY, file=proto, flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(_one(json.loads(line), child, import_env, proto)), file=proto, flush=True)
