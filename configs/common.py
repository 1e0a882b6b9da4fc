"""Shared config blocks; every model config starts from `base_config()`.

Defaults are the paper's (SPEC section 2, reference section 3). Variants (`:arg`):

  exgrpo       the default ExGRPO run
  onpolicy     rho = 0: the on-policy Dr.GRPO baseline
  no_qsel      uniform bucket weights (no question selection)
  no_tsel      random trajectory instead of lowest entropy
  high_ent     highest-entropy trajectory
  no_shaping   plain clipped ratio on replayed tokens (no f(w) = w / (w + gamma))
  no_is        behaviour log-probs replaced by the current step's (no IS correction)
  rho25, rho75 experience ratio 0.25 / 0.75
"""

import ml_collections

VARIANTS = ("exgrpo", "onpolicy", "no_qsel", "no_tsel", "high_ent", "no_shaping", "no_is",
            "rho25", "rho75")


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()

  # Model: a local HF directory or .gguf ("" = the embedded SmolLM2), or random init.
  c.model = ml_collections.ConfigDict(dict(
      path="",
      tokenizer="",          # "" = the model path's tokenizer
      random_init=False,     # tiny test models: random weights of `arch`
      arch=ml_collections.ConfigDict(dict(hidden_size=64, intermediate_size=128,
                                          num_layers=2, num_heads=4, num_kv_heads=2,
                                          head_dim=16)),
      dtype="bfloat16",
      param_dtype="float32",
      remat="full",
      attention="auto",      # auto | xla | blockwise | cudnn | splash (models/attention.py)
  ))

  c.data = ml_collections.ConfigDict(dict(
      train_path="",
      template="chat",        # chat | exgrpo_think | plain
      max_prompt_tokens=1024,
      limit=0,                # use only the first N training rows (0 = all)
      skip_bad_rows=False,
  ))

  c.rollout = ml_collections.ConfigDict(dict(
      engine="jax",           # jax | vllm
      k=8,                    # K rollouts per question
      temperature=1.0,
      top_p=1.0,
      top_k=0,
      max_new_tokens=8192,
      max_rows=0,             # jax engine: most rows per generate call, 0 = all (KV cache bound)
  ))

  c.reward = ml_collections.ConfigDict(dict(
      name="",                # "" = chosen per data_source
      num_workers=4,
      timeout_s=10.0,
      plugins="",             # comma-separated modules that register custom rewards
  ))

  c.algo = ml_collections.ConfigDict(dict(
      loss="exgrpo",          # exgrpo | grpo
      advantage="group_mean", # group_mean (Dr.GRPO) | group_std
      rho=0.5,                # experience ratio
      delayed_start=0.35,     # replay switches on once batch accuracy exceeds this
      clip_eps=0.2,
      clip_after_delayed_start=False,  # the paper removes clipping in the mixed phase
      shaping_gamma=0.1,      # f(w) = w / (w + gamma); None = no policy shaping
      aggregation="token_sum_norm",
      norm_len=8192,          # the constant L_max the token sum is divided by
      entropy_coeff=0.001,
      is_correction=True,     # False: behaviour log-probs := current step's
      trajectory_selection="lowest_entropy",  # | highest_entropy | random
  ))

  c.replay = ml_collections.ConfigDict(dict(
      k=c.rollout.get_ref("k"),
      mu=0.5,
      sigma=0.125,            # accuracy units = 1/K: the reference's count-unit sd of 1
      weighting="gaussian",   # gaussian | uniform
      max_per_question=0,
      max_total=0,
  ))

  c.optim = ml_collections.ConfigDict(dict(
      lr=1e-6, weight_decay=0.01, b1=0.9, b2=0.999, eps=1e-8,
      grad_clip=1.0,
      skip_grad_norm=500.0,   # skip (and count) steps whose grad norm exceeds this
      mini_batches=2,         # optimizer steps per training step
      micro_batch_size=8,     # responses per forward/backward
  ))

  c.train = ml_collections.ConfigDict(dict(
      steps=700,
      batch_questions=128,    # B
      seed=0,
      log_every=1,
      checkpoint_every=50,
      keep_checkpoints=2,
      logprob_chunk=512,      # sequence chunk for log-prob/entropy (memory bound)
      packing=True,           # learner/scoring pack responses into rows (False: one per row)
      export_dir="hf",        # final policy as an HF directory under the workdir ("" = no)
  ))

  c.eval = ml_collections.ConfigDict(dict(
      path="",
      every=10,               # 0 = never
      limit=0,
      temperature=0.6,
      max_new_tokens=8192,
      n=1,
  ))

  # Device mesh (exgrpo_jax.sharding): sizes over named axes (data, fsdp, tensor), one
  # size may be -1 (all remaining devices). Weights are FSDP-sharded over `fsdp` and
  # tensor-parallel over `tensor`; batches split over `data` and `fsdp`.
  c.mesh = ml_collections.ConfigDict(dict(shape=(-1, 1), axes=("fsdp", "tensor")))
  return c


def apply_variant(c: ml_collections.ConfigDict, variant: str) -> ml_collections.ConfigDict:
  """Applies one of VARIANTS (the paper's Table 6 ablations) to config `c`."""
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
  if variant == "onpolicy":
    c.algo.rho = 0.0
    c.algo.loss = "grpo"
    c.algo.clip_after_delayed_start = True
  elif variant == "no_qsel":
    c.replay.weighting = "uniform"
  elif variant == "no_tsel":
    c.algo.trajectory_selection = "random"
  elif variant == "high_ent":
    c.algo.trajectory_selection = "highest_entropy"
  elif variant == "no_shaping":
    c.algo.shaping_gamma = None
    c.algo.clip_after_delayed_start = True
  elif variant == "no_is":
    c.algo.is_correction = False
  elif variant in ("rho25", "rho75"):
    c.algo.rho = int(variant[3:]) / 100
  return c


def parse_arg(arg: str | None) -> tuple[str, bool]:
  """'variant' or 'variant,runlocal' -> (variant, runlocal)."""
  parts = [p for p in (arg or "").split(",") if p]
  runlocal = "runlocal" in parts
  rest = [p for p in parts if p != "runlocal"]
  if len(rest) > 1:
    raise ValueError(f"config arg {arg!r}: give at most one variant (and 'runlocal')")
  return (rest[0] if rest else "exgrpo"), runlocal


def paper_config(arg, *, model_path: str, template: str, steps: int, delayed_start: float,
                 mesh_shape=(-1, 1), max_rows=0) -> ml_collections.ConfigDict:
  """The paper's GPU recipe for one backbone (8 GPUs, B=128, K=8, 8192 new tokens).

  The model configs take `mesh_shape` and `max_rows` (`rollout.max_rows`, rows per
  generate call) from scripts/memory_plan.py for 8 x 80 GiB GPUs; BUILD.md ("Memory
  plan") gives the flags for TPU slices.

  `runlocal` in `arg` shrinks batch and lengths for a quick smoke run of the same model.
  """
  variant, runlocal = parse_arg(arg)
  c = base_config()
  c.model.path = model_path  # a local HF directory; override with --config.model.path=...
  c.data.train_path = "data/openr1_math_46k.parquet"
  c.data.template = template
  c.eval.path = "../shared/data/exgrpo_valid.parquet"
  c.train.steps = steps
  c.algo.delayed_start = delayed_start
  c.mesh.shape = mesh_shape
  c.rollout.max_rows = max_rows
  if runlocal:
    c.train.batch_questions = 8
    c.rollout.max_new_tokens = 512
    c.algo.norm_len = 512
    c.eval.limit = 64
  return apply_variant(c, variant)
