"""Shared config blocks; every model config starts from `base_config()`.

Defaults are the paper's (docs/algorithm.md §16). Values derived from
others are references, never copies: `replay.k` is `rollout.k` (an override of
`replay.k` alone is refused by config_check), `replay.sigma` is 1/K in accuracy units
and `algo.norm_len` is `rollout.max_new_tokens`; overriding a derived value detaches
it from its source (the source keeps its value).

Variants (`:arg`), the paper's Table 6 ablations, are the overrides in `VARIANTS`; the
paper configs also take `runlocal` (a quick smoke run) and `day` (`day_recipe`: a run
on a budget of wall time, checkpointed and exported by the hour).

Resuming a workdir with other values: K, the model, the data and `train.seed` are
refused; run length, logging, checkpoints, evaluation, mesh and engine settings change
freely; any other change (algorithm, replay, optimizer, sampling, reward) is taken with
a warning line per key (exgrpo_jax/training/resume_check.py).
"""

import dataclasses
import json
import math
import os

import ml_collections

from exgrpo_jax.aot import targets
from exgrpo_jax.data import arithmetic
from exgrpo_jax.data import rgym
from exgrpo_jax.models import lora
from exgrpo_jax.models import published
from exgrpo_jax.sampling import pages
from exgrpo_jax.training import padding

