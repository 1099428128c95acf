"""The L1 copy path: map the kvstore's shared arena, copy KV blocks between the pool and arena slots, and
the engine-side tier that decides what to offload and what to restore.

Only kvstore_link.py speaks gRPC; the arena and the copier import torch alone, so benchmarks can use them.
"""
