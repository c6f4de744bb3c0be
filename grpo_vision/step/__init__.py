"""One GRPO step's parts, in the order the loop (train.py) calls them: set-up (setup.py, and load.py: the policy,
adapter and reference it shares with every command that reads a run), the phases (phases.py), the update
(update.py) and its reference (reference.py), the per-token credit (credit.py), and iterative RL's boundaries
(iterative.py)."""
