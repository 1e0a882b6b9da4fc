"""Experience replay: the buffer (host-side NumPy), its storage and selection rules."""

from exgrpo_jax.replay import buckets
from exgrpo_jax.replay import selection
from exgrpo_jax.replay import storage
from exgrpo_jax.replay.buffer import BufferConfig, ExperienceBuffer
