"""docs/algorithm.md against the code: the switches no other test covers, and the doc's sync.

* The optimizer step's skip (§12): a gradient norm above `optim.skip_grad_norm`, or a
  non-finite one, leaves the parameters and AdamW state as they were and is counted.
* The no-IS ablation (§7): the replayed member is compared with the current policy's
  log-probs instead of the stored behaviour ones.
* The document: every algorithm key, registered name and variant has its entry, every
  cited test exists and is marked slow exactly when the doc says so, and every
  "docs/algorithm.md §N" in the repository names a section.
"""

import ast
import glob
import os
import re

import jax
import ml_collections
import numpy as np
import pytest

from configs import common
from exgrpo_jax import advantages
from exgrpo_jax import losses
from exgrpo_jax import models
from exgrpo_jax.replay import buckets
from exgrpo_jax.replay import selection
from exgrpo_jax.training import learner
from tests import conftest
from tests import learner_test
from tests import train_phases_test
from tests import trainer_test

DOC = os.path.join(conftest.REPO_ROOT, "docs", "algorithm.md")
with open(DOC, encoding="utf-8") as _f:
  TEXT = _f.read()
SECTIONS = {int(n) for n in re.findall(r"^## (\d+)\. ", TEXT, re.M)}


@pytest.mark.parametrize("case", ["applied", "above_the_bound", "non_finite"])
def test_steps_with_a_large_or_non_finite_gradient_norm_are_skipped(case):
  optim = ml_collections.ConfigDict(dict(lr=1e-2, weight_decay=0.01, b1=0.9, b2=0.999,
                                         eps=1e-8, grad_clip=1.0, skip_grad_norm=500.0))
  batch = learner_test._batch(learner_test.N)  # pylint: disable=protected-access
  if case == "above_the_bound":  # advantages 1e6 times larger: a norm far above 500
    batch = batch.replace(adv_MxBxR=batch.adv_MxBxR * 1e6)
  elif case == "non_finite":
    batch = batch.replace(adv_MxBxR=np.full_like(batch.adv_MxBxR, np.nan))
  tx = learner.make_optimizer(optim)
  params = models.init_params(learner_test.CFG, jax.random.key(0))
  opt_state = tx.init(params)
  before = jax.tree.map(np.array, (params, opt_state))  # the step donates its inputs
  params, opt_state, metrics = learner.train_step(
      params, opt_state, batch, cfg=learner_test.CFG,
      algo=learner_test._algo("token_sum_norm"),  # pylint: disable=protected-access
      optim=learner.frozen(optim), use_clip=True, chunk=5)
  metrics = jax.device_get(metrics)
  unchanged = all(np.array_equal(a, np.asarray(b)) for a, b in
                  zip(jax.tree.leaves(before), jax.tree.leaves((params, opt_state))))
  if case == "applied":
    assert metrics["skipped"] == 0 and metrics["grad_norm"] < 500 and not unchanged
  else:
    assert metrics["skipped"] == 1 and unchanged
    if case == "non_finite":
      assert not np.isfinite(metrics["grad_norm"])
    else:
      assert metrics["grad_norm"] > 500


@pytest.mark.parametrize("is_correction", [True, False])
def test_no_is_correction_replays_with_the_current_log_probs(tmp_path, is_correction):
  engine = trainer_test.ScriptedEngine()
  trainer = train_phases_test._trainer(  # pylint: disable=protected-access
      tmp_path, engine, algo__is_correction=is_correction)
  try:
    st = trainer.state
    question = st.prompts[0].question.uid
    tokens = st.tokenizer("The answer is 4.", add_special_tokens=False)["input_ids"]
    tokens = np.array(tokens + [st.tokenizer.eos_token_id], np.int32)
    behaviour = np.full(len(tokens), -0.5, np.float32)  # exact in the buffer's 2^-10 code
    k = trainer.config.rollout.k
    st.buffer.update([question], np.array([[1.0] + [0.0] * (k - 1)]),
                     [[(tokens, behaviour)] * k], step=1)
    st.replay_started = True
    [replay] = [g for g in trainer.compose(np.random.default_rng(0)) if g.is_replay]
    old_logp = replay.responses[-1].old_logp
    current = train_phases_test._teacher_forced(  # pylint: disable=protected-access
        trainer, st.params, [replay.prompt_ids], [tokens])[0]
    assert replay.question_id == question and replay.responses[-1].is_replay
    np.testing.assert_array_equal(replay.responses[-1].tokens, tokens)
    if is_correction:
      np.testing.assert_array_equal(old_logp, behaviour)
    else:
      np.testing.assert_allclose(old_logp, current, atol=1e-5)
      assert np.abs(current - behaviour).max() > 0.1  # the two sources really differ
  finally:
    trainer.close()


