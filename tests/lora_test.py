"""LoRA (`exgrpo_jax.models.lora`): the adapters start at the base model exactly, a
learner step trains them alone, and every sampler receives the current adapter.

The reference for "the adapter applied" is the learner's own forward pass on
`LoraParams` (unmerged: x @ W + s (x @ A) @ B); the merged weights the samplers get must
reproduce it, and must differ from the base once the adapter has trained.
"""

import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from scipy import special

from configs import tiny
from exgrpo_jax import checkpointing
from exgrpo_jax import config_cli
from exgrpo_jax import models
from exgrpo_jax import sampling
from exgrpo_jax import sharding
from exgrpo_jax.models import export
from exgrpo_jax.models import lora
from exgrpo_jax.models import lora_base
from exgrpo_jax.sampling import continuous
from exgrpo_jax.sampling import vllm_engine
from exgrpo_jax.sampling import vllm_setup
from exgrpo_jax.training import actor
from exgrpo_jax.training import config_check
from exgrpo_jax.training import groups as groups_lib
from exgrpo_jax.training import learner
from exgrpo_jax.training import lora_run
from exgrpo_jax.training import run_state
from tests import vllm_stand_in

CFG = models.ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, eos_token_id=(1,))
RANK, ALPHA = 4, 8.0
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _lora_params(cfg=CFG, seed=0):
  base = models.init_params(cfg, jax.random.key(seed))
  adapters = lora.init_adapters(cfg, RANK, lora.TARGETS, jax.random.key(seed + 1))
  return lora.LoraParams(base, adapters, ALPHA / RANK)


def _tokens(n=3, t=10, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(2, CFG.vocab_size, (n, t)),
                     jnp.int32)


def test_adapter_axes_match_the_weights_they_adapt():
  """Each factor's shape and logical axes are its weight's input (A) and output (B) axes
  around the rank, so the sharding rules place them like the weight."""
  base_axes, base = models.logical_axes(CFG), models.abstract_params(CFG)
  axes, shapes = lora.logical_axes(lora.TARGETS), lora.abstract_adapters(CFG, RANK,
                                                                         lora.TARGETS)
  for module, targets in axes["layers"].items():
    for name, ab in targets.items():
      w_axes, w = tuple(base_axes["layers"][module][name]), base["layers"][module][name]
      a, b = shapes["layers"][module][name]["a"], shapes["layers"][module][name]["b"]
      n_in = len(ab["a"]) - 2
      assert tuple(ab["a"]) == w_axes[:1 + n_in] + (lora.RANK_AXIS,)
      assert tuple(ab["b"]) == (w_axes[0], lora.RANK_AXIS) + w_axes[1 + n_in:]
      assert a.shape == w.shape[:1 + n_in] + (RANK,)
      assert b.shape == (w.shape[0], RANK) + w.shape[1 + n_in:]


def test_step_zero_logits_equal_the_base_models():
  """B starts at zero: the LoRA policy's logits are the base model's, bit for bit."""
  params = _lora_params()
  for path, x in jax.tree_util.tree_leaves_with_path(params.adapters):
    assert (float(jnp.abs(x).max()) == 0) == (path[-1].key == "b"), jax.tree_util.keystr(path)
  tokens = _tokens()
  want, _ = models.apply(CFG, params.base, tokens)
  got, _ = models.apply(CFG, params, tokens)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_merged_weights_compute_the_unmerged_forward():
  """With a non-zero B, the merged weights (the samplers') give the unmerged forward's
  logits, and both differ from the base's."""
  params = _lora_params()
  params = params.replace(adapters=jax.tree.map(
      lambda x: x + 0.05 * jax.random.normal(jax.random.key(3), x.shape), params.adapters))
  tokens = _tokens()
  unmerged, _ = models.apply(CFG, params, tokens)
  merged, _ = models.apply(CFG, lora.merged(params), tokens)
  base, _ = models.apply(CFG, params.base, tokens)
  np.testing.assert_allclose(np.asarray(merged), np.asarray(unmerged), rtol=1e-4, atol=1e-4)
  assert float(jnp.abs(unmerged - base).max()) > 1e-2


