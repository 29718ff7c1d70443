"""`python -m groupflow.impl.cli`: the `groupflow` command line."""

import sys

from groupflow.impl.cli._main import main

sys.exit(main())
