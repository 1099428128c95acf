"""`python -m router [--config F] [--host H] [--port N] [--log-level L]`."""

import sys

from router.main import main

sys.exit(main())
