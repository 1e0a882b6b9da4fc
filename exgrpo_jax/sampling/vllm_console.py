"""What vLLM prints on a run's console, kept to what a user can act on.

vLLM logs every start-up step at INFO to stdout. `quiet()` (called before vLLM is
imported) sends its records to one stderr handler at WARNING (`VLLM_LOGGING_LEVEL`
chooses another level), and drops the warnings that are expected under this engine's
own choices, each named in `EXPECTED` with the reason it is harmless here:

  chunked prefill       the engine turns it off on CPU on purpose (vllm_engine.py)
  Triton / V2 runner    the CPU install removes triton, which has no CPU backend
  SSM cache type        a Mamba setting; these are Llama/Qwen2 models
  global random seed    the engine seeds vLLM; no code here draws from Python's random
  LD_PRELOAD            tcmalloc / iomp are optional speed-ups (docs/vllm.md)
  set_num_threads       vLLM's CPU worker binds its threads itself, once per call
  Failed to load        RotaryEmbedding has no weights and the tied LM head is the
                        embedding: the engine writes both itself after vLLM's load

Anything else vLLM warns about is printed. `VLLM_CONFIGURE_LOGGING=1` (vLLM's own
console setup) or `VLLM_LOGGING_LEVEL=INFO` shows everything. A line from torch's C++
("NUMA binding: Using MEMBIND policy") cannot be filtered from Python and stays.
"""

import logging
import os
import sys
import warnings

EXPECTED = (
    "This model does not officially support disabling chunked prefill",
    "Triton is not installed",
    "Triton not available",  # torch's own line
    "Model Runner V2 requires Triton",
    "Reset SSM cache type",
    "The global random seed is set to",
    "is not found in LD_PRELOAD",
    "CPU backend doesn't allow to use `torch.set_num_threads`",
    "RotaryEmbedding: Failed to load weights",
    "ParallelLMHead: Failed to load weights",
)
# torch, imported by vLLM, says triton is absent too; and vLLM's own code calls a
# deprecated torch name.
_TORCH_TRITON_LOGGER = "torch._library.triton"
_REDUCE_OP_DEPRECATION = r"`torch.distributed.reduce_op` is deprecated"


class DropExpected(logging.Filter):
  """Drops the records whose message contains an `EXPECTED` text."""

  def filter(self, record: logging.LogRecord) -> bool:
    message = record.getMessage()
    return not any(text in message for text in EXPECTED)


def quiet(environ=os.environ) -> None:
  """Routes vLLM's log records through `DropExpected` to stderr (before vLLM is
  imported; idempotent). Leaves vLLM's own console setup alone if it was asked for."""
  environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
  if environ.setdefault("VLLM_CONFIGURE_LOGGING", "0") != "0":
    return
  logger = logging.getLogger("vllm")
  if not any(isinstance(f, DropExpected) for h in logger.handlers for f in h.filters):
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[vllm] %(levelname)s %(message)s"))
    handler.addFilter(DropExpected())
    logger.addHandler(handler)
  logger.setLevel(environ["VLLM_LOGGING_LEVEL"].upper())
  logger.propagate = False  # not again through absl's root handler
  triton = logging.getLogger(_TORCH_TRITON_LOGGER)
  if not any(isinstance(f, DropExpected) for f in triton.filters):
    triton.addFilter(DropExpected())
  warnings.filterwarnings("ignore", message=_REDUCE_OP_DEPRECATION, category=FutureWarning)
