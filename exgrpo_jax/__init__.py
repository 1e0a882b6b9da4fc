"""exgrpo_jax: ExGRPO (learning to reason from experience) for LLMs in JAX/Flax."""

__version__ = "0.1.0"
