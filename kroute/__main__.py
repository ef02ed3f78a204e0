"""`python -m kroute` is the `kroute` command."""

import sys

from kroute.cli import main

sys.exit(main())
