"""exgrpo_jax: ExGRPO (learning to reason from experience) for LLMs in JAX/Flax.

Array names end in their axes, `name_AxBxC` (e.g. `logp_BxR`, `rewards_QxK`). Letters:

  B  sequences in a batch (one forward pass)    N  rows of a flattened batch (responses)
  Q  questions (groups) of a training step       K  rollouts per question (group size)
  M  micro-batches of a mini-batch               P  prompt positions (left-padded)
  R  response positions (right-padded)           S  P + R positions, or key/value slots
  T  positions of the sequence a function sees (queries; the responses in `losses`)
  V  vocabulary   D  model width   F  MLP width or rotary frequencies   H  query heads
  C  a chunk of the vocabulary or the sequence   E  end-of-sequence ids
  L  generic length (trajectory tokens, prompt slots)

Module-local exceptions: in `models.transformer` K is the number of key/value heads
(k_BxTxKxDh) and in `sampling.categorical` K is the width of a vocabulary block.
"""

__version__ = "0.1.0"
