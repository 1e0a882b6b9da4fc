"""Rollout estimates at real lengths (exgrpo_jax.aot.lengths) from real compiler figures:
three plans as compiled before admission (tests/data/aot_*_reserved.json: every slot's
row reserved at its longest), and the committed plans."""

import json
import os
import re

import numpy as np
import pytest

from exgrpo_jax.aot import lengths
from tests import conftest

RESULTS = os.path.join(conftest.REPO_ROOT, "docs", "results")
RESERVED = os.path.join(conftest.REPO_ROOT, "tests", "data", "aot_{}_reserved.json")


def _report(name: str) -> dict:
  with open(RESERVED.format(name), encoding="utf-8") as f:
    return json.load(f)["report"]


def _decode(report: dict) -> dict:
  return next(p for p in report["programs"] if p["name"] == "decode_chunk")


def test_a_full_pool_of_rows_at_the_cap_costs_the_compiled_chunks():
  # XLA's attention on 8 H100s: one wave of 832 rows at 8,192 tokens, the pool held at
  # the size it was compiled with, is 512 chunks of the compiled decode_chunk's roofline.
  pool = lambda report: int(_decode(report)["purpose"].split("over the ")[1].split("-")[0])
  report = _report("qwen7b_h100x8")
  est = lengths.rollout_estimate(report, lengths.at_cap(8192, 832), sizes=[pool(report)])
  np.testing.assert_allclose(est["decode_s"], 512 * _decode(report)["roofline_s"], rtol=1e-9)
  # The TPU kernel reads live pages: at chunk ends rather than the compile's mid-life mean.
  report = _report("qwen7b_v5e-16")
  est = lengths.rollout_estimate(report, lengths.at_cap(8192, 64), sizes=[pool(report)])
  np.testing.assert_allclose(est["decode_s"], 512 * _decode(report)["roofline_s"], rtol=3e-3)


def test_shorter_rows_cost_less_and_admission_spends_the_same_pool_on_more_rows():
  report = _report("qwen7b_v5e-16")  # 64 rows per call of 1,024
  mid = lengths.scenario("mid", 8192, 1024)
  at_cap = lengths.rollout_estimate(report, lengths.at_cap(8192, 1024))
  today = lengths.rollout_estimate(report, mid)
  assert today["rollout_s"] < at_cap["rollout_s"] / 2
  pool = today["capacity_pages"]
  admitting = lengths.rollout_estimate(report, mid, slots=1024, capacity=pool, headroom=0.1)
  assert admitting["capacity_pages"] == pool and admitting["rollout_s"] < today["rollout_s"]
  eager = lengths.rollout_estimate(report, mid, slots=1024, capacity=pool, headroom=0.0)
  assert eager["preemptions"] > admitting["preemptions"]
  assert eager["recomputed_tokens"] > 0


def test_the_best_slot_count_is_never_dearer_than_todays():
  """On a v5p-8 qwen7b's decode is FLOP-bound with every row in a slot: at the mid lengths
  today's 528 slots cost least of the choices; on a v5e-16 (64 slots today) more do."""
  mid = lengths.scenario("mid", 8192, 1024)
  report = _report("qwen7b_v5p-8")
  today = lengths.rollout_estimate(report, mid)
  every_row = lengths.rollout_estimate(report, mid, slots=1024,
                                       capacity=today["capacity_pages"], headroom=0.1)
  best = lengths.best_slots(report, mid, 0.1)
  assert every_row["rollout_s"] > today["rollout_s"] and best == today
  report = _report("qwen7b_v5e-16")
  today = lengths.rollout_estimate(report, mid)
  best = lengths.best_slots(report, mid, 0.1, today)
  assert best["slots"] > today["slots"] and best["rollout_s"] < today["rollout_s"]


def test_scenarios_have_their_mean_and_share_at_the_cap_every_time():
  for name, (mean, share) in lengths.SCENARIOS.items():
    lengths_R = lengths.scenario(name, 8192, 1024)
    np.testing.assert_allclose(lengths_R.mean(), mean, rtol=0.01)
    np.testing.assert_allclose((lengths_R == 8192).mean(), share, atol=1 / 1024)
    assert lengths_R.min() >= 1 and lengths_R.max() <= 8192
    np.testing.assert_array_equal(lengths_R, lengths.scenario(name, 8192, 1024))
  np.testing.assert_allclose(lengths.scenario("mid", 4096, 512).mean(), 3501 / 2, rtol=0.01)
  with pytest.raises(ValueError, match="a mean of 3000 tokens with 50% at the cap of 8192"):
    lengths.from_mean(3000, 0.5, 8192, 100)


