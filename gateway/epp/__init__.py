"""The fleet's endpoint picker (EPP): Envoy asks it, over ext_proc, which node's gateway serves each request.

Past one node, an Envoy-based gateway (the Kubernetes Gateway API Inference Extension) sends every request to the
node the EPP names. It chooses as the node router chooses a rank, one level up: the node whose ranks (L0) or
host cache (L1) hold the prompt's prefix, a session's last node while it is not overloaded, else the least
loaded. It reads requests as the node gateways do (the same parsing, templates and block hashes: hence here, in
the gateway package), and learns what nodes hold from their KV events in vLLM's format.

fleet_config (the fleet file), node_state (readiness, model info, load), kv_event_subscriber + fleet_index
(what each node caches), node_choice (the pure choice), picker (request -> decision), ext_proc (Envoy's
protocol), envoy_config (an Envoy bootstrap for it), metrics, main.
"""