def _groups(n=6, prompt=8, response=12, seed=0):
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    tokens = rng.integers(2, 96, int(rng.integers(2, response)))
    out.append(types.SimpleNamespace(
        prompt_ids=list(rng.integers(2, 96, prompt)),
        responses=[groups_lib.Response(tokens, rng.normal(-4.5, 0.3, len(tokens))
                                       .astype(np.float32), "")],
        advantages=np.array([float(rng.normal())])))
  return out


def _config(lr=1e-2):
  config = tiny.get_config()
  config.rollout.max_new_tokens = 12
  config.optim.update(lr=lr, micro_batch_size=2, mini_batches=1)
  return config


def train(params, steps, config=None, cfg=CFG):
  """`steps` learner steps of LoRA `params` (of model `cfg`) on fixed groups; returns
  (params, opt)."""
  config = config or _config()
  act = actor.Actor(config, cfg, pad_id=0)
  opt_state = learner.make_optimizer(config.optim).init(params.adapters)
  for step in range(steps):
    params, opt_state, metrics = act.update(params, opt_state, _groups(seed=step), True,
                                            np.random.default_rng(step))
    assert metrics["skipped"] == 0
  return params, opt_state


def test_a_step_trains_the_adapters_alone():
  """After a step the base's bytes are those it started with, every B has moved off
  zero, and the optimizer state holds adapter-shaped leaves only."""
  params = _lora_params()
  base_bytes = [np.asarray(x).tobytes() for x in jax.tree.leaves(params.base)]
  params, opt_state = train(params, 1)
  assert [np.asarray(x).tobytes() for x in jax.tree.leaves(params.base)] == base_bytes
  for path, b in jax.tree_util.tree_leaves_with_path(params.adapters):
    if path[-1].key == "b":
      assert float(jnp.abs(b).max()) > 0, jax.tree_util.keystr(path)
  adapter_shapes = {x.shape for x in jax.tree.leaves(params.adapters)}
  for leaf in jax.tree.leaves(opt_state):
    assert leaf.ndim == 0 or leaf.shape in adapter_shapes, leaf.shape
  n_adapter = sum(x.size for x in jax.tree.leaves(params.adapters))
  assert sum(x.size for x in jax.tree.leaves(opt_state) if x.ndim) == 2 * n_adapter


PROMPTS = [[5, 6, 7], list(range(20, 37)), [3, 9, 4, 11, 2, 8, 30, 31, 40]]
GREEDY = sampling.SamplingConfig(max_new_tokens=10, greedy=True)


@pytest.fixture(scope="module")
def trained():
  """LoRA params after 3 learner steps (B well off zero)."""
  return train(_lora_params(), 3, _config(lr=5e-2))[0]


def _learner_logp(params, prompt, tokens, cfg):
  """The learner's log-softmax [n, V] at each of `tokens` (teacher-forced, no cache)."""
  ids = jnp.asarray([list(prompt) + list(tokens)], jnp.int32)
  logits = np.asarray(models.apply(cfg, params, ids)[0][0], np.float64)
  logits = logits[len(prompt) - 1:len(prompt) - 1 + len(tokens)]
  return logits - special.logsumexp(logits, axis=-1, keepdims=True)


def _on_mesh(params: lora.LoraParams) -> lora.LoraParams:
  """`params` placed as a run places them: the base and adapters by the learner's rules
  on a mesh of every device."""
  mesh = sharding.make_mesh(ml_collections.ConfigDict(dict(shape=(-1, 1),
                                                           axes=("fsdp", "tensor"))))
  return params.replace(
      base=jax.device_put(params.base, models.param_shardings(CFG, mesh)),
      adapters=jax.device_put(params.adapters,
                              lora.adapter_shardings(CFG, RANK, lora.TARGETS, mesh)))


@pytest.mark.parametrize("options, on_mesh", [
    (dict(scheduler="static"), False), (dict(max_rows=2), False),
    (dict(max_rows=2), True)], ids=["static", "continuous", "continuous-mesh"])
