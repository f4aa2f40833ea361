"""The vLLM end-to-end runner's zygote (tests/vllm_e2e/zygote.py), without vLLM: a forked run
gets the run's environment (plus what the zygote's imports set), its own argv and session, its
exit code back, and nothing it started outlives it; a run past its timeout is killed."""

from __future__ import annotations

import json
import os
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from vllm_e2e import zygote

CHILD = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    sys.path.insert(0, {here!r})
    import zygote

    def imports():
        os.environ["SET_BY_IMPORT"] = "yes"
        os.environ.pop("REMOVED_BY_IMPORT", None)

    def child(args):
        spec = json.loads(open(args).read())
        leftover = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        out = {{
            "env": dict(os.environ), "argv": sys.argv, "pid": os.getpid(), "pgid": os.getpgid(0),
            "sid": os.getsid(0), "leftover": leftover.pid, "print": print("to the log") is None,
        }}
        open(spec["out"], "w").write(json.dumps(out))
        time.sleep(spec.get("sleep", 0))
        sys.exit(spec.get("code", 0))

    if __name__ == "__main__":
        zygote.serve(child, imports)
    """
)


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "child.py"
    path.write_text(CHILD.format(here=str(Path(zygote.__file__).parent)))
    return path


def job(tmp_path: Path, name: str, **spec: Any) -> tuple[Path, Path, Path]:
    args, out, log = tmp_path / f"{name}.json", tmp_path / f"{name}.out", tmp_path / f"{name}.log"
    args.write_text(json.dumps({"out": str(out), **spec}))
    return args, out, log


def gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True  # killed, waiting for init to reap it
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_forked_run_is_the_run_it_replaces(script: Path, tmp_path: Path) -> None:
    env = {**os.environ, "REMOVED_BY_IMPORT": "x", "XDG_CACHE_HOME": str(tmp_path / "z")}
    z = zygote.Zygote(script, env, tmp_path / "zygote.log")
    try:
        run_env = {**env, "XDG_CACHE_HOME": str(tmp_path / "run"), "VLLM_CPU_OMP_THREADS_BIND": "0"}
        args, out, log = job(tmp_path, "a", code=3)
        assert z.run(args, log, run_env, timeout=60) == (3, False)
        got = json.loads(out.read_text())
        want = {k: v for k, v in run_env.items() if k != "REMOVED_BY_IMPORT"} | {"SET_BY_IMPORT": "yes"}
        assert got["env"] == want
        assert got["argv"][1:] == [str(args)]
        assert got["pid"] == got["pgid"] == got["sid"] != z.proc.pid  # a session of its own
        assert log.read_text() == "to the log\n"
        assert gone(got["leftover"])  # what the run started does not outlive it

        args, out, log = job(tmp_path, "b", sleep=60)
        assert z.run(args, log, run_env, timeout=1)[1] is True
        assert gone(json.loads(out.read_text())["pid"])
    finally:
        z.close()
    assert z.proc.returncode == 0


def test_another_environment_gets_a_zygote_of_its_own(
    script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(zygote, "_current", None)
    env = dict(os.environ)
    args, out, log = job(tmp_path, "a")
    assert zygote.run_in_zygote(script, args, log, env, timeout=60) == (0, False)
    first = zygote._current
    args, out, log = job(tmp_path, "b")
    assert zygote.run_in_zygote(script, args, log, {**env, "XDG_CACHE_HOME": "/elsewhere"}, timeout=60)[0] == 0
    assert zygote._current is first  # a per-run variable: the same zygote
    args, out, log = job(tmp_path, "c")
    assert zygote.run_in_zygote(script, args, log, {**env, "PYTHONHASHSEED": "4242"}, timeout=60)[0] == 0
    second = zygote._current
    assert second is not None and second is not first and first is not None and first.proc.returncode == 0
    assert json.loads(out.read_text())["env"]["PYTHONHASHSEED"] == "4242"
    second.close()


class Interrupted(Exception):
    pass


def test_an_interrupted_wait_kills_the_run_and_closes_the_zygote(script: Path, tmp_path: Path) -> None:
    """Ctrl-C (here: an alarm) while a run is going: the run's group is killed, not left behind."""
    import signal

    z = zygote.Zygote(script, dict(os.environ), tmp_path / "zygote.log")
    args, out, log = job(tmp_path, "a", sleep=60)

    def interrupt(signum: int, frame: Any) -> None:
        if not out.exists():  # not started yet: once the run is under way
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            return
        raise Interrupted

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    try:
        with pytest.raises(Interrupted):
            z.run(args, log, dict(os.environ), timeout=120)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    got = json.loads(out.read_text())
    assert gone(got["pid"]) and gone(got["leftover"])
    assert not z.alive()
