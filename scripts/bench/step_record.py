"""What the scripts that set a step estimate against measured steps record of each step.

  steps = []
  step_record.record(trainer, steps)   # each optimizer step's lengths, appended
  metrics = trainer.train_step()
  seconds = step_record.seconds(metrics)  # rollout, recompute, learner, step

Used by scripts/bench/check_estimate_cpu.py (this CPU as the target) and
scripts/accelerator/gpu_lora.py (a GPU plan on its device); both price a recorded step
with `exgrpo_jax.aot.step_lengths.priced`.
"""

# The trainer's timings (`timing_s/<name>`) of the phases the estimate prices.
PHASES = {"rollout": "gen", "recompute": "old_logprobs", "learner": "update_actor"}


def record(trainer, steps: list) -> None:
  """Makes the trainer's actor append, at every update, the lengths it trains on: every
  response's, the fresh ones' and every prompt's."""
  update = trainer.actor.update

  def recorded(params, opt_state, groups, *args):
    responses = [r for g in groups for r in g.responses]
    steps.append(dict(
        response_lens=[len(r.tokens) for r in responses],
        fresh_lens=[len(r.tokens) for r in responses if not r.is_replay],
        prompt_lens=[len(g.prompt_ids) for g in groups]))
    return update(params, opt_state, groups, *args)
  trainer.actor.update = recorded


def seconds(metrics: dict) -> dict:
  """A step's measured seconds per phase (`PHASES`) and in all (`step`)."""
  return ({p: float(metrics[f"timing_s/{t}"]) for p, t in PHASES.items()}
          | dict(step=float(metrics["timing_s/step"])))