# name -> (overrides "section.key": value, what the variant is).
VARIANTS = {
    "exgrpo": ({}, "the default ExGRPO run"),
    "onpolicy": ({"algo.rho": 0.0, "algo.loss": "grpo", "algo.clip_after_delayed_start": True},
                 "rho = 0: the on-policy Dr.GRPO baseline (no buffer, nothing retired)"),
    "noreplay": ({"algo.rho": 0.0},
                 "rho = 0 with ExGRPO's loss: nothing replayed, but solved questions "
                 "retire and fresh tokens lose their clip after the delayed start"),
    "no_qsel": ({"replay.weighting": "uniform"}, "uniform bucket weights (no question "
                                                 "selection)"),
    "no_tsel": ({"algo.trajectory_selection": "random"},
                "random trajectory instead of lowest entropy"),
    "high_ent": ({"algo.trajectory_selection": "highest_entropy"},
                 "highest-entropy trajectory"),
    "no_shaping": ({"algo.shaping_gamma": None}, "plain clipped ratio on replayed tokens "
                                                 "(no f(w) = w / (w + gamma)); fresh tokens "
                                                 "as in exgrpo"),
    "no_is": ({"algo.is_correction": False},
              "behaviour log-probs replaced by the current step's (no IS correction)"),
    "rho25": ({"algo.rho": 0.25}, "experience ratio 0.25"),
    "rho75": ({"algo.rho": 0.75}, "experience ratio 0.75"),
}


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()

  # Model: a local HF directory or .gguf ("" = the embedded SmolLM2), or random init.
  c.model = ml_collections.ConfigDict(dict(
      path="",
      # The Hugging Face hub id of the model this config expects (docs/data.md, "Models"):
      # `python -m exgrpo_jax.fetch` downloads it; a run reads its cached copy where
      # `path` is not on disk, and refuses a model whose rope settings differ from its
      # published ones. "" = none expected.
      hub_id="",
      tokenizer="",          # "" = the model path's tokenizer
      random_init=False,     # tiny test models: random weights of `arch`
      arch=ml_collections.ConfigDict(dict(hidden_size=64, intermediate_size=128,
                                          num_layers=2, num_heads=4, num_kv_heads=2,
                                          head_dim=16)),
      dtype="bfloat16",
      param_dtype="float32",
      remat="full",
      attention="auto",      # auto | xla | blockwise | cudnn | splash (models/attention.py)
      # auto = highest for float32 compute (JAX's default is TF32 on NVIDIA GPUs), default
      # for bfloat16; default | high | highest force one (models/config.py)
      matmul_precision="auto",
      # Low-rank adapters (docs/lora.md): rank 0 = off, full fine-tuning. The update is
      # (alpha / rank) x A @ B on each target projection; base_quant: none (frozen base
      # in model.param_dtype) | int8 | nf4 (QLoRA: the layer projections quantized).
      lora=ml_collections.ConfigDict(dict(lora.DEFAULTS, targets=list(lora.TARGETS))),
  ))

  # Relative data paths: the working directory's where they exist there, else under `dir`;
  # "" = $EXGRPO_DATA_DIR, else ~/.cache/exgrpo_jax/data (where prepare_data writes).
  c.data = ml_collections.ConfigDict(dict(
      dir="",
      source="file",          # file (train_path) | arithmetic (generated, no files) | reasoning_gym
      train_path="",          # refused with another source (it would be ignored); so is eval.path
      template="chat",        # chat | exgrpo_think | plain
      max_prompt_tokens=1024,
      limit=0,                # use only the first N training rows (0 = all)
      skip_bad_rows=False,
      # The arithmetic source's size and difficulty (exgrpo_jax.data.arithmetic).
      arithmetic=ml_collections.ConfigDict(
          dataclasses.asdict(arithmetic.ArithmeticSettings())),
      # The reasoning_gym source's dataset and sizes (exgrpo_jax.data.rgym).
      reasoning_gym=ml_collections.ConfigDict(dataclasses.asdict(rgym.GymSettings())),
  ))

  c.rollout = ml_collections.ConfigDict(dict(
      engine="jax",           # jax | vllm
      k=8,                    # K rollouts per question
      temperature=1.0,
      top_p=1.0,
      top_k=0,
      max_new_tokens=8192,
      max_rows=0,             # jax engine: most rows per generate call, 0 = all (KV cache bound)
      # jax engine: continuous | static. continuous: rows beyond max_rows wait for a free
      # slot, and from 512 new tokens on the tail shrinks to the live rows (the same rows).
      scheduler="continuous",
      # jax engine, continuous: the KV pool's capacity in pages of 64 tokens (0 = every
      # slot's row at its longest). Below that, rows are admitted while pages are free and
      # the newest are preempted (recomputed later) when they run out; kv_headroom is the
      # share of pages kept free when admitting beside running rows.
      kv_pages=0,
      kv_headroom=pages.KV_HEADROOM,
      # vllm engine (exgrpo_jax/sampling/vllm_setup.py; docs/vllm.md, "Settings"); its
      # max_model_len is data.max_prompt_tokens + the longest max_new_tokens.
      vllm=ml_collections.ConfigDict(dict(
          gpu_memory_utilization=0.3,  # vLLM's share of each GPU (weights + KV cache)
          tensor_parallel_size=1,      # GPUs (one JAX process each) per vLLM instance
          sleep_level=2,               # after each rollout: 0 stay, 1 weights to CPU, 2 free
          max_num_seqs=256,            # sequences vLLM decodes at once
          enforce_eager=False,         # True: no CUDA graphs (less memory, slower)
          dtype="",                    # vLLM's compute dtype; "" = model.dtype
      )),
  ))

  c.reward = ml_collections.ConfigDict(dict(
      name="",                # "" = chosen per data_source
      num_workers=4,
      timeout_s=10.0,
      plugins="",             # comma-separated modules that register custom rewards
      correct_threshold=1.0,  # a response is correct when its reward is at least this
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
      # The constant L_max the token sum is divided by.
      norm_len=c.rollout.get_ref("max_new_tokens").identity(),
      entropy_coeff=0.001,
      is_correction=True,     # False: behaviour log-probs := current step's
      trajectory_selection="lowest_entropy",  # | highest_entropy | random
      # pi_old of fresh tokens and the behaviour log-probs stored in the buffer:
      # rollout (the sampler's), recompute (the learner's forward pass at temperature 1),
      # auto (recompute whenever the rollout's numerics differ from the learner's:
      # model.dtype != float32, an engine other than jax, or rollout.temperature != 1;
      # and whenever tis_cap is on).
      old_logp_source="auto",
      # Truncated importance sampling of the rollout/learner mismatch (docs/algorithm.md
      # §19; verl's tis_imp_ratio_cap, not in the paper): a cap C > 1 multiplies each
      # fresh token's loss by min(pi_old / pi_rollout, C), both at the rollout
      # temperature; 0 or None = off. Needs the recomputed pi_old (refused with
      # old_logp_source=rollout).
      tis_cap=0.0,
  ))

  c.replay = ml_collections.ConfigDict(dict(
      k=c.rollout.get_ref("k").identity(),
      mu=0.5,
      # Accuracy units, 1/K: the official code's count-unit sd of 1 (docs/algorithm.md §4).
      sigma=1.0 / c.rollout.get_ref("k").to_float(),
      weighting="gaussian",   # gaussian | uniform | proportional
      # correct_count: bucket = correct rollouts out of K; reward_std: the continuous-
      # reward variant: round(K x per-question reward std, min-max normalised per batch),
      # clipped into the stored buckets 1..K-1, so the batch's highest-variance question
      # is stored too; equal rewards (std 0) are not stored (replay/buckets.py).
      bucketing="correct_count",
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
      # Also a checkpoint (export) after the first step that ends this many minutes of
      # wall time after the last one or the start, whichever comes first; 0 = off.
      checkpoint_every_minutes=0.0,
      export_every_minutes=0.0,
      keep_checkpoints=2,
      logprob_chunk=512,      # sequence chunk for log-prob/entropy (memory bound)
      packing=True,           # learner/scoring pack responses into rows (False: one per row)
      # The learner's rows hold the batch's longest prompt rounded up to a multiple of
      # max(this, the next power of two / 8) (training/padding.py): finer buckets pad
      # short prompts less and compile the learner a few more times.
      prompt_bucket=padding.PROMPT_BUCKET,
      export_dir="hf",        # final policy as an HF directory under the workdir ("" = no)
      loggers="jsonl,tensorboard",  # comma-separated: jsonl | tensorboard | wandb
      compile_cache=True,     # JAX's persistent compilation cache (exgrpo_jax.compile_cache)
      # Hours of wall time within which the run stops, evaluated, checkpointed and
      # exported (training/budget.py); 0 = none. budget_plan: a plan JSON of
      # `python -m exgrpo_jax.aot plan` whose step estimate sizes it at the start.
      budget_hours=0.0,
      budget_plan="",
  ))

  c.eval = ml_collections.ConfigDict(dict(
      source="file",          # file (path) | arithmetic | reasoning_gym (held-out splits)
      path="",
      every=10,               # and at the last step; 0 = no evaluation unless before_train=True
      limit=0,
      subset="first",         # which eval.limit questions: first | spread (evenly over the file)
      temperature=0.6,
      max_new_tokens=8192,
      n=1,                    # samples per question: val/avg_score is avg@n
      greedy=False,           # also greedy accuracy (val/greedy_score) when temperature > 0
      # Step 0: None = when every > 0; True = also with every = 0 (how to ask for a
      # step-0 evaluation alone); False = never.
      before_train=ml_collections.config_dict.placeholder(bool),
      samples=4,              # completions logged per evaluation (eval_samples.jsonl)
  ))

  # Device mesh (exgrpo_jax.sharding): sizes over named axes (data, fsdp, tensor), one
  # size may be -1 (all remaining devices). Weights are FSDP-sharded over `fsdp` and
  # tensor-parallel over `tensor`; batches split over `data` and `fsdp`.
  c.mesh = ml_collections.ConfigDict(dict(shape=(-1, 1), axes=("fsdp", "tensor")))
  return c


