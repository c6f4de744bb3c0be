"""One GRPO step's parts, in the order the loop (train.py) calls them: set-up (and load.py, the policy, adapter and
reference it shares with every command that reads a run), the phases, the update and its reference, the per-token
credit, and iterative RL's boundaries."""
