"""The gRPC edge: the public GenerationService and AdminService servers, health,
security, message limits."""
