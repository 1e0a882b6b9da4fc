r"""Fetches a config's model (`model.hub_id`) into the Hugging Face cache and checks it.

  python -m exgrpo_jax.fetch --config=configs/qwen7b_lora.py [--config.key=value]

Downloads the files a run reads (config.json, the safetensors weights, the tokenizer)
with huggingface_hub, unless `model.path` already names a local copy, which is checked
instead. The check (exgrpo_jax/models/hub.py): the architecture and sizes of the
config.json the hub id was published with, its rope settings, room for the config's
responses in its positions, a tokenizer that loads, every weight tensor the model
reads. It prints what it found and where the copy is; a training run of the same config
reads it from there while `model.path` is not on disk, or takes
`--config.model.path=PATH`.

Gated models (Llama 3.1): accept the licence on the model's hub page, then log in
(`hf auth login`) or set HF_TOKEN. `HF_HUB_CACHE` moves the cache (default
~/.cache/huggingface/hub).

Exit status: 0 fetched (or found) and checked, 1 a download that failed or a copy that
fails a check (one line each), 2 a bad flag or a config that names no hub id.
"""

import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

from exgrpo_jax import cli
from exgrpo_jax import config_cli
from exgrpo_jax.models import hub

config_cli.make_config_files_importable(sys.argv)
_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.",
                                          lock_config=True)
_DEBUG = flags.DEFINE_bool("debug", False, "Show an error's traceback instead of one line.")
flags.mark_flags_as_required(["config"])
PREFIX = "exgrpo_jax.fetch"


def fetch(config) -> int:
  """Downloads (or finds) and checks the model of `config`; prints the report."""
  m = config.model
  local = bool(m.path) and os.path.isdir(m.path)
  if not local and not m.hub_id:
    raise cli.UsageError(f"config.model.hub_id='': names no model to fetch, and "
                         f"model.path={m.path!r} is no local copy; set "
                         "--config.model.hub_id=ORG/NAME")
  path = m.path if local else hub.download(m.hub_id)
  facts, problems = hub.verify(path, config)
  print(f"{m.hub_id or 'model.path'}: {os.path.abspath(path)}"
        + (" (model.path, on disk: nothing downloaded)" if local else ""))
  for line in facts:
    print(f"  {line}")
  for line in problems:
    cli.error(line, PREFIX)
  if problems:
    return cli.EXIT_ERROR
  if local:
    print("checked: a run of this config reads it")
  else:
    print(f"checked: a run of this config reads it while model.path={m.path} is not on "
          f"disk, or give --config.model.path={path}")
  return 0


def main(argv):
  del argv  # the flags parser refused any positional argument
  sys.exit(cli.guarded(lambda: fetch(_CONFIG.value), debug=_DEBUG.value,
                       prefix=PREFIX))


if __name__ == "__main__":
  app.run(main, flags_parser=config_cli.flags_parser(_CONFIG, PREFIX))
