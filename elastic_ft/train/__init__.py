"""Training: model, data cursor, batch/LR policy, the step loop."""
