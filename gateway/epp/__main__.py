"""`python -m gateway.epp --fleet FLEET.yaml [--log-level L]`."""

import sys

from gateway.epp.main import main

sys.exit(main())
