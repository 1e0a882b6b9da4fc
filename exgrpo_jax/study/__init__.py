"""Pre-registered paired studies: arms and seeds, stages, resume, paired statistics.

`python -m exgrpo_jax.study run | status | report` (`__main__`) with a study config
(configs/study_v3.py, evidence v3 of docs/results.md). `protocol`: the config, the
finished runs' summaries and the rules that pick the next runs; `runs`: one training
process per run and its summary; `report`: the paired statistics, the verdict and the
figures. scripts/accelerator/gpu_followup.py runs the primary pair through `runs` on a GPU.
"""
