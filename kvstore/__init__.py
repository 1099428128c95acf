"""The L1 host KV cache of a node: one arena file in shared memory (/dev/shm) that every rank maps.

The kvstore sizes and owns the arena (RAM budget), and keeps its slot index: block hash -> slot, LRU
eviction, pins for copies in flight. Ranks copy block bytes themselves; gRPC carries only hashes and
slot numbers (protos/kvstore.proto), and STORED/REMOVED events go to the router.
"""
