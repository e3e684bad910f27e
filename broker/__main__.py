"""``python -m broker`` runs the same command as ``skred``."""

import sys

from broker.cli import main

sys.exit(main())
