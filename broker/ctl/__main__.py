"""``python -m broker.ctl``: the same as the ``skredctl`` console script."""

import sys

from broker.ctl import main

sys.exit(main())
