"""`python -m kvstore [--config F] [--host H] [--port N] [--log-level L]`."""

import sys

from kvstore.main import main

sys.exit(main())
