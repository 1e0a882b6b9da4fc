r"""Trains a policy with ExGRPO.

  python -m exgrpo_jax.train --config=configs/smollm2_135m.py --workdir=runs/smollm2 \
      [--config.train.steps=20 --config.algo.rho=0.25 ...]

`--config=FILE.py:ARG` picks a variant (configs/common.py lists them). The config is
locked: an unknown key fails, naming the closest valid one, instead of being silently
added. `--print_config` prints the config as resolved (flags applied, model.path found)
as JSON, as the workdir's config.json holds it, and exits without starting a run. Where
`model.path` is not on disk, the copy of `model.hub_id` that `python -m exgrpo_jax.fetch`
put in the Hugging Face cache is read (exgrpo_jax/models/hub.py). Re-running with the
same workdir resumes from its newest intact checkpoint; a change the checkpoint cannot
follow (K, the model, the data, the seed) is refused, and other changes to what the run
computes are taken with a warning (exgrpo_jax/training/resume_check.py).

Exit status (exgrpo_jax/cli.py): 0 done, 1 an error (one line; --debug shows the
traceback), 2 a bad flag, config key or config value (one line naming it), 75
preempted by SIGTERM or Ctrl-C after checkpointing the last complete step (rerun to
resume), 130 interrupted during start-up or by a second Ctrl-C.

Multi-host: run the same command on every host. TPU pods and SLURM are detected; else
pass --coordinator_address=HOST:PORT --num_processes=N --process_id=I (or set
JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); see exgrpo_jax.distributed.
"""

import json
import sys

from absl import app
from absl import flags
from absl import logging
from ml_collections import config_flags

from exgrpo_jax import cli
from exgrpo_jax import config_cli
from exgrpo_jax.models import hub


config_cli.make_config_files_importable(sys.argv)
_CONFIG = config_flags.DEFINE_config_file("config", None, "Training config file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (checkpoints, logs).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "Multi-process runs: HOST:PORT of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Multi-process runs.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "Multi-process runs: this process.")
_DEBUG = flags.DEFINE_bool("debug", False, "Show an error's traceback instead of one line.")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False,
                                  "Print the resolved config as JSON and exit (no run).")
flags.mark_flags_as_required(["config"])


def main(argv):
  del argv  # the flags parser refused any positional argument
  # Orbax logs every checkpoint step at INFO; keep the console to our progress line
  # unless the user asks for more with --verbosity.
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)

  def train() -> int:
    hub.use_cached(_CONFIG.value)
    if _PRINT_CONFIG.value:
      print(json.dumps(_CONFIG.value.to_dict(), indent=2, sort_keys=True, default=str))
      return 0
    if not _WORKDIR.value:
      raise cli.UsageError("--workdir is required (or --print_config)")
    # Before anything touches a JAX device.
    from exgrpo_jax import distributed  # pylint: disable=g-import-not-at-top
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
    from exgrpo_jax import compile_cache  # pylint: disable=g-import-not-at-top
    compile_cache.enable(_CONFIG.value.train.compile_cache)
    from exgrpo_jax.aot import plan_step  # pylint: disable=g-import-not-at-top
    from exgrpo_jax.training import trainer  # pylint: disable=g-import-not-at-top
    run = trainer.Trainer(_CONFIG.value, _WORKDIR.value,  # validates the config first
                          estimate=plan_step.plan_estimate)
    run.run()
    return cli.EXIT_PREEMPTED if run.preempted else 0

  sys.exit(cli.guarded(train, debug=_DEBUG.value, prefix="exgrpo_jax.train"))


if __name__ == "__main__":
  app.run(main, flags_parser=config_cli.flags_parser(_CONFIG, "exgrpo_jax.train"))
