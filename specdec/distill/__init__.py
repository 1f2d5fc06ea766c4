"""Draft distillation: `specdec distill` trains a small draft on a target's own greedy answers.

prompts (offline prompt set) → data (batched target answers + top-k logits) → train → evaluate
(held-out agreement, τ at K, cost ratio c); recipe.run_distill ties them together.
"""
