"""`exgrpo_jax.aot.programs` compiles what the trainer really runs.

A real rollout (JaxEngine, continuous batching: rows waiting for slots, a pool that
grows to its largest, a tail in half the slots) and a real learner step record the
programs they compile; the AOT list for the same config must name the same programs
with the same argument shapes, dtypes and static options. On the host's CPU, where
both can run, so a change to either side that the other does not follow fails here.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import common
from exgrpo_jax import data
from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax import sharding
from exgrpo_jax.aot import analysis
from exgrpo_jax.aot import check
from exgrpo_jax.aot import flops
from exgrpo_jax.aot import programs as programs_lib
from exgrpo_jax.aot import targets
from exgrpo_jax.sampling import continuous
from exgrpo_jax.sampling import jax_engine
from exgrpo_jax.training import actor as actor_lib
from exgrpo_jax.training import groups as groups_lib
from exgrpo_jax.training import learner

CFG = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, eos_token_id=(1,))
HOST = targets.Target("cpu", "host", 1, "cpu", hbm_bytes=2 ** 40, peak_flops=1e12,
                      hbm_bandwidth=1e11)


def small_config():
  c = common.base_config()
  c.train.batch_questions, c.rollout.k = 6, 2  # 12 rows through 8 slots
  c.rollout.max_rows, c.rollout.max_new_tokens = 8, 40
  c.data.max_prompt_tokens = 32  # a prompt bucket: its rows fill the largest pool
  c.rollout.temperature = 1.0
  c.optim.micro_batch_size, c.optim.mini_batches = 4, 1
  c.train.logprob_chunk = 16
  c.mesh.shape = (1, 1)
  c.eval.every = 0
  return c


def _shapes(args):
  return tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(args))


def _compile_all(config):
  """Every program of a step compiled for the host: (programs, their outputs, results)."""
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:1])
  listed = programs_lib.training_step(config, CFG, mesh)
  outputs, results = {}, {}
  for program in listed:
    results[program.name] = check.compile_program(program, outputs, mesh, HOST)
    assert not results[program.name].error, (program.name, results[program.name].error)
  return listed, outputs, results


@pytest.fixture(scope="module")
def aot_compiled():
  return _compile_all(small_config())


@pytest.fixture(scope="module")
def aot_programs(aot_compiled):
  listed, outputs, _ = aot_compiled
  return {program.name: (program, program.args(outputs)) for program in listed}


def test_decode_chunk_counts_everything_the_rollout_keeps_and_the_layers_once(
    aot_compiled):
  """During a decode chunk the device holds the learner's state, the rollout copy
  without its stacked layers (`continuous.weights` frees them once prepared: admit reads
  the prepared ones too), the prepared layers and the pool; nothing more."""
  _, outputs, results = aot_compiled
  learner_state = (outputs["learner_step"][0], outputs["learner_step"][1])
  rest = continuous.without_layers(outputs["rollout_copy"])
  held = (*learner_state, rest, outputs["prepare_layers"], outputs["repage_layer"])
  pool_layers = CFG.num_layers  # the pool's largest size: every layer as repage_layer's
  held_bytes = (analysis.shard_bytes(held[:-1])
                + pool_layers * analysis.shard_bytes(outputs["repage_layer"]))
  decode = results["decode_chunk"]
  counted = decode.argument_bytes + decode.resident_bytes
  # Less what the chunk's arguments add beyond them: the slots' state, page table, scalars.
  slots_bytes = analysis.shard_bytes(outputs["empty"][0].replace(caches=()))
  assert counted >= held_bytes, (counted, held_bytes)
  assert counted <= held_bytes + slots_bytes + 2 ** 16, (counted, held_bytes)


def test_the_pool_is_updated_in_place_and_the_roofline_does_not_move_it_per_call(
    aot_compiled):
  """place, decode_chunk and release take the slots and their page pool donated and
  update them where they write: no copy of the pool, and the roofline counts their
  aliased bytes neither read nor written per call (the decode's per-step reads of the
  pool are in its streamed bytes). The learner's step, which rewrites every parameter
  and moment, still counts its donated state read and written."""
  _, outputs, results = aot_compiled
  layer_bytes = min(analysis.shard_bytes(x) for x in outputs["repage_layer"])
  for name in ("place", "decode_chunk", "release"):
    r = results[name]
    assert r.in_place and r.alias_bytes >= CFG.num_layers * 2 * layer_bytes, name
    assert r.largest_copy_bytes < layer_bytes, (name, r.largest_copy_bytes)
  place = results["place"]
  assert place.hbm_bytes_per_call == (place.argument_bytes + place.output_bytes
                                      - 2 * place.alias_bytes)
  learner_step = results["learner_step"]
  assert not learner_step.in_place and learner_step.alias_bytes > 0
  assert learner_step.hbm_bytes_per_call == (learner_step.argument_bytes
                                             + learner_step.output_bytes)


def test_rollout_programs_are_the_engines(aot_programs, monkeypatch):
  c = small_config()
  seen = []
  real_compiled = jax_engine.JaxEngine.compiled

  def spy(self, program, args, static, takes_cfg=True):
    seen.append((program, _shapes(args), tuple(sorted(static.items()))))
    return real_compiled(self, program, args, static, takes_cfg)
  monkeypatch.setattr(jax_engine.JaxEngine, "compiled", spy)
  engine = sampling.make_engine("jax", CFG, None, max_rows=c.rollout.max_rows,
                                ignore_eos=True)
  # EOS ignored (its id -1 is one id, as CFG's): every row reaches max_new_tokens, so the
  # pool reaches its largest size.
  params = models.init_params(CFG, jax.random.key(0))
  prompts = [list(range(2, 2 + c.data.max_prompt_tokens))] * c.train.batch_questions
  engine.generate(prompts, c.rollout.k, params, jax.random.key(1),
                  sampling.SamplingConfig(max_new_tokens=c.rollout.max_new_tokens))
  names = [n for n in aot_programs if n not in ("learner_step", "score", "rollout_copy",
                                                "release")]
  assert names == ["prepare_layers", "empty", "repage_layer", "admit", "place", "select",
                   "decode_chunk"]
  for name in names:
    program, args = aot_programs[name]
    if name in ("prepare_layers", "empty", "admit", "decode_chunk"):
      args = args[1:]  # the engine passes its config itself
    signature = (program.fn, _shapes(args), _static(program.kwargs))
    same_fn = [(f, a, _static(dict(st))) for f, a, st in seen if f is program.fn]
    if name in ("place", "repage_layer"):  # at whatever size the pool has then
      layer = getattr(args[0], "caches", (args[0],))[0]
      same_fn = [(f, _pool_as(a, layer), st) for f, a, st in same_fn]
    assert signature in same_fn, (name, [_diff(signature, other) for other in same_fn])


def _diff(ours, theirs) -> list:
  """Where two signatures differ: (argument index, ours, theirs), or the static options."""
  if len(ours[1]) != len(theirs[1]):
    return [("arguments", len(ours[1]), len(theirs[1]))]
  found = [(i, a, b) for i, (a, b) in enumerate(zip(ours[1], theirs[1])) if a != b]
  return found + ([("static", ours[2], theirs[2])] if ours[2] != theirs[2] else [])


def _static(kwargs):
  return tuple(sorted((k, v) for k, v in kwargs.items() if k != "mesh"))


def _pool_as(shapes, layer):
  """`shapes` with every pool layer's page count (the leading dimension of arrays shaped
  like `layer`'s k and v but for it) set to `layer`'s."""
  trailing = {tuple(x.shape[1:]): x.shape[0] for x in layer}
  return tuple(((trailing[s[1:]],) + s[1:], d) if s[1:] in trailing else (s, d)
               for s, d in shapes)


def test_learner_step_is_the_actors(aot_programs, monkeypatch):
  c = small_config()
  seen = []
  real_step = learner.train_step

  def spy(params, opt_state, batch, **kw):
    seen.append((_shapes(batch), kw["use_clip"], kw["chunk"]))
    return real_step(params, opt_state, batch, **kw)
  monkeypatch.setattr(learner, "train_step", spy)
  actor = actor_lib.Actor(c, CFG, pad_id=0)
  tx = learner.make_optimizer(c.optim)
  params = models.init_params(CFG, jax.random.key(0))
  rng = np.random.default_rng(0)
  prompt = data.Prompt(question=None, ids=tuple(range(2, 2 + c.data.max_prompt_tokens)),
                       text="", think_gate=False)
  groups = [groups_lib.Group(prompt, [groups_lib.Response(
      tokens=rng.integers(2, 64, c.rollout.max_new_tokens).astype(np.int32),
      old_logp=np.full(c.rollout.max_new_tokens, -1.0, np.float32), text="")
      for _ in range(c.rollout.k)], advantages=np.array([0.5, -0.5]))
            for _ in range(c.train.batch_questions)]
  actor.update(params, tx.init(params), groups, use_clip=False, rng=rng)
  program, args = aot_programs["learner_step"]
  assert seen == [(_shapes(args[2]), program.kwargs["use_clip"], program.kwargs["chunk"])]


def test_flop_count_matches_the_model_on_a_loop_free_program():
  """The loop-aware count against XLA's, where there is no loop to disagree on."""
  cfg = dataclasses.replace(CFG, num_layers=1)
  params = models.init_params(cfg, jax.random.key(0))
  forward = jax.jit(lambda p, t: models.apply(cfg, p, t)[0])
  tokens = jnp.zeros((2, 16), jnp.int32)
  traced = forward.trace(params, tokens)
  counted = flops.matmul_flops(traced.jaxpr)
  xla = traced.lower().compile().cost_analysis()
  xla = xla[0] if isinstance(xla, (list, tuple)) else xla
  # Matmuls only: XLA's count adds the element-wise work (norms, softmax, RoPE).
  assert 0.8 * xla["flops"] <= counted <= xla["flops"]


