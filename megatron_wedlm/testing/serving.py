"""The real server (``inference/serve.py``) in a process of its own on loopback, for tests and
benchmarks, talked to over HTTP only; :func:`write_tiny_chat_model` is enough for every property
that needs no trained model.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from megatron_wedlm.runtime.multiprocess import find_free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVE = REPO_ROOT / "inference" / "serve.py"
#: a minimal chat template (the tiny tokenizer has none): role tags, then the reply's start
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_tiny_chat_model(directory: str | Path, seed: int = 3, arch: str = "qwen2") -> Path:
    """A tiny random WeDLM checkpoint (mask token in its config) with a chat template; ``arch``:
    a family of :func:`~megatron_wedlm.testing.tiny_models.build_tiny_model` (qwen2, qwen3, qwen3_moe)."""
    from megatron_wedlm.testing.tiny_models import build_tiny_model, build_tiny_tokenizer

    directory = Path(directory)
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    build_tiny_model(tokenizer, arch=arch, seed=seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


class ManagedServer:
    """``command``, an HTTP server on loopback ``port`` in its own process; a context manager. Entering
    waits for ``/health`` 200 (an exit first raises, naming ``log``); leaving sends SIGTERM (to the
    process group with ``group``, for servers with worker children), waits, then kills."""

    def __init__(self, command: list[str], port: int, log: str | Path, *, env: dict[str, str] | None = None,
                 startup_timeout: float = 180.0, group: bool = False):
        self.command, self.port, self.env, self.group = command, port, env or {}, group
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = Path(log)
        self.startup_timeout = startup_timeout
        self.process: subprocess.Popen | None = None

    def __enter__(self):
        self._log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                        cwd=REPO_ROOT, start_new_session=self.group)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log_text()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=10.0):
                    return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"the server did not answer /health in {self.startup_timeout} s:\n{self.log_text()}")

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, then wait (SIGKILL after ``timeout``); returns the exit status."""
        if self.process is None:
            return None
        if self.process.poll() is None or self.group:  # a group's children may outlive its leader
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def _signal(self, sig: int) -> None:
        try:
            if self.group:
                os.killpg(self.process.pid, sig)
            else:
                self.process.send_signal(sig)
        except ProcessLookupError:  # gone already
            pass

    def log_text(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def rss_bytes(self) -> int:
        """Resident memory of the server process."""
        import psutil

        return psutil.Process(self.process.pid).memory_info().rss


class ServerProcess(ManagedServer):
    """``inference/serve.py --model MODEL ARGS`` on a free loopback port (:class:`ManagedServer`):
    leaving the block sends SIGTERM, on which the server drains."""

    def __init__(self, model: str | Path, *args: str, log: str | Path, startup_timeout: float = 180.0,
                 python: str = sys.executable):
        port = find_free_port()
        super().__init__([python, str(SERVE), "--model", str(model), "--port", str(port), *args], port, log,
                         startup_timeout=startup_timeout)

    def get(self, path: str, timeout: float = 10.0) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout) as response:
            return json.loads(response.read())