def lora_on_small_hardware(paper_config, plans: str,
                           arg: str | None) -> ml_collections.ConfigDict:
  """A paper config (`paper_config(ARG)`) as a LoRA run for one GPU or a v5e-8
  (docs/lora.md): the base frozen in bfloat16 (`model.param_dtype`, the compute dtype),
  rank-16 adapters (alpha 16) on every attention and MLP projection at 30 times the full
  fine-tuning learning rate, the recipe tuned at 135M (docs/lora.md, "The recipe").
  `arg`: DEVICE, VARIANT or DEVICE,VARIANT; a DEVICE (a target of `python -m
  exgrpo_jax.aot`) takes the mesh, micro-batch, rollout slots and KV pool of its plan,
  docs/results/aot_<plans>_<DEVICE>.json (`planned`); without one they are left for
  `python -m exgrpo_jax.aot plan`."""
  device = parse_arg(arg)[0]
  c = paper_config(",".join(p for p in (arg or "").split(",") if p != device) or None)
  c.model.param_dtype = "bfloat16"
  c.model.lora.rank = 16
  c.model.lora.alpha = 16.0
  c.optim.lr = 3e-5  # 30 x the paper's 1e-6
  if c.train.budget_hours:  # day: the budget's plan is this device's, not 8 H100s'
    c.train.budget_plan = plan_path(plans, device) if device else ""
  chosen = (planned(plans, device) if device
            else dict(mesh_shape=(-1, 1), max_rows=0, kv_pages=0))
  return with_plan(c, chosen)


