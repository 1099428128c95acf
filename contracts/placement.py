"""What the node router (choosing a rank: router/route_score.py) and the fleet's endpoint picker (choosing a node:
gateway/epp/node_choice.py) weigh alike when they place a request, defined once."""

from __future__ import annotations

from contracts.config import DEFAULTS

# A running sequence slows a rank's prefill down by roughly this many prompt tokens' worth of work.
RUNNING_SEQUENCE_TOKENS = 256
# An overloaded session rank (or node) is left only for one whose score is at most this fraction of its own:
# moving a session throws its cached prefix away, so "slightly better" is not worth it.
ESCAPE_SCORE_RATIO = 0.5
# The cached share that makes a request warm: the ranks' scheduling default, from the one config.
WARM_PREFIX_FRACTION = DEFAULTS.scheduling.warm_prefix_fraction
