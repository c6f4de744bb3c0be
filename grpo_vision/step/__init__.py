"""One GRPO step's parts, in the order the loop (train.py) calls them: set-up, the phases, the update and its
reference, the per-token credit, and iterative RL's boundaries."""
