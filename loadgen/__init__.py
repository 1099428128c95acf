"""Agent load generation against the gateway: trace replay, the needle gate, reports and charts."""
