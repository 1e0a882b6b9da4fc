"""Run by `aot_test` in an AOT environment (`scripts/accelerator/aot_env.sh`); prints JSON.

  python -m tests.aot_child TARGET ATTENTION MESH [--unsharded-kernels]
  python -m tests.aot_child TARGET ATTENTION MESH --rollout
  python -m tests.aot_child hbm TARGET ...
  python -m tests.aot_child decode_attention TARGET ROWS KV_HEADS
  python -m tests.aot_child flops TARGET ATTENTION MESH ...
  python -m tests.aot_child reprice PLAN

The first compiles a tiny Qwen2-shaped learner step (GQA, q/k/v biases) for a target;
`--unsharded-kernels` calls the fused kernel without `shard_map` (what the code did
before `attention._on_shards`), the case the compilers refused; `--rollout` compiles the
same model's rollout programs (continuous batching) instead. The last asks the TPU
compiler how much HBM a program of each target's chip may use (its refusal of a larger
one says). `decode_attention` compiles one decode step's paged attention (`paged_kernel.attend`) on
one chip: ROWS rows of 1024 + 8192 tokens, KV_HEADS KV heads of 128 with 4 query heads
each, and prints the compiler's error, if any. `flops` traces the tiny learner's programs
on each MESH (fsdp x tensor, over the target's first devices) and prints their matmul
counts (`flops.matmul_flops`), with cuDNN's causal and masked attention on one GPU;
`reprice` prints a plan as first priced, repriced (`reprice.reprice`) and repriced again.
"""

import json
import sys


def hbm(names) -> dict:
  """GiB per device that the TPU compiler allows a program on each target's chip."""
  import re  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import targets  # pylint: disable=g-import-not-at-top
  found = {}
  for name in names:
    device = targets.devices(targets.get(name))[0]
    too_big = jax.jit(lambda: jnp.ones((2 ** 36,), jnp.float32),  # 256 GiB
                      out_shardings=jax.sharding.SingleDeviceSharding(device))
    try:
      too_big.lower().compile()
    except Exception as e:  # pylint: disable=broad-except
      limit = re.search(r"exceeds available HBM \(([\d.]+)G\)", str(e))
      found[name] = float(limit.group(1)) if limit else str(e)[:300]
  return found


def decode_attention(target_name, rows, kv_heads) -> dict:
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import targets  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import sharding  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.sampling import paged_kernel  # pylint: disable=g-import-not-at-top
  chip = targets.devices(targets.get(target_name))[0]
  mesh = jax.sharding.Mesh(np.array([[chip]]), ("fsdp", "tensor"))
  device = jax.sharding.SingleDeviceSharding(chip)
  struct = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=device)
  per_row, H, Dh = 144, 4 * kv_heads, 128
  args = (struct((rows, H, Dh), jnp.bfloat16), struct((rows, kv_heads, Dh), jnp.bfloat16),
          struct((rows, kv_heads, Dh), jnp.bfloat16),
          struct((rows * per_row, 64, 2 * kv_heads, Dh), jnp.bfloat16),
          struct((rows,), jnp.int32), struct((rows,), jnp.int32),
          struct((rows, per_row), jnp.int32), struct((rows,), jnp.int32))
  try:
    with sharding.use_mesh(mesh):
      jax.jit(paged_kernel.attend).lower(*args).compile()
    return dict(error="")
  except Exception as e:  # pylint: disable=broad-except
    return dict(error=str(e).splitlines()[0] + " " + " ".join(
        l for l in str(e).splitlines() if "Scoped allocation" in l))


def _tiny(attention_name: str, mesh_shape: str):
  """The tiny Qwen2-shaped learner's config and model, on an fsdp x tensor mesh."""
  from configs import common  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import models  # pylint: disable=g-import-not-at-top
  c = common.base_config()
  c.mesh.shape = tuple(int(n) for n in mesh_shape.split("x"))
  c.train.batch_questions, c.rollout.k = 2, 4
  c.data.max_prompt_tokens, c.rollout.max_new_tokens = 128, 128
  c.optim.micro_batch_size, c.optim.mini_batches = 4, 1
  c.train.logprob_chunk = 64
  cfg = models.ModelConfig(
      model_type="qwen2", vocab_size=512, hidden_size=256, intermediate_size=512,
      num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128, attention_bias=True,
      tie_word_embeddings=False, dtype="bfloat16", param_dtype="float32", remat="full",
      attention=attention_name, eos_token_id=(1,))
  return c, cfg


