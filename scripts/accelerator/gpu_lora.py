r"""The one-GPU LoRA plan of Qwen2.5-Math-7B run on its GPU: the device's memory and phase
seconds beside the plan's (the part `lora` of gpu_followup.py, which runs it in a process
of its own).

  python scripts/accelerator/gpu_lora.py --out $OUT/gpu_lora.json [--budget 300]
  python scripts/accelerator/gpu_lora.py --smoke --out /tmp/gpu_lora.json  # CPU
  python scripts/accelerator/gpu_lora.py --render docs/results/gpu_lora_<kind>.json

The plan is the committed docs/results/aot_qwen7b_lora_<target>.json of the device (`PLANS`:
an H200 runs h200x1, an H100 h100x1), run at its settings (configs/qwen7b_lora.py:<target>:
mesh, micro-batch, slots, KV pool) with
- random weights of the plan's shape, vocabulary included (SmolLM2's tokenizer, whose ids
  it covers: the reward is 0 throughout, which changes no program);
- prompts of the plan's `data.max_prompt_tokens` (at most `SLACK` fewer), generated
  filler questions, since the plan prices every prompt at that bound;
- `QUESTIONS` questions a step instead of 128 (a mid-length step at the plan's batch takes
  about 33 minutes on the H200 at the efficiency measured there, docs/aot.md), every
  response cut at `RESPONSE_TOKENS` by the sampler, while every program stays as the
  plan compiled it (rows of prompt + 8,192 tokens, its slots and pool). The learner's call scans fewer micro-batches than the plan's (`M`), so its
  batch arguments are smaller by some MB; the estimate prices the filled ones as a share
  of the plan's call.

In order: one old-log-prob recompute and one learner call on generated responses of
those lengths (they compile; the device's peak after each is that phase's, the
rollout's peak, the plan's largest, coming after), then training steps until the
budget. The JSON holds, per phase, the device's peak (`memory_stats`) beside the plan's
(`device_peak_bytes`: the program and what stays beside it), the rollout programs' sizes
as compiled on the device beside the plan's, and per step the measured seconds of the
rollout (its compile taken out), recompute and learner beside the plan's roofline at
the step's own lengths (`step_lengths.priced`) and at the device's measured efficiency
(`step_lengths.MEASURED`). It is rewritten after each phase and step.

Unless set, XLA_PYTHON_CLIENT_MEM_FRACTION is the plans' (`run_guard.PLANNED_GPU_FRACTION`).
`--smoke` runs the same on this CPU with the embedded SmolLM2 at tiny lengths, its
"plan" compiled here for this CPU (`check.run` with `targets.this_cpu`).
"""

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from exgrpo_jax import cli  # pylint: disable=wrong-import-position

PLANS = (("H200", "h200x1"), ("H100", "h100x1"))  # device_kind substring -> plan target
QUESTIONS, RESPONSE_TOKENS, SLACK = 16, 256, 16
SMOKE = dict(questions=2, response_tokens=8, max_prompt_tokens=256, max_new_tokens=32,
             max_rows=8, kv_pages=64)
GIB = 2 ** 30
# What `render` reads: a JSON without them is not this script's.
REPORT_KEYS = ("device", "date", "jax", "plan", "questions", "k", "response_tokens",
               "phases", "steps")


def plan_path(target: str) -> str:
  return os.path.join(ROOT, "docs", "results", f"aot_qwen7b_lora_{target}.json")


def target_of(device_kind: str) -> str:
  """The plan target of a device, or UsageError in one line."""
  for kind, target in PLANS:
    if kind in device_kind:
      return target
  raise cli.UsageError(f"no one-GPU LoRA plan for a {device_kind}: "
                       f"{', '.join(t for _, t in PLANS)} only")


def _prompt_lengths(problems: list[str], tokenizer, template: str, path: str) -> list[int]:
  """The tokens of each problem's prompt, as the trainer renders a question file of them
  (written to `path`)."""
  from exgrpo_jax import data  # pylint: disable=g-import-not-at-top
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(dict(problem=p, answer="2")) + "\n" for p in problems)
  prompts, _ = data.render_prompts(data.load_questions(path).questions, tokenizer,
                                   template=template)
  return [len(p.ids) for p in prompts]  # in the file's order: none is dropped


