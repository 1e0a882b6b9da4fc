"""A quantized frozen base for QLoRA (`model.lora.base_quant`), in qwix's arrays.

A quantized weight is a `qwix.QArray`: the codes (`qvalue`, the weight's shape) and
their scales (`scale`, one per block, in the weight's own dtype, so `qwix.dequantize`
gives the weight back in `param_dtype`). For a layer weight [L, *in, *out]:

  int8  symmetric 8-bit integers, one scale per layer and output channel (absmax over
        the whole input), as LLM.int8's vector-wise weights.
  nf4   4-bit NormalFloat codes (QLoRA's data type, stored as uint4), one scale per
        block of 64 consecutive elements of the last input axis, per layer and output
        channel (QLoRA's block size; a last input axis that 64 does not divide is one
        block).

The model dequantizes a weight where a layer reads it (`transformer`), inside the scan
over layers, so a step never holds more than one layer's weights at full precision.
"""

import functools

import jax
import jax.numpy as jnp
import qwix

from exgrpo_jax import sharding

KINDS = ("int8", "nf4")
_QTYPES = {"int8": jnp.int8, "nf4": "nf4"}
BLOCK = 64


def _layout(shape, kind: str, n_in: int):
  """qwix's (channelwise_axes, tiled_axes) for ONE layer's weight [*in, *out] with `n_in`
  input axes."""
  out_axes = tuple(range(n_in, len(shape)))
  if kind == "int8":
    return out_axes, {}
  last = n_in - 1
  block = BLOCK if shape[last] % BLOCK == 0 else shape[last]
  return tuple(range(last)) + out_axes, {last: block}


def quantize(w_Lx_in_x_out: jax.Array, kind: str, n_in: int) -> qwix.QArray:
  """A stacked layer weight quantized layer by layer (the temporaries of one layer's
  quantization at a time)."""
  channelwise, tiled = _layout(w_Lx_in_x_out.shape[1:], kind, n_in)
  one = functools.partial(qwix.quantize, qtype=_QTYPES[kind], channelwise_axes=channelwise,
                          tiled_axes=tiled)
  return jax.lax.map(one, w_Lx_in_x_out)


def is_quantized(x) -> bool:
  return isinstance(x, qwix.QArray)


def dequantize(w):
  """A quantized weight restored (in its scales' dtype); a plain array as it is."""
  return qwix.dequantize(w) if is_quantized(w) else w


def dequantize_tree(tree):
  """`tree` with every quantized weight restored."""
  return jax.tree.map(dequantize, tree, is_leaf=is_quantized)


def logical_axes(names: sharding.P, abstract: qwix.QArray) -> qwix.QArray:
  """The logical axis names of a quantized weight whose plain weight has `names`: the
  codes the weight's; the scales the weight's where they run along it (per channel,
  or per block: a rule that does not divide the block count skips it), none where one
  scale covers the axis."""
  scale_names = tuple(None if n == 1 else name
                      for name, n in zip(names, abstract.scale.shape))
  return abstract.replace(qvalue=names, scale=sharding.P(*scale_names))


def plain_shardings(tree):
  """`tree` of shardings with each quantized weight's replaced by its codes' (the plain
  weight's sharding)."""
  return jax.tree.map(lambda x: x.qvalue if is_quantized(x) else x, tree,
                      is_leaf=is_quantized)
