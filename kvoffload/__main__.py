"""``python -m kvoffload`` runs the command line."""

import sys

from kvoffload.cli import main

sys.exit(main())