def test_the_jax_engine_samples_the_current_adapter(trained, options, on_mesh, monkeypatch):
  """Greedy rollouts of the trained LoRA policy are the learner's argmax tokens with the
  learner's log-probs (adapter applied), which differ from the base model's; on a mesh
  the engine merges while it makes its rollout copy."""
  if on_mesh:
    trained = _on_mesh(trained)
  continuous_calls = []
  real = continuous.generate
  monkeypatch.setattr(continuous, "generate",
                      lambda *a, **k: continuous_calls.append(1) or real(*a, **k))
  engine = sampling.make_engine("jax", CFG, None, **options)
  out = engine.generate(PROMPTS, 2, trained, jax.random.key(0), GREEDY)
  assert bool(continuous_calls) == ("max_rows" in options)
  check_rows_follow_the_adapter(out, PROMPTS, trained, CFG, atol=1e-5)


def check_rows_follow_the_adapter(out, prompts, trained, cfg, atol):
  """Each greedy row of `out` is the learner's argmax under `trained` (adapter applied,
  unmerged) with the learner's log-probs (within `atol`), and the base model's
  log-probs differ from those by more than 1e-2 somewhere."""
  base_gap = 0.0
  for r, n in enumerate(out.lengths_N):
    prompt, tokens = prompts[out.prompt_index_N[r]], out.tokens_NxT[r, :n]
    logp_nxV = _learner_logp(trained, prompt, tokens, cfg)
    np.testing.assert_array_equal(tokens, logp_nxV.argmax(-1))
    np.testing.assert_allclose(out.logprobs_NxT[r, :n], logp_nxV[np.arange(n), tokens],
                               atol=atol)
    base_nxV = _learner_logp(trained.base, prompt, tokens, cfg)
    base_gap = max(base_gap, float(np.abs(base_nxV - logp_nxV).max()))
  assert base_gap > 1e-2


def test_vllm_receives_the_merged_weights(monkeypatch):
  """The vLLM engine (the stand-in) generates with W + s A @ B, not the base."""
  pytest.importorskip("torch", reason="the vLLM engine hands vLLM torch tensors")
  monkeypatch.setitem(sys.modules, "vllm", vllm_stand_in)
  monkeypatch.setattr(vllm_engine, "check_available", lambda: "cuda")
  monkeypatch.setattr(vllm_engine, "_device_bytes", lambda rank: 80 * vllm_setup.GIB)
  vllm_stand_in.INSTANCES.clear()
  params = _lora_params()
  params = params.replace(adapters=jax.tree.map(lambda x: x + 0.05, params.adapters))
  engine = vllm_engine.VllmEngine(CFG, vllm_stand_in.tiny_tokenizer(CFG.vocab_size),
                                  vllm_setup.VllmOptions(max_model_len=48))
  engine.generate(PROMPTS, 1, params, jax.random.key(0), sampling.SamplingConfig(
      max_new_tokens=4))
  loaded = vllm_stand_in.INSTANCES[0].generated_with
  merged = dict(export.hf_state_dict(CFG, lora.merged(params), dtype="float32"))
  base = dict(export.hf_state_dict(CFG, params.base, dtype="float32"))
  assert set(loaded) == set(merged)
  for name, array in merged.items():
    np.testing.assert_array_equal(loaded[name][2], array, err_msg=name)
  assert not np.allclose(loaded["model.layers.0.mlp.down_proj.weight"][2],
                         base["model.layers.0.mlp.down_proj.weight"])