def prompt_file(tokenizer, template: str, max_prompt_tokens: int, rows: int,
                path: str) -> str:
  """A question file of `rows` distinct filler questions whose rendered prompts have
  between `max_prompt_tokens - SLACK` and `max_prompt_tokens` tokens: each row's
  question, then every count of filler words that may land there (" one" is a token
  of its own, or more where the tokenizer merges)."""
  problem = lambda row, n: f"Question {row}: what is 1 + 1?" + " one" * n
  base = _prompt_lengths([problem(r, 0) for r in range(rows)], tokenizer, template, path)
  if max(base) > max_prompt_tokens - SLACK:
    raise RuntimeError(f"a filler question takes {max(base)} tokens in template "
                       f"{template!r}, over {max_prompt_tokens - SLACK}")
  candidates = [(r, problem(r, n)) for r in range(rows)
                for n in range(max_prompt_tokens - base[r] - SLACK,
                               max_prompt_tokens - base[r] + 1)]
  chosen = {}
  for (row, text), n in zip(candidates, _prompt_lengths([t for _, t in candidates],
                                                         tokenizer, template, path)):
    if max_prompt_tokens - SLACK <= n <= max_prompt_tokens and n > chosen.get(row, (0,))[0]:
      chosen[row] = (n, text)
  if len(chosen) < rows:
    raise RuntimeError(f"filler questions {sorted(set(range(rows)) - set(chosen))}: no "
                       f"prompt within {SLACK} tokens of {max_prompt_tokens}")
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(dict(problem=text, answer="2")) + "\n"
                 for _, text in chosen.values())
  return path


def run_config(target: str | None, workdir: str, smoke: bool):
  """configs/qwen7b_lora.py at the plan's settings, for the measured run (module
  docstring), and the model config of the plan's shape (None under --smoke)."""
  from configs import qwen7b_lora  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
  config = qwen7b_lora.get_config(target)
  shape = None
  if smoke:
    config.model.path = ""  # the embedded SmolLM2
    config.mesh.shape = (1, 1)
    config.data.max_prompt_tokens = SMOKE["max_prompt_tokens"]
    config.rollout.max_new_tokens = SMOKE["max_new_tokens"]
    config.rollout.max_rows = SMOKE["max_rows"]
    config.rollout.kv_pages = SMOKE["kv_pages"]
  else:
    shape = check.model_config(config)
    config.model.random_init = True
  config.data.source = "file"
  config.data.train_path = os.path.join(workdir, "prompts.jsonl")
  config.train.batch_questions = SMOKE["questions"] if smoke else QUESTIONS
  config.train.steps = 1000
  config.train.checkpoint_every = 1001
  config.train.export_dir = ""
  config.eval.every = 0
  config.eval.path = ""
  config.eval.before_train = False
  return config, shape


def plan_peaks(report: dict) -> dict:
  """The plan's device peak (GiB) of each phase: its largest program's."""
  from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
  rollout = [p for p in report["programs"] if p["name"] not in check.LEARNER
             and not p["name"].startswith("eval_")]
  by_name = {p["name"]: p for p in report["programs"]}
  return dict(recompute=by_name["score"]["device_peak_bytes"] / GIB,
              learner=by_name["learner_step"]["device_peak_bytes"] / GIB,
              rollout=max(p["device_peak_bytes"] for p in rollout) / GIB)


def generated_groups(trainer, length: int, seed: int):
  """A step's fresh groups with K generated responses of `length` tokens each and random
  advantages: what the recompute and the learner take, without a rollout."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.training import groups as groups_lib  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(seed)
  groups = trainer.compose(rng)
  k, vocab = trainer.config.rollout.k, trainer.state.model_cfg.vocab_size
  for g in groups:
    g.responses = [groups_lib.Response(rng.integers(0, vocab, length, dtype=np.int32),
                                       np.zeros(length, np.float32), "", truncated=True)
                   for _ in range(k)]
    g.advantages = rng.standard_normal(k).astype(np.float32)
  return groups, rng


def rollout_programs_on_device() -> dict:
  """The rollout programs' sizes (GiB) as XLA compiled them on this device."""
  from exgrpo_jax.sampling import jax_engine  # pylint: disable=g-import-not-at-top
  sizes = {}
  for signature, (_, memory) in jax_engine._COMPILED.items():  # pylint: disable=protected-access
    if memory is not None:
      name = getattr(signature[0], "__name__", str(signature[0]))
      sizes[name] = {k: v / GIB for k, v in memory.items()}
  return sizes


