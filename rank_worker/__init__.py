"""One engine rank per GPU: model, paged KV pool, scheduler, L0 prefix cache, and its gRPC service."""
