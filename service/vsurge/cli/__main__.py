"""`python -m vsurge.cli ...`: the same as `vsurge ...` (the tests and benchmarks start servers this way)."""

import sys

from vsurge.cli.main import main

sys.exit(main())