def test_recorded_lengths_keep_their_share_of_the_cap(tmp_path):
  path = os.path.join(RESULTS, "smollm2_gsm8k_rollout_lengths.json")
  with open(path, encoding="utf-8") as f:
    record = json.load(f)
  lengths_R = lengths.recorded(path, 8192, 1024)
  share = np.asarray(record["response_lens"]) / record["max_new_tokens"]
  np.testing.assert_allclose(lengths_R.mean() / 8192, np.resize(share, 1024).mean(),
                             atol=1e-3)
  bad = tmp_path / "bad.json"
  bad.write_text("{}")
  with pytest.raises(ValueError, match=r"bad.json: not a record of rollout lengths"):
    lengths.recorded(str(bad), 8192, 16)
  bad.write_text("x")
  with pytest.raises(ValueError, match=r"bad.json: not a JSON file"):
    lengths.recorded(str(bad), 8192, 16)


@pytest.mark.parametrize("record, problem", [
    ({"max_new_tokens": 0, "response_lens": [3, 5]},
     "max_new_tokens=0: must be a whole number of tokens above 0"),
    ({"max_new_tokens": 8, "response_lens": [3, -2]},
     "response_lens[1]=-2: must be a whole number of tokens in [0, max_new_tokens=8]"),
    ({"max_new_tokens": 8, "response_lens": [3, "a"]},
     "response_lens[1]='a': must be a whole number of tokens in [0, max_new_tokens=8]"),
    ({"max_new_tokens": 8, "response_lens": [9]},
     "response_lens[0]=9: must be a whole number of tokens in [0, max_new_tokens=8]"),
    ({"max_new_tokens": "8", "response_lens": [3]},
     "max_new_tokens='8': must be a whole number of tokens above 0"),
    ({"max_new_tokens": 8, "response_lens": []},
     "response_lens=[]: must be a non-empty list of lengths"),
], ids=["zero_cap", "negative", "string", "over_cap", "string_cap", "empty"])
def test_a_bad_length_record_names_the_file_and_the_key(tmp_path, record, problem):
  path = tmp_path / "record.json"
  path.write_text(json.dumps(record))
  with pytest.raises(ValueError) as e:
    lengths.recorded(str(path), 8192, 16)
  assert str(e.value).startswith(f"{path}: {problem}")


def test_the_planner_prints_the_estimates_beside_the_compiled_worst_case(capsys):
  from exgrpo_jax.aot import plan_cli  # pylint: disable=g-import-not-at-top
  plan_cli.main(["--render", RESERVED.format("qwen7b_v5e-16"), "--estimate",
                 "--mean", "3501", "--cap-share", "0.09"])
  out = capsys.readouterr().out.splitlines()
  header = next(l for l in out if l.startswith("| config | target | rows per call | compiled"))
  assert "mean 3501, 9% at cap s" in header and "admitting, at cap s" in header
  row = next(l for l in out[out.index(header):] if l.startswith("| qwen7b | v5e-16 | 64 |"))
  assert row.split(" | ")[3] == "750"  # the compiled estimate, every row at the cap
  assert re.fullmatch(r"\d+ \(\d+\) @\d+", row.split(" | ")[6])  # seconds (preempted) @slots
  with pytest.raises(SystemExit):
    plan_cli.main(["--render", RESERVED.format("qwen7b_v5e-16"), "--estimate",
                   "--mean", "9000", "--cap-share", "0.5"])
  assert "a mean of 9000 tokens with 50% at the cap" in capsys.readouterr().err


def _plan(name: str) -> dict:
  with open(os.path.join(RESULTS, f"aot_{name}.json"), encoding="utf-8") as f:
    return json.load(f)


def _pooled() -> list[str]:
  """The committed plans that admit rows into a pool (`rollout.kv_pages`)."""
  names = []
  for file in sorted(os.listdir(RESULTS)):
    if file.startswith("aot_") and file.endswith(".json"):
      with open(os.path.join(RESULTS, file), encoding="utf-8") as f:
        data = json.load(f)
      if data.get("fits") and data.get("chosen", {}).get("kv_pages"):
        names.append(file[len("aot_"):-len(".json")])
  return names


MID_S = {"qwen7b_v5e-16": 160, "llama8b_v6e-8": 160, "qwen7b_h100x8": 42}


@pytest.mark.parametrize("name", _pooled())
def test_the_plans_with_admission_are_never_dearer_than_their_reserved_rows(name):
  """Every committed plan with a pool compiles its slots and pool (`chosen`): at every
  length scenario and at the cap the rollout costs no more than in the reserved rows'
  slots, each row's pool at its longest (a plan whose slots the estimate has since
  priced dearer is planned again, `plan --like` of itself); three plans' targets at the
  mid lengths."""
  plan, mid_s = _plan(name), MID_S.get(name, np.inf)
  report, reserved = plan["report"], plan["chosen"]["reserved_rows"]
  assert report["batch"]["max_rows"] == plan["chosen"]["max_rows"]
  for label, lengths_R in lengths.distributions(8192, 1024).items():
    admitting = lengths.rollout_estimate(report, lengths_R, headroom=0.1)
    today = lengths.rollout_estimate(report, lengths_R, slots=reserved)
    assert admitting["rollout_s"] <= today["rollout_s"], label
    if label == "mid":
      assert admitting["rollout_s"] <= mid_s
