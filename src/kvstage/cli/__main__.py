"""`python -m kvstage.cli ...` is `kvstage ...`."""

import sys

from kvstage.cli import main

sys.exit(main())
