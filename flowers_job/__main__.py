"""``python -m flowers_job`` = the ``flowers-job`` console script."""

import sys

from flowers_job.cli import main

sys.exit(main())
