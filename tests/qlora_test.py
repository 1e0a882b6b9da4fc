"""QLoRA (`model.lora.base_quant` int8 / nf4, `exgrpo_jax.models.quant`): the quantized
base computes exactly the model whose weights are its dequantized values, close to the
unquantized base; a learner step leaves its bytes alone; every sampler receives the
current adapter merged onto the dequantized base.
"""

import json

import jax
import ml_collections
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax import sharding
from exgrpo_jax.models import lora
from exgrpo_jax.models import quant
from exgrpo_jax.training import actor
from exgrpo_jax.training import config_check
from exgrpo_jax.training import learner
from exgrpo_jax.training import lora_run
from tests import conftest
from tests import lora_test

# Wide enough that nf4 has several 64-element blocks along an input axis (q_proj's
# 128 inputs, down_proj's 192; o_proj's per-head 64).
QCFG = models.ModelConfig(vocab_size=96, hidden_size=128, intermediate_size=192,
                          num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                          eos_token_id=(1,))
KINDS = ("int8", "nf4")
# Half the widest gap between two neighbouring NF4 levels (-1 and -0.6962, QLoRA's
# Appendix E): the most a code can be off, in units of its block's absmax.
NF4_HALF_GAP = (1.0 - 0.6961928009986877) / 2


def _projections(tree):
  """{(module, name): leaf} of the layer projections of a base tree."""
  return {(module, name): w for module, weights in tree["layers"].items()
          for name, w in weights.items() if name in lora.TARGETS}


def _qlora_params(kind, cfg=lora_test.CFG, seed=0):
  params = lora_test._lora_params(cfg, seed)
  return params.replace(base=lora.quantize_base(params.base, kind))


@pytest.mark.parametrize("kind", KINDS)
def test_step_zero_logits_are_the_dequantized_bases(kind):
  """B = 0 over a quantized base: the logits are those of the plain model whose weights
  are the dequantized base, bit for bit (each weight dequantized inside its layer);
  only the seven projections are quantized."""
  params = _qlora_params(kind, QCFG)
  quantized = {k for k, w in _projections(params.base).items() if quant.is_quantized(w)}
  assert quantized == set(_projections(models.abstract_params(QCFG)))
  assert sum(map(quant.is_quantized, jax.tree.leaves(
      params.base, is_leaf=quant.is_quantized))) == len(quantized)
  tokens = lora_test._tokens()
  want, _ = models.apply(QCFG, quant.dequantize_tree(params.base), tokens)
  got, _ = models.apply(QCFG, params, tokens)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("kind", KINDS)
def test_each_code_is_within_half_a_step_of_its_weight(kind):
  """Every dequantized element is within half a quantization step of the weight: for
  int8 absmax/254 of its layer's output channel, for nf4 NF4_HALF_GAP x the absmax of
  its block of 64 inputs. The weights' channels and blocks get magnitudes 100x apart,
  so scales along other axes than these would break the bound."""
  rng = np.random.default_rng(0)
  for (_, name), w in _projections(models.init_params(QCFG, jax.random.key(0))).items():
    n_in = len(lora._TARGETS[name][1])  # pylint: disable=protected-access
    w = np.asarray(w)
    w = w * 10.0 ** rng.uniform(-2, 0, (w.shape[0],) + (1,) * n_in + w.shape[1 + n_in:])
    last = n_in  # the last input axis, in the stacked weight
    blocks = w.reshape(w.shape[:last] + (-1, quant.BLOCK) + w.shape[last + 1:])
    blocks = blocks * 10.0 ** rng.uniform(-2, 0, blocks.shape[:last + 1] + (1,)
                                          + (1,) * (w.ndim - last - 1))
    w = blocks.reshape(w.shape).astype(np.float32)
    err = np.abs(np.asarray(quant.dequantize(quant.quantize(jnp.asarray(w), kind, n_in)))
                 - w)
    if kind == "int8":
      bound = np.abs(w).max(axis=tuple(range(1, 1 + n_in)), keepdims=True) / 254
    else:
      absmax = np.abs(blocks).max(axis=last + 1, keepdims=True)
      bound = np.broadcast_to(NF4_HALF_GAP * absmax, blocks.shape).reshape(w.shape)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-12), name


