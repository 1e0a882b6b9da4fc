"""Exports a model to a Hugging Face directory that transformers loads.

  python -m exgrpo_jax.convert --src PATH --dst HF_DIR [--dtype bfloat16]

PATH is a .gguf file, an HF directory, or one of our training workdirs / checkpoint
step directories (the latest step is used for a workdir). The tokenizer files are
copied along. A LoRA run's export also holds its adapter in PEFT's format, `adapter/`,
whose base is the run's `model.hub_id` or its base's local directory, or
`--adapter-base NAME_OR_PATH` (where the base is on the machine that serves it).
"""

import argparse
import os
import sys

import ml_collections

from exgrpo_jax import cli
from exgrpo_jax import models


def _load(src: str, dtype: str | None):
  """(ModelConfig, params, tokenizer source, adapter base) for any supported source."""
  from exgrpo_jax import checkpointing  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.training import lora_run  # pylint: disable=g-import-not-at-top
  if checkpointing.is_training_checkpoint(src):
    cfg, params, meta = checkpointing.load_for_export(src)
    base = lora_run.adapter_base(ml_collections.ConfigDict(meta["config"])) if (
        "lora_base" in meta) else ""
    return cfg, params, meta["tokenizer_source"], base
  if os.path.isdir(checkpointing.checkpoint_dir(src)):
    raise ValueError(f"{src}: a training workdir whose checkpoints/ holds no checkpoint "
                     "(its run stopped before the first one was written)")
  policy = models.from_pretrained(src, dtype=dtype or "float32")
  return policy.config, policy.params, src, ""


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m exgrpo_jax.convert",
                                   description=__doc__.split("\n\n")[0])
  parser.add_argument("--src", required=True,
                      help=".gguf file, HF directory, or exgrpo_jax workdir/checkpoint")
  parser.add_argument("--dst", required=True, help="output HF directory")
  parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                      help="tensor dtype to write (default: the source's)")
  parser.add_argument("--adapter-base", "--adapter_base", dest="adapter_base", default="",
                      help="a LoRA run's export: the hub id or path adapter/ names as its "
                      "base (default: the run's model.hub_id, else its base's directory)")
  cli.add_debug_flag(parser)
  args = parser.parse_args(argv)
  return cli.guarded(lambda: _convert(args), debug=args.debug)


def _convert(args) -> int:
  from exgrpo_jax import checkpointing  # pylint: disable=g-import-not-at-top
  if args.adapter_base and not checkpointing.is_lora_checkpoint(args.src):
    raise cli.UsageError(f"--adapter-base={args.adapter_base}: {args.src} is not a LoRA "
                         "run's workdir or checkpoint, so its export has no adapter")
  cfg, params, tokenizer_src, adapter_base = _load(args.src, args.dtype)
  # Written to a temporary sibling and renamed into place (models/export.py).
  models.save_pretrained(cfg, params, args.dst, dtype=args.dtype, tokenizer_src=tokenizer_src,
                         info={"source": os.path.abspath(args.src)},
                         adapter_base=args.adapter_base or adapter_base)
  print(f"wrote {args.dst} ({cfg.model_type}, {cfg.num_params() / 1e6:.1f}M parameters)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