@pytest.mark.parametrize("overrides, line", [
    (dict(rank=-1), "config.model.lora.rank=-1: must be a whole number >= 0"),
    (dict(rank=True), "config.model.lora.rank=True: must be a whole number >= 0"),
    (dict(rank=4, alpha=0.0), "config.model.lora.alpha=0.0: must be a number > 0"),
    (dict(rank=4, targets=["q_proj", "qkv"]),
     "config.model.lora.targets=['q_proj', 'qkv']: name each weight once, from q_proj"),
    (dict(rank=4, base_quant="int4"), "config.model.lora.base_quant='int4': must be one of"),
    (dict(alpha=32.0), "config.model.lora.alpha=32.0: set only with model.lora.rank > 0"),
    (dict(targets=["q_proj"]), "config.model.lora.targets=['q_proj']: set only with"),
])
def test_bad_lora_values_get_one_line_each(overrides, line):
  config = tiny.get_config()
  config.model.lora.update(overrides)
  with pytest.raises(config_check.ConfigError) as e:
    config_check.check(config)
  assert line in str(e.value) and len(str(e.value).splitlines()) == 1


def test_the_defaults_are_full_fine_tuning():
  config = tiny.get_config()
  assert config.model.lora.rank == 0
  config_check.check(config)
  config.model.lora.update(rank=1, alpha=2.0, targets=["q_proj", "down_proj"])
  config_check.check(config)


def _train_cli(workdir, steps, *flags):
  return subprocess.run(
      [sys.executable, "-m", "exgrpo_jax.train", "--config=configs/tiny.py",
       f"--workdir={workdir}", f"--config.train.steps={steps}", "--config.train.export_dir=",
       "--config.model.lora.rank=4", *flags], cwd=REPO, capture_output=True, text=True,
      timeout=600)


@pytest.mark.parametrize("text, targets", [
    ("q_proj,v_proj", ["q_proj", "v_proj"]), ("q_proj, v_proj", ["q_proj", "v_proj"]),
    ("('q_proj', 'v_proj')", ["q_proj", "v_proj"]), ('["q_proj"]', ["q_proj"]),
    ("q_proj", ["q_proj"]), ("'q_proj'", ["q_proj"]), ("", [])])
def test_a_list_key_takes_a_comma_list_or_a_python_list_or_tuple(text, targets):
  assert config_cli.ListParser().parse(text) == targets


def test_targets_from_the_command_line_train_those_projections_alone(tmp_path):
  """`--config.model.lora.targets=q_proj,v_proj`: the checkpoint holds adapters on q_proj
  and v_proj only, and a step moved their B off zero."""
  proc = _train_cli(tmp_path, 1, "--config.model.lora.targets=q_proj,v_proj")
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(tmp_path / "config.json", encoding="utf-8") as f:
    assert json.load(f)["model"]["lora"]["targets"] == ["q_proj", "v_proj"]
  _, params, _ = checkpointing.load_policy_for_export(str(tmp_path))
  assert {m: sorted(t) for m, t in params.adapters["layers"].items()} == {
      "attn": ["q_proj", "v_proj"]}
  for name, ab in params.adapters["layers"]["attn"].items():
    assert float(np.abs(ab["b"]).max()) > 0, name


@pytest.mark.parametrize("value, line", [
    ("q_proj,qkv", "config.model.lora.targets=['q_proj', 'qkv']: name each weight once, "
                   "from q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj (qkv "
                   "names no weight)"),
    ("", "config.model.lora.targets=[]: name each weight once, from q_proj, k_proj, v_proj, "
         "o_proj, gate_proj, up_proj, down_proj")])
def test_bad_targets_on_the_command_line_are_one_line(tmp_path, value, line):
  proc = _train_cli(tmp_path / "run", 1, f"--config.model.lora.targets={value}")
  assert proc.returncode == 2, proc.stderr[-3000:]
  assert proc.stderr.strip() == f"exgrpo_jax.train: {line}"
  assert not os.path.exists(tmp_path / "run")