def _plan(target: str | None, config, smoke: bool) -> tuple[dict, dict]:
  """(the plan's report, what the run shares with the plan's choice): the committed one,
  or under --smoke the programs compiled here for this CPU."""
  from exgrpo_jax.aot import check  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import targets  # pylint: disable=g-import-not-at-top
  if smoke:
    return check.run(config, "cpu", target=targets.this_cpu(1e11, 2e10),
                     progress=lambda _: None), {}
  with open(plan_path(target), encoding="utf-8") as f:
    plan = json.load(f)
  chosen = plan["chosen"]
  ran = dict(tensor=config.mesh.shape[1], micro_batch_size=config.optim.micro_batch_size,
             max_rows=config.rollout.max_rows, kv_pages=config.rollout.kv_pages)
  differ = {k: (v, chosen[k]) for k, v in ran.items() if chosen[k] != v}
  if differ:
    raise cli.UsageError(f"configs/qwen7b_lora.py:{target} is not its plan's choice "
                         f"(config, plan): {differ}")
  return plan["report"], dict(chosen=chosen, verdict=plan["verdict"])


def measure(out: str, budget_s: float, workdir: str, smoke: bool) -> None:
  """The whole part (module docstring); the JSON at `out` as it goes."""
  import jax  # pylint: disable=g-import-not-at-top
  from exgrpo_jax import models  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.aot import step_lengths  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.training import run_state  # pylint: disable=g-import-not-at-top
  from exgrpo_jax.training import trainer as trainer_lib  # pylint: disable=g-import-not-at-top
  from scripts.accelerator import accelerator_check  # pylint: disable=g-import-not-at-top
  from scripts.accelerator import accelerator_parts  # pylint: disable=g-import-not-at-top
  from scripts.bench import step_record  # pylint: disable=g-import-not-at-top
  end = time.monotonic() + budget_s
  kind = jax.devices()[0].device_kind
  target = None if smoke else target_of(kind)
  shutil.rmtree(workdir, ignore_errors=True)
  os.makedirs(workdir)
  config, shape = run_config(target, workdir, smoke)
  report, chosen = _plan(target, config, smoke)
  response = SMOKE["response_tokens"] if smoke else RESPONSE_TOKENS
  result = dict(device=kind, jax=jax.__version__, date=time.strftime("%Y-%m-%d"),
                plan=os.path.relpath(plan_path(target), ROOT) if target else "compiled here",
                **chosen, model=report["model"], questions=config.train.batch_questions,
                k=config.rollout.k, response_tokens=response, phases={}, steps=[])
  write = lambda: accelerator_check.write(out, result)
  write()
  config.model.path = ""  # the embedded SmolLM2's tokenizer (and weights, under --smoke)
  prompt_file(models.load_tokenizer(), config.data.template, config.data.max_prompt_tokens,
              4 * config.train.batch_questions, config.data.train_path)
  if shape is not None:
    # model.random_init takes the vocabulary from the tokenizer; the plan's shape has its own.
    run_state._model_config_for_random_init = (  # pylint: disable=protected-access
        lambda _, tok: dataclasses.replace(shape, eos_token_id=(tok.eos_token_id,),
                                           pad_token_id=tok.pad_token_id))
  plan_gib = plan_peaks(report)
  start = time.perf_counter()
  trainer = trainer_lib.Trainer(config, os.path.join(workdir, "run"))
  result["setup_s"] = time.perf_counter() - start
  try:
    trainer.state.sampling_config = dataclasses.replace(trainer.state.sampling_config,
                                                        max_new_tokens=response)
    groups, rng = generated_groups(trainer, response, seed=0)
    for phase, call in (("recompute", lambda: trainer.old_logps(groups)),
                        ("learner", lambda: trainer.learn(groups, rng))):
      start = time.perf_counter()
      call()
      result["phases"][phase] = dict(first_call_s=time.perf_counter() - start,
                                     device_peak_gib=accelerator_parts.device_peak_gib(),
                                     plan_peak_gib=plan_gib[phase])
      print(f"[gpu_lora] {phase}: {result['phases'][phase]}", file=sys.stderr, flush=True)
      write()
    recorded = []
    step_record.record(trainer, recorded)
    while True:
      compiled_s = trainer.engine.stats.get("compile_s", 0.0)
      start = time.monotonic()
      seconds = step_record.seconds(trainer.train_step())
      rollout_compile_s = trainer.engine.stats.get("compile_s", 0.0) - compiled_s
      seconds["rollout"] -= rollout_compile_s
      estimated = step_lengths.priced(report, recorded[-1])
      result["steps"].append(dict(
          measured_s=seconds, rollout_compile_s=rollout_compile_s, estimated_s=estimated,
          measured_over_estimated={p: seconds[p] / estimated[p] for p in estimated
                                   if estimated[p] > 0},
          estimated_at_measured_efficiency_s=step_lengths.at_measured(
              report["target"], estimated["rollout"],
              estimated["recompute"] + estimated["learner"]),
          mean_prompt_tokens=sum(recorded[-1]["prompt_lens"]) / len(recorded[-1]["prompt_lens"]),
          mean_response_tokens=(sum(recorded[-1]["response_lens"])
                                / len(recorded[-1]["response_lens"]))))
      if "rollout" not in result["phases"]:
        result["phases"]["rollout"] = dict(device_peak_gib=accelerator_parts.device_peak_gib(),
                                           plan_peak_gib=plan_gib["rollout"])
        result["rollout_programs_gib"] = {
            name: dict(device=sizes, plan={k: p[k + "_bytes"] / GIB for k in sizes
                                           if k + "_bytes" in p})
            for name, sizes in rollout_programs_on_device().items()
            for p in report["programs"] if p["name"] == name}
      print(f"[gpu_lora] step {len(result['steps'])}: {seconds}", file=sys.stderr,
            flush=True)
      write()
      if time.monotonic() + (time.monotonic() - start) > end:
        break
  except Exception as e:  # pylint: disable=broad-except
    result["error"] = accelerator_parts.describe(e)
    write()
    raise
  finally:
    trainer.close()