def test_the_step_estimate_needs_every_program_of_the_step():
  """A v6e-8 compile of qwen7b once printed "rollout 0.2 s": the estimate of the programs
  that compiled. Without every program fitting there is none, and the report names the
  programs it lacks."""
  names = ["learner_step", "score", "admit", "decode_chunk", "release"]
  result = lambda name, **kw: analysis.Result(name, "", usable_bytes=100, peak_bytes=10,
                                              roofline_s=1.0, calls_per_step=2, **kw)
  fitting = [result(n) for n in names]
  step, lacking = check.step_estimate(fitting, names)
  assert lacking == [] and step == dict(rollout_s=6.0, old_logp_recompute_s=2.0,
                                        learner_s=2.0, total_s=10.0)
  partial = [result("learner_step"), result("score"), result("admit"),
             result("decode_chunk", error="CompileTimeHbmOom: ...")]
  assert check.step_estimate(partial, names) == (None, ["decode_chunk", "release"])
  too_big = fitting[:4] + [result("release", resident_bytes=95)]
  assert check.step_estimate(too_big, names) == (None, ["release"])


@pytest.mark.parametrize("kernel", [False, True])
def test_only_a_pool_of_several_sizes_has_a_growth_to_compile(kernel, monkeypatch):
  """XLA's attention reads the whole pool, so its pool grows (`repage_layer`, the costliest
  growth); the TPU kernel's is allocated at its largest by `empty` and never moves."""
  monkeypatch.setattr(programs_lib.paged_kernel, "wanted", lambda *_: kernel)
  mesh = sharding.make_mesh(small_config().mesh, jax.devices()[:1])
  listed = {p.name: p for p in programs_lib.training_step(small_config(), CFG, mesh)}
  largest = int(listed["decode_chunk"].purpose.split(" over the ")[1].split("-page")[0])
  assert listed["empty"].kwargs["kernel"] == kernel
  assert ("repage_layer" in listed) == (not kernel)
  assert (listed["empty"].kwargs["pages"] == largest) == kernel