def test_a_resume_on_another_base_or_lora_section_is_refused_in_one_line(tmp_path):
  """The checkpoint holds the adapters only; a resume whose base differs from the one
  they were trained on (here: the random base drawn in bfloat16), or with another rank,
  exits 2 with one line and trains nothing. The convert CLI exports the checkpoint's
  adapters on its base (merged model and PEFT directory)."""
  first = _train_cli(tmp_path, 1, "--config.train.checkpoint_every=1")
  assert first.returncode == 0, first.stderr[-3000:]
  with open(tmp_path / "checkpoints" / "1" / "meta" / "metadata", encoding="utf-8") as f:
    assert json.load(f)["lora_base"]["path"] == "random_init"
  for flag, line in [
      ("--config.model.param_dtype=bfloat16",
       "config.model.random_init=True: the LoRA checkpoint being resumed was trained on "
       "the base 'random_init'"),
      ("--config.model.lora.rank=8",
       "config.model.lora.rank=8: the checkpoint being resumed was trained with 4")]:
    refused = _train_cli(tmp_path, 2, flag)
    assert refused.returncode == 2, refused.stderr[-3000:]
    errors = [x for x in refused.stderr.splitlines() if "exgrpo_jax.train:" in x]
    assert len(errors) == 1 and line in errors[0], refused.stderr[-3000:]
    assert checkpointing.latest_step_dir(str(tmp_path / "checkpoints")).endswith("1")


  # Export and evaluation read the adapters on the base the checkpoint names.
  cfg, params, _ = checkpointing.load_policy_for_export(str(tmp_path))
  assert isinstance(params, lora.LoraParams) and params.scale == 16.0 / 4
  for got, want in zip(jax.tree.leaves(params.base), jax.tree.leaves(
      models.init_params(cfg, jax.random.key(tiny.get_config().train.seed)))):
    np.testing.assert_array_equal(got, want)
  converted = subprocess.run(
      [sys.executable, "-m", "exgrpo_jax.convert", f"--src={tmp_path}",
       f"--dst={tmp_path / 'hf'}"], cwd=REPO, capture_output=True, text=True, timeout=600)
  assert converted.returncode == 0, converted.stderr[-3000:]
  assert "Metadata file does not exist" not in converted.stderr  # Orbax's false warning
  assert os.path.exists(tmp_path / "hf" / "adapter" / "adapter_model.safetensors")


def _tiny_base(dst, seed: int) -> None:
  """configs/tiny.py's random model (seed `seed`) as an HF directory at `dst`."""
  tokenizer = models.load_tokenizer(models.default_model_path())
  cfg = run_state._model_config_for_random_init(tiny.get_config(), tokenizer)  # pylint: disable=protected-access
  models.save_pretrained(cfg, models.init_params(cfg, jax.random.key(seed)), str(dst),
                         tokenizer_src=models.default_model_path())


@pytest.mark.slow  # by default: test_the_fingerprint_is_the_weight_files_content
def test_a_lora_resume_follows_its_bases_content_not_its_path(tmp_path):
  """A LoRA checkpoint names its base by content: the same base moved to another
  `model.path` resumes; other weights at that path are refused in one line."""
  _tiny_base(tmp_path / "base", seed=0)
  base = ["--config.model.random_init=False", "--config.train.checkpoint_every=1"]
  workdir = tmp_path / "run"
  first = _train_cli(workdir, 1, *base, f"--config.model.path={tmp_path / 'base'}")
  assert first.returncode == 0, first.stderr[-3000:]
  os.rename(tmp_path / "base", tmp_path / "moved")
  moved = [*base, f"--config.model.path={tmp_path / 'moved'}"]
  resumed = _train_cli(workdir, 2, *moved)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "warning" not in resumed.stderr
  assert checkpointing.latest_step_dir(str(workdir / "checkpoints")).endswith("2")
  shutil.rmtree(tmp_path / "moved")
  _tiny_base(tmp_path / "moved", seed=1)
  refused = _train_cli(workdir, 3, *moved)
  assert refused.returncode == 2, refused.stderr[-3000:]
  errors = [x for x in refused.stderr.splitlines() if "exgrpo_jax.train:" in x]
  assert len(errors) == 1 and errors[0].startswith(
      f"exgrpo_jax.train: config.model.path='{tmp_path / 'moved'}': the LoRA checkpoint "
      f"being resumed was trained on the base '{tmp_path / 'moved'}'"), refused.stderr
  assert checkpointing.latest_step_dir(str(workdir / "checkpoints")).endswith("2")


