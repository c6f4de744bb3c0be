"""What keeps a run alive and whole: checkpoints (checkpoint.py) and the safe loading of their state
(safe_state.py), the run folder and its lock (folder.py, lock.py), processes (distributed.py), health
checks, memory estimates and the machine (health.py, memory.py, machine.py), metrics (metrics.py) and where
else they go (trackers.py), alerts as a run goes wrong (alerts.py), the settings each resume trained with
(resumes.py), signals (signals.py) and load-time checks (load_checks.py). This file imports nothing."""
