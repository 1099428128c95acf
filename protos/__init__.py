"""Generated gRPC contracts (committed; `make protos` regenerates, CI checks they match the .proto files)."""
