"""python -m proxy: run the proxy (configured by KROUTE_* environment variables)."""

import sys

from proxy.main import main

sys.exit(main())