def test_the_fingerprint_is_the_weight_files_content(tmp_path):
  """A base directory's hash follows its weight files' bytes (not their dates or other
  files); another content is refused on resume."""
  config = tiny.get_config()
  config.model.update(random_init=False, path=str(tmp_path), lora=dict(rank=4))
  (tmp_path / "model.safetensors").write_bytes(b"weights")
  (tmp_path / "config.json").write_text("{}")
  first = lora_base.base_fingerprint(config, str(tmp_path))
  (tmp_path / "config.json").write_text('{"a": 1}')
  assert lora_base.base_fingerprint(config, str(tmp_path)) == first
  (tmp_path / "model.safetensors").write_bytes(b"weightz")
  second = lora_base.base_fingerprint(config, str(tmp_path))
  assert second["path"] == first["path"] and second["sha256"] != first["sha256"]
  meta = dict(config=config.to_dict(), lora_base=first)
  lora_run.check_resume(meta, config, lambda: first)
  with pytest.raises(config_check.ConfigError, match="trained on the base"):
    lora_run.check_resume(meta, config, lambda: second)


def test_the_peft_adapter_and_the_merged_export_give_the_trainers_logits(tmp_path):
  """save_pretrained of LoRA params: the merged HF model, and `adapter/` that `peft`
  loads onto the transformers base model; both within the HF parity tolerance (1e-4,
  tests/models_test.py) of the learner's unmerged forward."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  peft = pytest.importorskip("peft", reason="peft is not installed (the `test` extra)")
  from tests import models_test  # pylint: disable=g-import-not-at-top
  base_dir = str(tmp_path / "base")
  models_test.make_hf_model("qwen2", tied=False, seed=3).save_pretrained(base_dir)
  policy = models.from_pretrained(base_dir)
  cfg = policy.config
  adapters = lora.init_adapters(cfg, RANK, lora.TARGETS, jax.random.key(1))
  adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape),
                          adapters)
  params = lora.LoraParams(policy.params, adapters, ALPHA / RANK)
  ids = models_test.random_ids((2, 40), cfg.vocab_size)
  ours = np.asarray(models.apply(cfg, params, ids)[0])
  assert np.abs(ours - np.asarray(policy(ids))).max() > 1e-2  # the adapter matters

  dst = str(tmp_path / "export")
  models.save_pretrained(cfg, params, dst, tokenizer_src=base_dir, adapter_base=base_dir)
  merged = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32)
  assert np.abs(models_test.hf_logits(merged, ids) - ours).max() <= 1e-4
  with open(os.path.join(dst, "adapter", "adapter_config.json"), encoding="utf-8") as f:
    assert json.load(f)["base_model_name_or_path"] == base_dir
  base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
  with_adapter = peft.PeftModel.from_pretrained(base, os.path.join(dst, "adapter")).eval()
  assert np.abs(models_test.hf_logits(with_adapter, ids) - ours).max() <= 1e-4


def test_adapter_gradients_do_not_depend_on_micro_batches_packing_or_remat():
  """The learner's paths are the full model's: the adapters' gradient of one mini-batch
  is the same with 1 or 6 rows per micro-batch, packed or not, with or without remat."""
  from tests import learner_test  # pylint: disable=g-import-not-at-top
  params = _lora_params(learner_test.CFG)
  params = params.replace(adapters=jax.tree.map(lambda x: x + 0.02, params.adapters))
  frozen = params.replace(adapters=None)
  algo = learner_test._algo("token_sum_norm")
  results = []
  for remat, micro, pack in (("none", 6, True), ("none", 1, False), ("full", 2, True)):
    cfg = dataclasses.replace(learner_test.CFG, remat=remat)
    grads, _ = jax.jit(functools.partial(
        learner.accumulate_gradients, cfg=cfg, algo=algo, use_clip=True, chunk=5))(
            params.adapters, learner_test._batch(micro, pack=pack), frozen)
    results.append(grads)
  assert jax.tree.structure(results[0]) == jax.tree.structure(params.adapters)
  assert float(optax.global_norm(results[0])) > 0
  for other in results[1:]:
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(other)):
      np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7)
