"""The training loop: learner step, replay glue, run state, logging."""