def render(result: dict) -> str:
  """Markdown: per phase the plan's and the device's peak memory, and the medians over
  the steps of the measured and estimated seconds and of their ratio."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  steps = result.get("steps", [])
  lines = [f"{result['device']}, {result['date']}, jax {result['jax']}: the plan "
           f"{result['plan']}, {result['questions']} questions x {result['k']}, responses "
           f"of {result['response_tokens']} tokens, {len(steps)} steps"
           + (f"; error: {result['error']}" if "error" in result else ""), "",
           "| phase | plan peak GiB | device peak after it GiB | measured s | estimated s "
           "| measured / estimated |", "|---|---|---|---|---|---|"]
  median = lambda values: f"{np.median(values):.2f}" if values else "-"
  for phase in ("recompute", "learner", "rollout"):
    memory = result["phases"].get(phase, {})
    device = memory.get("device_peak_gib")
    ratios = [s["measured_over_estimated"][phase] for s in steps
              if phase in s["measured_over_estimated"]]
    lines.append(
        f"| {phase} | {memory.get('plan_peak_gib', float('nan')):.2f} "
        f"| {'-' if device is None else f'{device:.2f}'} "
        f"| {median([s['measured_s'][phase] for s in steps])} "
        f"| {median([s['estimated_s'][phase] for s in steps])} | {median(ratios)} |")
  at_measured = [s["estimated_at_measured_efficiency_s"] for s in steps
                 if s["estimated_at_measured_efficiency_s"] is not None]
  if at_measured:
    measured = [sum(s["measured_s"][p] for p in ("rollout", "recompute", "learner"))
                for s in steps]
    lines += ["", f"The three phases: {median(measured)} s measured, {median(at_measured)} s "
                  "estimated at the device's measured efficiency (medians over the steps)."]
  return "\n".join(lines)


def _read_report(parser, path: str) -> dict:
  """A JSON this script wrote, or one line naming what is wrong with it (exit status 2)."""
  try:
    result = cli.read_json("--render", path)
  except cli.UsageError as e:
    parser.error(str(e))
  missing = [k for k in REPORT_KEYS if not isinstance(result, dict) or k not in result]
  if missing:
    parser.error(f"--render {path}: not a report of this script (no {', '.join(missing)})")
  return result


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--out", help="the JSON report (required unless --render)")
  parser.add_argument("--render", help="print a JSON this script wrote as Markdown")
  parser.add_argument("--budget", type=cli.positive_float, default=300.0,
                      help="seconds: no step starts that would end after it")
  parser.add_argument("--workdir", default="/tmp/gpu_lora")
  parser.add_argument("--smoke", action="store_true")
  args = parser.parse_args(argv)
  if args.render:
    print(render(_read_report(parser, args.render)))
    return 0
  if not args.out:
    parser.error("--out is required")
  # Before the minutes of setup and compiles, not after them.
  try:
    cli.check_writable(args.out)
  except OSError as e:
    parser.error(f"--out {args.out}: {e}")
  why = cli.unwritable(args.workdir, directory=True)
  if why:
    parser.error(f"--workdir {args.workdir}: cannot write there ({why})")
  if args.smoke:
    os.environ["JAX_PLATFORMS"] = "cpu"
  else:  # before JAX starts: the share of the device's memory the plans were made for
    from exgrpo_jax.training import run_guard  # pylint: disable=g-import-not-at-top
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", str(run_guard.PLANNED_GPU_FRACTION))
  out = os.path.abspath(args.out)
  return cli.guarded(lambda: measure(out, args.budget, args.workdir, args.smoke),
                     prefix="gpu_lora")


if __name__ == "__main__":
  sys.exit(main())