@pytest.mark.parametrize("kind", KINDS)
def test_the_quantized_models_logits_are_close_to_the_bases(kind):
  """The logits' change from quantizing is bounded by the projections' share of the
  logits times the summed relative errors of the quantized weights: to first order a
  weight off by a relative e changes what its matmul adds by at most about e of it,
  and the 14 perturbations (2 layers x 7 projections) add up. Measured on this model:
  int8 at 0.17, nf4 at 0.19 of the bound."""
  base = models.init_params(QCFG, jax.random.key(0))
  deq = quant.dequantize_tree(lora.quantize_base(base, kind))
  rel = sum(float(jnp.linalg.norm(deq_w - w) / jnp.linalg.norm(w))
            for deq_w, w in zip(_projections(deq).values(), _projections(base).values()))
  tokens = lora_test._tokens()
  rms = lambda x: float(jnp.sqrt(jnp.mean(jnp.square(x))))
  logits, _ = models.apply(QCFG, base, tokens)
  quantized, _ = models.apply(QCFG, deq, tokens)
  no_projections = dict(base, layers=dict(
      base["layers"], attn=jax.tree.map(jnp.zeros_like, base["layers"]["attn"]),
      mlp=jax.tree.map(jnp.zeros_like, base["layers"]["mlp"])))
  share = rms(logits - models.apply(QCFG, no_projections, tokens)[0])
  assert 0 < rms(quantized - logits) <= rel * share
  assert rel < (0.1 if kind == "int8" else 1.0)  # 14 weights: int8 < 1%, nf4 < 10% each


@pytest.mark.parametrize("kind", KINDS)
def test_a_step_trains_the_adapters_alone_over_a_quantized_base(kind):
  """The quantized base's codes and scales keep their bytes through a learner step;
  every B moves off zero."""
  params = _qlora_params(kind)
  base_bytes = [np.asarray(x).tobytes() for x in jax.tree.leaves(params.base)]
  params, _ = lora_test.train(params, 1)
  assert [np.asarray(x).tobytes() for x in jax.tree.leaves(params.base)] == base_bytes
  assert all(quant.is_quantized(w) for w in _projections(params.base).values())
  for path, b in jax.tree_util.tree_leaves_with_path(params.adapters):
    if path[-1].key == "b":
      assert float(jnp.abs(b).max()) > 0, jax.tree_util.keystr(path)


@pytest.mark.parametrize("kind", KINDS)
def test_merged_weights_are_the_dequantized_base_merged(kind):
  """What the samplers, vLLM and the export receive (`lora.merged`): W + s A @ B on the
  dequantized base, in the params' dtype, with nothing quantized left."""
  params = _qlora_params(kind)
  params = params.replace(adapters=jax.tree.map(lambda x: x + 0.05, params.adapters))
  merged = lora.merged(params)
  want = lora.merged(params.replace(base=quant.dequantize_tree(params.base)))
  assert jax.tree.structure(merged) == jax.tree.structure(want)
  for got, expected in zip(jax.tree.leaves(merged), jax.tree.leaves(want)):
    assert got.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


@pytest.fixture(scope="module")
def trained():
  """LoRA params over an nf4 base after 3 learner steps (B well off zero)."""
  return lora_test.train(_qlora_params("nf4"), 3, lora_test._config(lr=5e-2))[0]


# By default the continuous engine on a mesh; the static loop's case (lora_test runs it
# over an unquantized base) is slow.
@pytest.mark.parametrize("options, on_mesh", [
    pytest.param(dict(scheduler="static"), False, marks=pytest.mark.slow),
    (dict(max_rows=2), True)], ids=["static", "continuous-mesh"])
