"""Pure GRPO algorithm functions: advantages, KL estimators, losses and rewards (CPU-testable)."""
