"""Building a run's parts before either loop starts: the frozen ``Run`` with the model, data,
rewards, tools and weight sync (``run.py``), the prompts and held-out rows (``prompts.py``),
the supervised warm-up (``warmup.py``) and a policy's files (``policy_files.py``). Imports no
other wing."""