PLANS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                     "results")


def plan_path(plans: str, device: str) -> str:
  return os.path.join(PLANS, f"aot_{plans}_{device}.json")


def planned(plans: str, device: str) -> dict:
  """The settings the committed plan of `plans` (a config's name, or that of a config of
  its model's shapes) on `device` chose: PLANS/aot_<plans>_<device>.json. A device
  without a plan, or whose plan fits nothing, is a ValueError saying what to do."""
  path = plan_path(plans, device)
  if not os.path.exists(path):
    have = sorted(f[len(f"aot_{plans}_"):-5] for f in os.listdir(PLANS)
                  if f.startswith(f"aot_{plans}_") and f[len(f"aot_{plans}_"):-5] in
                  targets.TARGETS)
    kind = "tpu" if targets.get(device).platform == "tpu" else "gpu"
    fraction = "XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 " if kind == "gpu" else ""
    raise ValueError(
        f"no plan for {device} yet (planned: {', '.join(have) or 'none'}); make one "
        f"with `{fraction}.aot/{kind}/bin/python -m exgrpo_jax.aot plan "
        f"--config=configs/{plans}.py --target={device} "
        f"--out=docs/results/aot_{plans}_{device}.json` (`bash "
        f"scripts/accelerator/aot_env.sh {kind}` makes .aot/{kind}, docs/aot.md) and this "
        "argument takes it")
  with open(path, encoding="utf-8") as f:
    plan = json.load(f)
  if not plan["fits"]:
    raise ValueError(f"{device}: {plan['verdict']}")
  chosen = plan["chosen"]
  return dict(mesh_shape=(-1, chosen["tensor"]), micro_batch_size=chosen["micro_batch_size"], max_rows=chosen["max_rows"],
              kv_pages=chosen["kv_pages"])


def with_plan(c: ml_collections.ConfigDict, chosen: dict) -> ml_collections.ConfigDict:
  """`c` with a plan's mesh, micro-batch, rollout slots and KV pool (`planned`)."""
  c.mesh.shape = chosen["mesh_shape"]
  c.optim.micro_batch_size = chosen.get("micro_batch_size", c.optim.micro_batch_size)
  c.rollout.max_rows = chosen["max_rows"]
  c.rollout.kv_pages = chosen["kv_pages"]
  return c


# The day recipe: training hours (a day's rental less two for the install, the
# download, the data and serving the export), checkpoints and exports by the hour, and
# an evaluation of this many held-out problems spread over every benchmark, about this
# share of the training time (an evaluation row costs about a rollout row).
DAY_HOURS = 22.0
DAY_EVERY_MINUTES = 60.0
DAY_EVAL_PROBLEMS = 512
DAY_EVAL_SHARE = 0.1


def day_recipe(c: ml_collections.ConfigDict, plan: str = "") -> ml_collections.ConfigDict:
  """Config `c` as a run on a budget (`:day`; docs/data.md, "A run on a budget"): it
  stops, evaluated, checkpointed and exported, within DAY_HOURS (`train.budget_hours`,
  sized at the start from `plan`, a plan file's path, where there is one); checkpoints
  and exports every DAY_EVERY_MINUTES beside `train.checkpoint_every`; evaluates before
  training and every few steps on DAY_EVAL_PROBLEMS spread over the benchmarks (fewer
  where `eval.limit` already asks fewer), as often as keeps evaluation to about
  DAY_EVAL_SHARE of the training time."""
  c.train.budget_hours = DAY_HOURS
  c.train.budget_plan = plan
  c.train.checkpoint_every_minutes = DAY_EVERY_MINUTES
  c.train.export_every_minutes = DAY_EVERY_MINUTES
  c.eval.limit = min(c.eval.limit or DAY_EVAL_PROBLEMS, DAY_EVAL_PROBLEMS)
  c.eval.subset = "spread"
  c.eval.before_train = True
  rows = c.train.batch_questions * c.rollout.k
  c.eval.every = math.ceil(c.eval.limit * c.eval.n / (DAY_EVAL_SHARE * rows))
  return c


