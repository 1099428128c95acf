"""`python -m rank_worker [--config F] [--host H] [--port P] [--model M]`."""

import sys

from rank_worker.main import main

sys.exit(main())