def test_every_algorithm_key_and_variant_is_in_the_doc():
  config = common.base_config()
  keys = [f"{section}.{key}" for section in ("algo", "replay", "optim", "reward")
          for key in config[section]]
  keys += ["rollout.k", "rollout.temperature", "rollout.top_p", "rollout.top_k",
           "rollout.max_new_tokens", "train.batch_questions", "train.steps", "train.seed",
           "data.max_prompt_tokens", "data.template", "eval.every", "eval.temperature",
           "eval.n", "eval.max_new_tokens"]
  assert not [k for k in keys if f"`{k}`" not in TEXT], "config keys docs/algorithm.md lacks"
  names = [*losses.POLICY_LOSSES.names(), *advantages.ADVANTAGES.names(),
           *losses.AGGREGATIONS, *selection.SELECTIONS.names(), *buckets.WEIGHTINGS,
           *buckets.BUCKETINGS]
  assert not [n for n in names if f"`{n}`" not in TEXT], "registered names it lacks"
  variants = TEXT[TEXT.index("## 17. "):TEXT.index("## 18. ")]
  rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)` \|.*$", variants, re.M)}
  assert set(rows) == set(common.VARIANTS)
  for name, (overrides, _) in common.VARIANTS.items():
    assert all(f"`{key}=" in rows[name] for key in overrides), rows[name]


def _slow(tree: ast.Module, function: ast.FunctionDef) -> bool:
  """Whether every case of the test is marked slow: a parametrization that marks only
  some cases slow leaves the others in the default suite."""
  marks = [ast.unparse(d) for d in function.decorator_list]
  marks = [m for m in marks if not m.startswith("pytest.mark.parametrize")]
  marks += [ast.unparse(n.value) for n in tree.body if isinstance(n, ast.Assign)
            and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)]
  return any("slow" in m for m in marks)


def test_cited_tests_exist_and_say_when_they_are_slow():
  cited = re.findall(r"`(tests/\w+\.py)::(\w+)`( \*\(slow\)\*)?", TEXT)
  assert len(cited) > 50
  for path, name, slow_note in cited:
    with open(os.path.join(conftest.REPO_ROOT, path), encoding="utf-8") as f:
      tree = ast.parse(f.read())
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    assert found, f"docs/algorithm.md cites {path}::{name}, which does not exist"
    assert _slow(tree, found[0]) == bool(slow_note), (
        f"docs/algorithm.md: {path}::{name} is {'' if slow_note else 'not '}marked "
        "*(slow)* but the test is the other way")


def test_sections_are_numbered_and_every_citation_names_one():
  assert SECTIONS == set(range(1, max(SECTIONS) + 1))
  root = conftest.REPO_ROOT
  files = [os.path.join(root, "README.md")]
  for pattern in ("docs/*.md", "exgrpo_jax/**/*.py", "configs/*.py", "scripts/**/*",
                  "tests/*.py"):
    files += [p for p in glob.glob(os.path.join(root, pattern), recursive=True)
              if os.path.isfile(p)]
  citing = 0
  for path in files:
    with open(path, encoding="utf-8") as f:
      text = f.read()
    if path != DOC and "algorithm.md" not in text:
      continue
    citing += 1
    numbers = {int(n) for n in re.findall(r"§(\d+)", text)}
    assert numbers <= SECTIONS, f"{os.path.relpath(path, root)} cites {numbers - SECTIONS}"
  assert citing > 15
