r"""Trains a policy with ExGRPO.

  python -m exgrpo_jax.train --config=configs/smollm2_135m.py --workdir=runs/smollm2 \
      [--config.train.steps=20 --config.algo.rho=0.25 ...]

`--config=FILE.py:ARG` picks a variant (configs/common.py lists them). The config is
locked: an unknown key fails instead of being silently added. Re-running with the same
workdir resumes from its latest checkpoint.
"""

import os
import sys

from absl import app
from absl import flags
from ml_collections import config_flags


def _make_config_files_importable(argv):
  """Config files import `configs.common`; put their repository root on sys.path."""
  for arg in argv:
    if arg.startswith("--config="):
      path = arg.split("=", 1)[1].split(":", 1)[0]
      sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(path))))


_make_config_files_importable(sys.argv)
_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, logs).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  from exgrpo_jax.training import trainer  # pylint: disable=g-import-not-at-top
  trainer.Trainer(_CONFIG.value, _WORKDIR.value).run()


if __name__ == "__main__":
  app.run(main)
