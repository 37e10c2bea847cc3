"""``python -m rlx.advise``."""

import sys

from rlx.advise import main

sys.exit(main())