def counted(target_name: str, attention_name: str, meshes) -> dict:
  """{mesh: {program: FLOPs}} of the tiny learner's programs, traced on each mesh."""
  import math  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import sharding  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import flops  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import programs  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import targets  # pylint: disable=g-import-not-at-top
  devices = targets.devices(targets.get(target_name))
  found = {}
  for shape in meshes:
    c, cfg = _tiny(attention_name, shape)
    mesh = sharding.make_mesh(c.mesh, devices[:math.prod(c.mesh.shape)])
    found[shape] = {}
    for program in programs.learner_programs(c, cfg, mesh)[0]:
      with sharding.use_mesh(mesh):
        traced = program.fn.trace(*program.args({}), **program.kwargs)
      found[shape][program.name] = flops.program_flops(program, traced)
  if attention_name == "cudnn":  # jax.nn's call, causal or with a mask array
    B, T, H, Dh = 2, 256, 4, 64
    x = jax.ShapeDtypeStruct((B, T, H, Dh), jnp.bfloat16)
    one = jax.sharding.Mesh(np.asarray(devices[:1]), ("fsdp",))
    for name, causal in (("causal", True), ("masked", False)):
      def call(q, k, v, causal=causal):
        mask = None if causal else jnp.tril(jnp.ones((T, T), bool))
        return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=causal,
                                            implementation="cudnn")
      with sharding.use_mesh(one):
        traced = jax.jit(call).trace(x, x, x)
      found[name] = dict(forward=flops.matmul_flops(traced.jaxpr),
                         full=2 * 2 * B * H * Dh * T * T, causal_pairs=T * (T + 1) // 2)
  return found


def repriced(path: str) -> dict:
  """A committed plan as first priced (its `repriced` record's FLOPs and step estimate
  put back), repriced, and repriced again."""
  from exgrpo_jax.aot import reprice  # pylint: disable=g-import-not-at-top
  with open(path, encoding="utf-8") as f:
    plan = json.load(f)
  was = plan.pop("repriced", None)
  if was:
    for p in plan["report"]["programs"]:
      p["flops_per_device"] = was["flops_per_device_before"][p["name"]]
    plan["report"]["step_estimate"] = was["step_estimate_before"]
  once = reprice.reprice(plan)
  return dict(plan=plan, once=once, twice=reprice.reprice(once))


def main(argv) -> None:
  from exgrpo_jax.aot import targets  # pylint: disable=g-import-not-at-top
  targets.prepare_environment()
  if argv[1] == "hbm":
    print(json.dumps(hbm(argv[2:])))
    return
  if argv[1] == "decode_attention":
    print(json.dumps(decode_attention(argv[2], *map(int, argv[3:5]))))
    return
  if argv[1] == "flops":
    print(json.dumps(counted(argv[2], argv[3], argv[4:])))
    return
  if argv[1] == "reprice":
    print(json.dumps(repriced(argv[2])))
    return
  target_name, attention_name, mesh_shape = argv[1], argv[2], argv[3]
  from exgrpo_jax import sharding  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import programs  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.models import attention  # pylint: disable=g-import-not-at-top

  if "--unsharded-kernels" in argv:
    attention._on_shards = lambda kernel, *args: kernel(*args)  # pylint: disable=protected-access
  c, cfg = _tiny(attention_name, mesh_shape)
  target = targets.get(target_name)
  mesh = sharding.make_mesh(c.mesh, targets.devices(target))
  if "--rollout" in argv:
    c.rollout.max_rows = 4  # fewer slots than rows: continuous batching
    listed = [p for p in programs.training_step(c, cfg, mesh) if p.name not in check.LEARNER]
  else:
    listed = programs.learner_programs(c, cfg, mesh)[0]
  out = {}
  results = [check.compile_program(p, out, mesh, target) for p in listed]
  with sharding.use_mesh(mesh):
    resolved = attention.resolve("auto", "bfloat16", 256)
  print(json.dumps(dict(
      platform=mesh.devices.flat[0].platform, device_kind=mesh.devices.flat[0].device_kind,
      auto=resolved, programs={r.name: dict(
          error=r.error, peak_bytes=r.peak_bytes, collectives=r.collectives,
          custom_calls=r.custom_calls, in_place=r.in_place, alias_bytes=r.alias_bytes,
          largest_copy_bytes=r.largest_copy_bytes) for r in results})))


if __name__ == "__main__":
  main(sys.argv)
