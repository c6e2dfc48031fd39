"""`python -m stepstream.cli`: the `stepstream` command."""

import sys

from stepstream.cli._main import main

sys.exit(main())
