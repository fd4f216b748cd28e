"""Generated gRPC/protobuf stubs for the pdserve API (see protos/*.proto)."""
