"""Evaluation: pass@k / avg@k metrics and the generate-grade-summarise driver."""

from exgrpo_jax.evaluation import metrics
from exgrpo_jax.evaluation.runner import (EvalOptions, evaluate, evaluate_prompts,
                                          format_table, render)