def apply_variant(c: ml_collections.ConfigDict, variant: str) -> ml_collections.ConfigDict:
  """Applies one of VARIANTS (the paper's Table 6 ablations) to config `c`."""
  if variant not in VARIANTS:
    raise ValueError(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
  for key, value in VARIANTS[variant][0].items():
    section, name = key.split(".")
    c[section][name] = value
  return c


# What a paper config's argument may add to its device and variant.
MODIFIERS = ("runlocal", "day")


def parse_arg(arg: str | None, devices: bool = True) -> tuple[str | None, str, set[str]]:
  """'[DEVICE,][VARIANT][,runlocal][,day]' -> (DEVICE or None, VARIANT, the MODIFIERS
  given): a DEVICE is a target of `python -m exgrpo_jax.aot`, a VARIANT one of VARIANTS;
  anything else is a ValueError naming what the config takes (no devices and no
  MODIFIERS where not `devices`: a config that runs on this machine as it is)."""
  parts = [p for p in (arg or "").split(",") if p]
  takes = (*(targets.TARGETS if devices else ()), *VARIANTS, *(MODIFIERS if devices
                                                               else ()))
  unknown = [p for p in parts if p not in takes]
  chosen = [p for p in parts if p in targets.TARGETS], [p for p in parts if p in VARIANTS]
  if unknown or len(chosen[0]) > 1 or len(chosen[1]) > 1:
    what = ("at most one device and one variant (and 'runlocal', 'day')" if devices
            else "one variant")
    raise ValueError(
        f"config argument {arg!r}: give {what}"
        f"{'; unknown: ' + ', '.join(unknown) if unknown else ''}; "
        f"{'devices: ' + ', '.join(targets.TARGETS) + '; ' if devices else ''}"
        f"variants: {', '.join(VARIANTS)}")
  return (chosen[0][0] if chosen[0] else None, chosen[1][0] if chosen[1] else "exgrpo",
          set(parts) & set(MODIFIERS))


def local_variant(arg: str | None) -> str:
  """The variant of a config that already runs on this machine: devices and 'runlocal'
  are refused with the variants it takes."""
  return parse_arg(arg, devices=False)[1]


def paper_config(arg, *, model_path: str, template: str, steps: int, delayed_start: float,
                 plans: str) -> ml_collections.ConfigDict:
  """The paper's GPU recipe for one backbone (8 GPUs, B=128, K=8, 8192 new tokens).

  `arg`: [DEVICE][,VARIANT][,runlocal]. The mesh, micro-batch, rollout slots
  (`rollout.max_rows`) and KV pool (`rollout.kv_pages`) are the committed plan's for
  DEVICE (`planned`: docs/results/aot_<plans>_<DEVICE>.json), by default 8 H100s'
  (docs/aot.md). `runlocal` shrinks batch and lengths for a quick smoke run of the same
  model; `day` makes it a run on a budget (`day_recipe`) sized from that plan.
  """
  device, variant, modifiers = parse_arg(arg)
  c = base_config()
  c.model.path = model_path  # a local HF directory; override with --config.model.path=...
  # The hub model it names (checkpoints/<name>): while model.path is not on disk, a run
  # reads the copy `python -m exgrpo_jax.fetch` put in the Hugging Face cache.
  c.model.hub_id = published.HUB_IDS[model_path.rsplit("/", 1)[-1]]
  c.data.train_path = "openr1_math_46k.parquet"  # under data.dir: prepare_data writes it
  c.data.template = template
  c.eval.path = "exgrpo_valid.parquet"
  c.eval.before_train = False  # every 10 steps from step 10 (2,259 problems each)
  c.train.steps = steps
  c.algo.delayed_start = delayed_start
  with_plan(c, planned(plans, device or "h100x8"))
  if "runlocal" in modifiers:
    c.train.batch_questions = 8
    c.rollout.max_new_tokens = 512
    c.eval.limit = 64
  if "day" in modifiers:
    day_recipe(c, plan_path(plans, device or "h100x8"))
  return apply_variant(c, variant)
