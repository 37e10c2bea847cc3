"""Building a run's parts before either loop starts: the model, data, rewards, tools and
weight sync (``run.py``), and the supervised warm-up (``warmup.py``). Imports no other wing."""
