"""The producing wing: prompts and weights in, scored draws out. The producer loop
(``loop.py``) and its weights, one batch at a time (``collect.py``) or as a stream of groups
(``stream.py``), a batch's one tally of rewards and its metrics (``tally.py``), multi-turn
episodes (``agents.py``), agent programs through the endpoint (``agent_programs.py``) and the
held-out evaluation (``evaluate.py``). Imports ``setup`` and the floor, never ``learn`` or
``deploy``; what a producer changes while it draws stays with it (the ``Run`` is frozen)."""
