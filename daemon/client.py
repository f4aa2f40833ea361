"""Talking to a running daemon: ``kvstrata status`` and ``kvstrata prefetch`` (standard library only)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from .state import DaemonError, read_state

TIMEOUT_S = 5.0


def daemon_url(state_dir: Path) -> str:
    """The HTTP address a running daemon wrote into its state file."""
    state = read_state(state_dir)
    if not state or not state.get("url"):
        raise DaemonError(f"no daemon state in {state_dir} (is `kvstrata daemon` running with this config?)")
    if state.get("state") == "stopped":
        raise DaemonError(f"the daemon of {state_dir} has stopped (pid {state.get('pid')})")
    return str(state["url"])


def _request(url: str, data: bytes | None = None) -> Any:
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT_S) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            return json.loads(exc.read())
        except ValueError:
            raise DaemonError(f"{url}: HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise DaemonError(f"cannot reach the daemon at {url}: {getattr(exc, 'reason', exc)}") from None


def fetch_status(url: str) -> dict[str, Any]:
    data = _request(url.rstrip("/") + "/status")
    if not isinstance(data, dict):
        raise DaemonError(f"{url}/status: unexpected answer")
    return data


def post_prefetch(url: str, namespace: str, keys: list[bytes]) -> dict[str, Any]:
    body = json.dumps({"ns": namespace, "keys": [k.hex() for k in keys]}).encode()
    data = _request(url.rstrip("/") + "/prefetch", body)
    if not isinstance(data, dict) or "error" in data:
        raise DaemonError(f"{url}/prefetch: {data.get('error') if isinstance(data, dict) else data}")
    return data
