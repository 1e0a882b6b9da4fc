"""Run logging: loggers by name, the config written at start, evaluation samples."""

import glob
import importlib
import json
import os
import struct
import sys

import ml_collections
import pytest

from exgrpo_jax.training import config_check
from exgrpo_jax.training import run_log


def _config():
  return importlib.import_module("configs.smollm2_135m").get_config()


def test_metrics_go_to_jsonl_and_tensorboard(tmp_path):
  pytest.importorskip("tensorboardX")
  log = run_log.RunLog(str(tmp_path), total_steps=2, loggers="jsonl,tensorboard")
  log.write(1, {"batch/solved": 0.25, "experience/questions": 3})
  log.write(2, {"batch/solved": 0.5, "val/avg_score": None})
  log.close()
  rows = run_log.read_metrics(str(tmp_path))
  assert [(r["step"], r["batch/solved"]) for r in rows] == [(1, 0.25), (2, 0.5)]
  assert rows[1]["val/avg_score"] is None
  assert glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))


def test_only_the_chosen_loggers_write(tmp_path):
  log = run_log.RunLog(str(tmp_path), total_steps=1, loggers="tensorboard")
  log.write(1, {"batch/solved": 0.25})
  log.close()
  assert not os.path.exists(tmp_path / "metrics.jsonl")


def test_unknown_logger_and_missing_wandb_are_one_line_config_errors(monkeypatch):
  c = _config()
  c.train.loggers = "jsonl,mlflow"
  with pytest.raises(config_check.ConfigError, match="unknown logger 'mlflow'"):
    config_check.check(c)
  monkeypatch.setitem(sys.modules, "wandb", None)  # not installed, as far as imports go
  c.train.loggers = "jsonl,wandb"
  with pytest.raises(config_check.ConfigError) as e:
    config_check.check(c)
  assert str(e.value) == ("config.train.loggers='jsonl,wandb': logger 'wandb' needs the "
                          "wandb package: pip install wandb")


def test_resolved_config_round_trips_through_config_json(tmp_path):
  c = _config()
  c.algo.shaping_gamma = None  # None and tuples must survive
  run_log.RunLog(str(tmp_path), total_steps=1, loggers="", config=c.to_dict()).close()
  with open(tmp_path / "config.json", encoding="utf-8") as f:
    loaded = ml_collections.ConfigDict(json.load(f))
  assert loaded.to_json(sort_keys=True) == c.to_json(sort_keys=True)
  config_check.check(loaded)


def test_eval_samples_are_appended_and_printed(tmp_path, capsys):
  log = run_log.RunLog(str(tmp_path), total_steps=2, loggers="")
  sample = dict(uid=3, data_source="arith_add", problem="What is 2 + 3?", ground_truth="5",
                response="2 + 3 = 5", reward=1.0, status="ok")
  log.eval_samples(0, [sample])
  log.eval_samples(2, [dict(sample, response="6", reward=0.0)])
  with open(tmp_path / "eval_samples.jsonl", encoding="utf-8") as f:
    rows = [json.loads(line) for line in f]
  assert [(r["step"], r["reward"], r["response"]) for r in rows] == [
      (0, 1.0, "2 + 3 = 5"), (2, 0.0, "6")]
  out = capsys.readouterr().out
  assert "reward 1, answer 5): 'What is 2 + 3?' -> '2 + 3 = 5'" in out


@pytest.mark.parametrize("restored, evaluates_at_start, kept", [
    (0, True, []),           # killed in the first checkpoint: step 0 is evaluated again
    (0, False, [0]),         # step 0 is not logged again
    (2, True, [0, 1, 2]),    # rows past the checkpoint are logged again
], ids=["no_checkpoint", "no_checkpoint_no_start_eval", "checkpoint_2"])
def test_a_resume_keeps_each_step_once_in_both_logs(tmp_path, restored, evaluates_at_start,
                                                    kept):
  """What a killed run left (steps 0 to 3, the last row cut short) less the rows the
  resumed run logs again, in metrics.jsonl and eval_samples.jsonl alike."""
  for name in ("metrics.jsonl", "eval_samples.jsonl"):
    (tmp_path / name).write_text("".join(json.dumps({"step": s}) + "\n" for s in range(4))
                                 + '{"step": 4, "x')
  run_log.truncate(str(tmp_path), restored, evaluates_at_start)
  for name in ("metrics.jsonl", "eval_samples.jsonl"):
    with open(tmp_path / name, encoding="utf-8") as f:
      assert [json.loads(line)["step"] for line in f] == kept, name


