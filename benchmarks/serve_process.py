"""A real ``taps serve`` subprocess for the public-tool benchmarks (``load_public.py``, ``lm_eval_lossless.py``):
a free loopback port, start and wait for ``/ready``, stop gracefully."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 10.0) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return json.loads(response.read())


def start_server(config: str, overrides: list[str], port: int, log: Path, within_s: float,
                 app_name: str = "taps-load-public") -> subprocess.Popen:
    """``taps serve CONFIG`` on ``port`` (its own local Ray cluster: ``RAY_ADDRESS`` is not passed on),
    once ``/ready`` says ready; RuntimeError (after stopping it) when it exits or is not ready in time."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "taps_ray.cli", "serve", config, "--host", "127.0.0.1", "--port", str(port),
           f"serve.app_name={app_name}", *overrides]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"taps serve exited ({proc.returncode}); see {log}")
        try:
            if get_json(f"http://127.0.0.1:{port}/ready").get("status") == "ready":
                return proc
        except (OSError, ValueError):
            pass
        time.sleep(1.0)
    stop(proc)
    raise RuntimeError(f"taps serve not ready within {within_s:g} s; see {log}")


def stop(proc: subprocess.Popen, grace_s: float = 120.0) -> None:
    """SIGINT the process we started (``taps serve`` deletes its application and its Ray cluster ends with
    it), SIGKILL it when it outlives ``grace_s``."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
