"""Capture this GPU's target config, the spec XLA:GPU compiles against, for the AOT check.

Its output is committed under exgrpo_jax/aot/gpu_specs/ and used by the GPU targets of
docs/aot.md; docs/accelerator_results.md says where the H200's came from.

  python scripts/accelerator/gpu_target_config.py --out gpu_target_config.pbtxt   # on the GPU

XLA writes the GpuTargetConfigProto it compiled with (device description, cuDNN and CUDA
versions) beside a dumped module; this compiles one small function with dumping on and
keeps that file. `python -m exgrpo_jax.aot --target_config FILE` compiles against it;
exgrpo_jax/aot/gpu_specs/ holds the ones captured on real GPUs.
"""

import argparse
import glob
import os
import sys
import tempfile


def capture(out: str) -> str:
  """Writes the target config to `out`; returns the device kind it was captured on."""
  with tempfile.TemporaryDirectory(prefix="gpu_target_config_") as dump:
    # Before JAX is imported: XLA reads its flags once.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_dump_to={dump} --xla_dump_hlo_module_re=.*probe.*")
    import jax  # pylint: disable=g-import-not-at-top
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    device = jax.devices()[0]
    if device.platform != "gpu":
      raise SystemExit(f"gpu_target_config: JAX's first device is {device.platform} "
                       f"({device.device_kind}), not a GPU")

    def probe(x):
      return x * 2

    jax.jit(probe)(jnp.ones(8)).block_until_ready()
    found = glob.glob(os.path.join(dump, "*gpu_target_config.pbtxt"))
    if not found:
      raise SystemExit(f"gpu_target_config: XLA dumped no *gpu_target_config.pbtxt; it wrote "
                       f"{sorted(os.listdir(dump))[:10]}")
    with open(found[0], encoding="utf-8") as f:
      text = f.read()
  with open(out, "w", encoding="utf-8") as f:
    f.write(text)
  return device.device_kind


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--out", default="gpu_target_config.pbtxt")
  args = parser.parse_args(argv)
  kind = capture(args.out)
  print(f"wrote {args.out}: the target config of {kind}", file=sys.stderr)


if __name__ == "__main__":
  main()
