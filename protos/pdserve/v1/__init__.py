"""pdserve.v1 API: generation_pb2 (messages) and generation_pb2_grpc (service stubs)."""
