"""The client side of the rank workers: one generation through a rank, which rank, and the gRPC client."""