def test_a_capped_pool_compiles_the_resume_beside_it_as_the_engine_runs_it(monkeypatch):
  """With `rollout.kv_pages` below every slot's row at its longest, rows are preempted and
  resumed: the list adds `resume` (a prefill of the longest unfinished row) and its
  `place`, compiled beside the full pool, with the arguments the engine gives them (its
  sequences are at most that long)."""
  c = small_config()
  c.rollout.kv_pages = 4  # two rows at their longest (2 pages of 64) in 8 slots
  listed, outputs, results = _compile_all(c)
  programs = {p.name: p for p in listed}
  assert "resume" in programs and "place_resumed" in programs
  assert results["resume"].resident_bytes >= analysis.shard_bytes(
      outputs["empty"][0].caches)  # beside the pool
  seen = []
  real_compiled = jax_engine.JaxEngine.compiled

  def spy(self, program, args, static, takes_cfg=True):
    if program is programs["resume"].fn:
      seen.append(_shapes(args))
    return real_compiled(self, program, args, static, takes_cfg)
  monkeypatch.setattr(jax_engine.JaxEngine, "compiled", spy)
  engine = sampling.make_engine("jax", CFG, None, max_rows=8, kv_pages=4, ignore_eos=True)
  prompts = [list(range(2, 2 + c.data.max_prompt_tokens))] * c.train.batch_questions
  engine.generate(prompts, c.rollout.k, models.init_params(CFG, jax.random.key(0)),
                  jax.random.key(1), sampling.SamplingConfig(max_new_tokens=40))
  assert engine.stats["preemptions"] > 0 and seen
  ours = _shapes(programs["resume"].args(outputs)[1:])
  for theirs in seen:  # the same arguments; the sequences no longer than the AOT's
    assert [(len(a), d) for a, d in theirs] == [(len(a), d) for a, d in ours]
    assert all(a[:-1] == b[:-1] and a[-1] <= b[-1] for (a, _), (b, _) in zip(theirs, ours))


