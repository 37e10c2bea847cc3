"""The learning wing: draws in, policy versions out. The one start sequence and the learner
loop (``loop.py``), its side work after each step as hooks (``hooks.py``), what batches come
from (``source.py``), the ``Learner`` (``learner.py``), a draw made into a batch
(``experience.py``), the replay buffer (``buffer.py``), the health checks (``health.py``) and a
run's start and end around the learner (``lifecycle.py``). Imports ``setup`` and the floor,
never ``produce`` or ``deploy``: what it needs of the producing side (the held-out evaluation,
the deployment's batch source) it is handed."""
