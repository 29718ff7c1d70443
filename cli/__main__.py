"""`python -m groupflow.cli`: the `groupflow` command line."""

import sys

from groupflow.cli._main import main

sys.exit(main())
