"""The deployments, the only wing that imports both sides: colocated (``colocated.py``),
split in one process (``split.py``), the learner and generator jobs (``jobs.py``), the
rollout files between jobs (``exchange.py``) and the jobs' status files (``jobstatus.py``)."""