def test_progress_line_shows_replay_buffer_and_validation(tmp_path, capsys):
  log = run_log.RunLog(str(tmp_path), total_steps=4, loggers="")
  log.progress(2, {"batch/solved": 0.375, "experience/batch_size": 2,
                   "experience/questions": 5, "experience/retired": 1, "val/avg_score": 0.4})
  out = capsys.readouterr().out
  assert "solved=0.375 replayed=2 buffer=5 retired=1 val=0.4" in out


def _wandb_history(run_dir: str) -> list[dict]:
  """The history rows ({"_step": ..., key: value}) of an offline run's `run-<id>.wandb`.

  The file is a LevelDB-style log (what `wandb sync` uploads): a 7-byte header, then
  32 KiB blocks of chunks (4-byte checksum, 2-byte length, 1-byte type) holding
  `wandb_internal_pb2.Record` messages.
  """
  from wandb.proto import wandb_internal_pb2  # pylint: disable=g-import-not-at-top
  [path] = glob.glob(os.path.join(run_dir, "run-*.wandb"))
  with open(path, "rb") as f:
    raw = f.read()
  assert raw[:4] == b":W&B"
  records, pending, pos, block = [], b"", 7, 32768
  while pos + 7 <= len(raw):
    if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
      pos += block - pos % block
      continue
    length, kind = struct.unpack("<HB", raw[pos + 4:pos + 7])
    chunk, pos = raw[pos + 7:pos + 7 + length], pos + 7 + length
    if kind == 0 and length == 0:
      continue
    pending += chunk
    if kind in (1, 4):  # FULL or LAST: a whole record
      record = wandb_internal_pb2.Record()
      record.ParseFromString(pending)
      records.append(record)
      pending = b""
  rows = []
  for r in records:
    if r.WhichOneof("record_type") == "history":
      rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json)
                   for i in r.history.item})
  return rows


def test_wandb_offline_run_logs_resumes_and_reads_back(tmp_path, monkeypatch):
  """The real wandb package, offline: two sessions of one workdir are one run."""
  wandb = pytest.importorskip("wandb", reason="wandb is not installed (the test extra)")
  monkeypatch.setenv("WANDB_MODE", "offline")
  for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
    monkeypatch.setenv(name, str(tmp_path / name.lower()))
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.setenv("WANDB_PROJECT", "exgrpo_jax_test")
  workdir = tmp_path / "run"
  log = run_log.RunLog(str(workdir), total_steps=3, loggers="wandb",
                       config={"algo": {"rho": 0.5}})
  log.write(1, {"batch/solved": 0.25, "val/avg_score": None})
  log.write(2, {"batch/solved": 0.5, "experience/questions": 3})
  log.close()
  run_id = (workdir / "wandb_id").read_text()
  log = run_log.RunLog(str(workdir), total_steps=3, start_step=2, loggers="wandb",
                       config={"algo": {"rho": 0.5}})
  log.write(3, {"batch/solved": 0.75})
  log.close()
  # `run.finish()` hands the last records to wandb's service process; this waits until they
  # are written, as its exit hook does when a training process ends.
  wandb.teardown()
  assert (workdir / "wandb_id").read_text() == run_id

  # One directory per session, both of the run id (a second one within the same second
  # gets "-1" appended).
  runs = sorted(glob.glob(str(workdir / "wandb" / f"offline-run-*-{run_id}*")))
  assert len(runs) == 2
  first, second = (_wandb_history(r) for r in runs)
  assert [(r["_step"], r["batch/solved"]) for r in first] == [(1, 0.25), (2, 0.5)]
  assert "val/avg_score" not in first[0] and first[1]["experience/questions"] == 3
  assert [(r["_step"], r["batch/solved"]) for r in second] == [(3, 0.75)]


@pytest.mark.slow
def test_training_run_evaluates_at_start_and_end_and_logs_samples(tmp_path):
  """A tiny random model on the arithmetic source: real sampler, rewards and loggers."""
  from exgrpo_jax.training import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  c = importlib.import_module("configs.tiny").get_config()
  c.data.source = c.eval.source = "arithmetic"
  c.eval.before_train, c.eval.every, c.eval.limit, c.eval.samples = True, 5, 6, 2
  c.train.steps, c.train.loggers = 2, "jsonl"
  trainer_lib.Trainer(c, str(tmp_path)).run()
  rows = run_log.read_metrics(str(tmp_path))
  assert [(r["step"], "val/avg_score" in r) for r in rows] == [(0, True), (1, False),
                                                                (2, True)]
  with open(tmp_path / "eval_samples.jsonl", encoding="utf-8") as f:
    samples = [json.loads(line) for line in f]
  assert [s["step"] for s in samples] == [0, 0, 2, 2]
  assert all(s["problem"].startswith("What is ") and s["status"] for s in samples)
  with open(tmp_path / "config.json", encoding="utf-8") as f:
    assert json.load(f)["data"]["source"] == "arithmetic"
