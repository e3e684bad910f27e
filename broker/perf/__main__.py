"""``python -m broker.perf`` runs skred-perf without installing the console script."""

import sys

from broker.perf.cli import main

sys.exit(main())