def test_the_jax_engine_samples_the_current_adapter_over_a_quantized_base(
    trained, options, on_mesh):
  """After 3 learner steps over an nf4 base, greedy rollouts are the learner's argmax
  tokens with its log-probs (the adapter applied over the quantized base), not the
  base's; on a mesh the base is placed by its own shardings and the engine dequantizes
  and merges while it makes its rollout copy."""
  if on_mesh:
    config = tiny.get_config()
    config.model.lora.update(rank=lora_test.RANK, base_quant="nf4")
    mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(shape=(-1, 1),
                                                             axes=("fsdp", "tensor"))))
    trained = trained.replace(
        base=jax.device_put(trained.base,
                            lora_run.base_shardings(config, lora_test.CFG, mesh)),
        adapters=jax.device_put(trained.adapters, lora.adapter_shardings(
            lora_test.CFG, lora_test.RANK, lora.TARGETS, mesh)))
  engine = sampling.make_engine("jax", lora_test.CFG, None, **options)
  out = engine.generate(lora_test.PROMPTS, 2, trained, jax.random.key(0), lora_test.GREEDY)
  lora_test.check_rows_follow_the_adapter(out, lora_test.PROMPTS, trained, lora_test.CFG,
                                          atol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_leaves_shard_like_their_weights(kind):
  """On an fsdp x tensor mesh the codes take their weight's sharding, and each scale
  is split only along axes its codes are split along, the same way."""
  mesh = jax.sharding.AbstractMesh((2, 2), ("fsdp", "tensor"))
  abstract = lora.abstract_base(models.abstract_params(QCFG), kind)
  names = lora.base_logical_axes(models.logical_axes(QCFG), abstract)
  plain_names = models.logical_axes(QCFG)
  for key, q in _projections(abstract).items():
    module, name = key
    weight_spec = sharding.spec(tuple(plain_names["layers"][module][name]), q.shape, mesh)
    q_names = names["layers"][module][name]
    assert sharding.spec(tuple(q_names.qvalue), q.qvalue.shape, mesh) == weight_spec
    scale_spec = sharding.spec(tuple(q_names.scale), q.scale.shape, mesh)
    assert all(s is None or s == w for s, w in zip(scale_spec, weight_spec)), (key,
                                                                              scale_spec)
  # q_proj's heads (2) split over tensor in both codes and per-channel scales.
  q_proj = names["layers"]["attn"]["q_proj"]
  assert sharding.spec(tuple(q_proj.scale), abstract["layers"]["attn"]["q_proj"].scale.shape,
                       mesh)[2] == "tensor"


@pytest.mark.parametrize("kind", KINDS)
def test_quantized_bases_pass_the_config_check_and_refuse_another_on_resume(kind):
  """int8 and nf4 are accepted with a rank; a checkpoint trained with one base_quant
  is refused in one line when resumed with another."""
  config = tiny.get_config()
  config.model.lora.update(rank=4, base_quant=kind)
  config_check.check(config)
  other = tiny.get_config()
  other.model.lora.update(rank=4, base_quant="none")
  meta = dict(config=other.to_dict())
  with pytest.raises(config_check.ConfigError) as e:
    lora_run.check_resume(meta, config, lambda: {})
  assert str(e.value).startswith(f"config.model.lora.base_quant='{kind}': the checkpoint "
                                 "being resumed was trained with 'none'")
  assert len(str(e.value).splitlines()) == 1


def _sharded_child(outdir: str) -> None:
  """In a 4-device process: a learner step and the merge over an nf4 base placed on a
  2 x 2 fsdp x tensor mesh by its own shardings, and the same on one device."""
  assert jax.device_count() == 4, jax.devices()
  config = tiny.get_config()
  config.model.lora.update(rank=lora_test.RANK, base_quant="nf4")
  mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(shape=(2, 2),
                                                           axes=("fsdp", "tensor"))))
  params, fresh = _qlora_params("nf4", QCFG), _qlora_params("nf4", QCFG)
  # Placed from arrays of their own: a replicated placement may share the one-device
  # buffers, which the one-device step donates.
  placed = fresh.replace(
      base=jax.device_put(fresh.base, lora_run.base_shardings(config, QCFG, mesh)),
      adapters=jax.device_put(fresh.adapters, lora.adapter_shardings(
          QCFG, lora_test.RANK, lora.TARGETS, mesh)))
  codes = {f"{m}/{n}": (w.qvalue.sharding.is_fully_replicated,
                        w.qvalue.addressable_shards[0].data.size < w.qvalue.size)
           for (m, n), w in _projections(placed.base).items()}
  single = lora_test.train(params, 1, cfg=QCFG)[0]
  # As `lora_test.train`, with the optimizer state created on the adapters' shardings.
  tx = learner.make_optimizer(lora_test._config().optim)
  opt_shardings = sharding.optimizer_shardings(
      tx, lora.abstract_adapters(QCFG, lora_test.RANK, lora.TARGETS),
      sharding.shardings_of(placed.adapters))
  sharded, _, metrics = actor.Actor(lora_test._config(), QCFG, pad_id=0).update(
      placed, sharding.init_optimizer(tx, placed.adapters, opt_shardings),
      lora_test._groups(seed=0), True, np.random.default_rng(0))
  assert metrics["skipped"] == 0
  base_kept = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
      jax.tree.leaves(sharded.base), jax.tree.leaves(params.base)))
  with open(f"{outdir}/summary.json", "w") as f:
    json.dump(dict(codes=codes, base_kept=base_kept), f)
  np.savez(f"{outdir}/single.npz", *map(np.asarray, jax.tree.leaves(
      (single.adapters, lora.merged(single)))))
  np.savez(f"{outdir}/sharded.npz", *map(np.asarray, jax.tree.leaves(
      (sharded.adapters, lora.merged(sharded)))))


def test_a_step_and_the_merge_on_an_fsdp_tensor_mesh_match_one_device(tmp_path):
  """On 4 CPU devices (fsdp 2 x tensor 2) every quantized projection's codes are split,
  not replicated; a learner step keeps the base's bytes and gives one device's adapters,
  and the merged weights match one device's."""
  summary = conftest.run_on_cpu_devices(
      f"from tests import qlora_test; qlora_test._sharded_child({str(tmp_path)!r})", 4,
      result=tmp_path / "summary.json")
  assert summary["base_kept"]
  assert all(not replicated and split for replicated, split in summary["codes"].values()), (
      summary["codes"])
  single, sharded = (list(np.load(tmp_path / f"{n}.npz").values())
                     for n in ("single", "sharded"))
  assert len(single) == len(sharded)
  for a, b in zip(sharded, single):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
