"""The router: which rank should serve a request.

It keeps the rank registry (health, load), a prefix index of the blocks each rank holds in L0 and the
node's kvstore holds in L1 (built from their KvEvents streams), and a session table made durable in Redis,
and scores the candidate ranks for every Route call (router/route_score.py).
"""
