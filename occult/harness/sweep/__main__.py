"""`python -m occult.harness.sweep`: the sweep's command line (`occult.harness.sweep.run.main`)."""

import sys

from occult.harness.sweep.run import main
from occult.logs import run_main

sys.exit(run_main("sweep", main))
