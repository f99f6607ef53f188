"""`python -m jetspec ...` runs the `jetspec` command (see `jetspec.cli`)."""

import sys

from .cli import main

sys.exit(main())
