"""Fault injection into checkpoints: bit flips, truncation, missing items, empty step
directories, non-finite parameters, a full disk. Each case asserts an exact fallback to
the newest intact step (with one line saying so) or a one-line CheckpointError.

Library level (CheckpointStore on small trees), so the cases run in the default suite;
the process-level kills are in fault_process_test.py.
"""

import os

import jax
import numpy as np
import pytest

from exgrpo_jax import checkpointing
from tests import faults


def _state(step: int):
  rng = np.random.default_rng(step)
  params = {"embed": rng.normal(size=(64, 32)).astype(np.float32),
            "layer": {"w": rng.normal(size=(32, 32)).astype(np.float32)}}
  opt = {"mu": rng.normal(size=(64, 32)).astype(np.float32),
         "count": np.array(step, np.int32)}
  host = {"tokens": rng.integers(0, 100, size=(5, 7)).astype(np.int32),
          "none": np.zeros((0, 3), np.float32)}
  meta = {"step": step, "stream": [1, 2, 3]}
  return params, opt, host, meta


def _abstract(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _store(workdir, keep=3):
  return checkpointing.CheckpointStore(str(workdir), keep=keep)


def _saved(workdir, steps=(1, 2, 3), keep=3):
  store = _store(workdir, keep)
  for step in steps:
    store.save(step, *_state(step))
  store.close()


def _restore(workdir):
  store = _store(workdir)
  params, opt, _, _ = _state(0)
  try:
    return store.restore_newest_intact(_abstract(params), _abstract(opt))
  finally:
    store.close()


def _assert_is_step(restored, step):
  got_step, (params, opt, host, meta) = restored
  assert got_step == step
  want = _state(step)
  for a, b in zip(jax.tree.leaves((params, opt, host)), jax.tree.leaves(want[:3])):
    np.testing.assert_array_equal(np.asarray(a), b)
  assert host["none"].shape == (0, 3)
  assert meta["step"] == step


def _files(step_dir, item):
  found = []
  for root, _, files in os.walk(os.path.join(step_dir, item)):
    found += [os.path.join(root, f) for f in files]
  return sorted(found, key=os.path.getsize)


def _largest(step_dir, item):
  return _files(step_dir, item)[-1]


def test_intact_run_restores_newest_step(tmp_path):
  _saved(tmp_path)
  _assert_is_step(_restore(tmp_path), 3)


@pytest.mark.parametrize("item", checkpointing.ITEMS)
@pytest.mark.parametrize("fault", [faults.flip_bytes, faults.truncate], ids=["flip64", "truncate"])
def test_damaged_item_falls_back_to_previous_step(tmp_path, capfd, item, fault):
  _saved(tmp_path)
  fault(_largest(os.path.join(checkpointing.checkpoint_dir(tmp_path), "3"), item))
  _assert_is_step(_restore(tmp_path), 2)
  lines = [l for l in capfd.readouterr().err.splitlines() if "damaged" in l]
  assert len(lines) == 1 and "checkpoint 3 is damaged" in lines[0], lines
  assert "falling back to step 2" in lines[0]
  # Moved aside, so the resumed run can write step 3 again.
  assert os.path.isdir(os.path.join(checkpointing.damaged_dir(tmp_path), "3"))
  store = _store(tmp_path)
  assert store.latest_step() == 2
  store.save(3, *_state(3))
  store.close()
  _assert_is_step(_restore(tmp_path), 3)


def test_empty_and_partial_step_directories_are_skipped(tmp_path, capfd):
  _saved(tmp_path, steps=(1, 2))
  os.makedirs(os.path.join(checkpointing.checkpoint_dir(tmp_path), "4"))
  os.makedirs(os.path.join(checkpointing.checkpoint_dir(tmp_path), "3", "params"))
  _assert_is_step(_restore(tmp_path), 2)
  err = capfd.readouterr().err
  assert "checkpoint 4 is damaged (empty step directory)" in err
  assert "checkpoint 3 is damaged (missing item(s) opt, host, meta)" in err


def test_legacy_checkpoint_without_manifest_is_checked_for_finite_values(tmp_path, capfd):
  _saved(tmp_path, steps=(1, 2))
  step_dir = os.path.join(checkpointing.checkpoint_dir(tmp_path), "2")
  os.remove(os.path.join(step_dir, checkpointing.MANIFEST))
  _assert_is_step(_restore(tmp_path), 2)  # no manifest: still restorable
  # NaNs written into the raw data (the case) are caught by the value check.
  store = _store(tmp_path)
  params, opt, host, meta = _state(2)
  params["embed"][3, :] = np.nan
  store._manager.delete(2)  # pylint: disable=protected-access
  store._manager.save(2, args=checkpointing.ocp.args.Composite(  # pylint: disable=protected-access
      params=checkpointing.ocp.args.StandardSave(params),
      opt=checkpointing.ocp.args.StandardSave(opt),
      host=checkpointing.ocp.args.StandardSave({"tokens": host["tokens"]}),
      meta=checkpointing.ocp.args.JsonSave(dict(meta, empty_host_arrays={
          "none": [[0, 3], "<f4"]}))), force=True)
  store.close()
  _assert_is_step(_restore(tmp_path), 1)
  assert "params['embed'] holds non-finite values" in capfd.readouterr().err


def test_every_step_damaged_is_one_error_and_nothing_is_moved(tmp_path):
  _saved(tmp_path, steps=(1, 2))
  for step in (1, 2):
    faults.flip_bytes(_largest(os.path.join(checkpointing.checkpoint_dir(tmp_path), str(step)),
                         "params"))
  with pytest.raises(checkpointing.CheckpointError, match="no intact checkpoint") as e:
    _restore(tmp_path)
  assert "\n" not in str(e.value)
  assert not os.path.exists(checkpointing.damaged_dir(tmp_path))


def test_non_finite_params_are_never_saved_and_keep_the_last_good(tmp_path):
  store = _store(tmp_path, keep=1)
  store.save(1, *_state(1))
  params, opt, host, meta = _state(2)
  params["layer"]["w"][0, 0] = np.inf
  with pytest.raises(checkpointing.CheckpointError, match="not finite"):
    store.save(2, params, opt, host, meta)
  assert store.latest_step() == 1
  store.close()
  _assert_is_step(_restore(tmp_path), 1)


def test_rotation_keeps_the_newest_complete_steps(tmp_path):
  _saved(tmp_path, steps=(1, 2, 3, 4), keep=2)
  store = _store(tmp_path)
  assert store._manager.all_steps() == [3, 4]  # pylint: disable=protected-access
  store.close()


def test_full_disk_at_a_checkpoint_is_one_line_and_keeps_the_last(tmp_path):
  with faults.small_filesystem(str(tmp_path / "fs")) as workdir:
    store = _store(workdir)
    store.save(1, *_state(1))
    faults.fill(workdir)
    with pytest.raises(checkpointing.CheckpointError, match="No space left on device") as e:
      store.save(2, *_state(2))
    assert "\n" not in str(e.value)
    store.close()
    os.remove(os.path.join(workdir, "filler"))
    _assert_is_step(_restore(workdir), 1)


def test_read_only_checkpoint_dir_is_one_line(tmp_path):
  store = _store(tmp_path)
  store.save(1, *_state(1))
  with faults.read_only(store.directory):
    with pytest.raises(checkpointing.CheckpointError, match="Permission denied") as e:
      store.save(2, *_state(2))
  assert "\n" not in str(e.value)
  store.close()
  _assert_is_step(_restore(tmp_path), 1)
