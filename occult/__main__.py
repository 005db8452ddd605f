import sys

from occult.cli import main

sys.exit(main())
