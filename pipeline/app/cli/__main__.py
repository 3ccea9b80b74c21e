"""`python -m pipeline.app.cli`: the `hybridpipe` command."""

import sys

from pipeline.app.cli import main

sys.exit(main())