def test_a_lora_step_compiles_the_adapters_and_their_state_beside_the_frozen_base():
  """With LoRA the learner step takes the adapters, their AdamW state and the frozen
  base (as `learner.train_step` passes them), and its state is the adapters' alone."""
  from exgrpo_jax.models import lora  # pylint: disable=g-import-not-at-top
  c = small_config()
  c.model.lora.rank = 4
  mesh = sharding.make_mesh(c.mesh, jax.devices()[:1])
  (step, score), (params, opt_state) = programs_lib.learner_programs(c, CFG, mesh)
  assert isinstance(params, lora.LoraParams)
  adapters = lora.abstract_adapters(CFG, 4, tuple(c.model.lora.targets))
  args = step.args({})
  assert _shapes(args[0]) == _shapes(adapters)
  assert args[3].adapters is None and _shapes(args[3].base) == _shapes(
      models.abstract_params(CFG))
  # AdamW's moments are the adapters' shapes; nothing in the state is the base's.
  base_shapes = {s for s, _ in _shapes(models.abstract_params(CFG))}
  assert not base_shapes & {s for s, _ in _shapes(opt_state) if len(s) > 1}
  result = check.compile_program(step, {}, mesh, HOST)
  assert not result.error, result.error
  full, _ = programs_lib.learner_programs(small_config(), CFG, mesh)
  full_result = check.compile_program(full[0], {}, mesh, HOST)
  assert result.output_bytes < full_result.output_bytes  # adapters and state only
  assert not check.compile_program(score, {}, mesh, HOST).error


# By default nf4; int8 (whose step qlora_test runs) is slow.
@pytest.mark.parametrize("kind", [pytest.param("int8", marks=pytest.mark.slow), "nf4"])
def test_a_qlora_step_takes_the_quantized_base_and_dequantizes_it_layer_by_layer(kind):
  """With `model.lora.base_quant` the step's frozen base is the quantized one a run
  holds (the projections as qwix arrays) and the step compiles with fewer argument
  bytes than over the unquantized base; no stacked projection exists at full precision
  in it (each layer's weights are dequantized inside the scan over layers), where the
  unquantized step has each as an argument. The rollout copy (dequantized, merged)
  compiles."""
  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.models import lora
  from exgrpo_jax.models import quant
  c = small_config()
  c.model.lora.update(rank=4, base_quant=kind)
  mesh = sharding.make_mesh(c.mesh, jax.devices()[:1])
  programs = {p.name: p for p in programs_lib.training_step(c, CFG, mesh)}
  step = programs["learner_step"]
  base = step.args({})[3].base
  assert _shapes(base) == _shapes(lora.quantize_base(models.init_params(CFG, jax.random.key(0)),
                                                     kind))
  assert any(quant.is_quantized(x) for x in jax.tree.leaves(base, is_leaf=quant.is_quantized))
  plain = c.copy_and_resolve_references()
  plain.model.lora.base_quant = "none"
  plain_step = programs_lib.learner_programs(plain, CFG, mesh)[0][0]
  weights = [f"f32[{','.join(map(str, w.shape))}]" for module in ("attn", "mlp")
             for w in models.abstract_params(CFG)["layers"][module].values() if w.ndim > 2]
  traced = lambda p: str(p.fn.trace(*p.args({}), **p.kwargs).jaxpr)
  assert all(w in traced(plain_step) for w in weights)
  assert not [w for w in weights if w in traced(step)]
  result = check.compile_program(step, {}, mesh, HOST)
  assert not result.error, result.error
  assert result.argument_bytes < check.compile_program(plain_step, {}, mesh,
                                                       HOST).argument_bytes
  assert not check.compile_program(programs["rollout_copy"], {}, mesh, HOST).error
