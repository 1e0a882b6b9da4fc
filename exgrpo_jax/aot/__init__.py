"""Ahead-of-time compilation of a training step for TPU slices and GPU nodes, on a CPU host.

  python -m exgrpo_jax.aot --config=configs/qwen7b.py --target=h100x8 [--layers=2]

`targets` names the machines and makes their compile-only devices, `programs` lists
every program a training step runs with the trainer's shapes and shardings, `check`
compiles them and `analysis` reads memory, FLOPs and collectives off each (docs/aot.md,
"Ahead-of-time check"). It needs the accelerator's compiler in the environment:
`scripts/accelerator/aot_env.sh` makes one for TPU and one for GPU.
"""
