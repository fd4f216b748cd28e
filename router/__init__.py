"""The router: the gRPC edge, admission, routing, and the worker pools behind them."""

import os

# gRPC core logs to stderr through its own logger, beside the service's log. Left to its
# default it writes a line for every failed TLS handshake: a plaintext client, a port
# scanner or a load balancer's TCP probe of a TLS port, none of which an operator can act
# on (the client sees its own error). Its errors still show; a GRPC_VERBOSITY the user
# sets wins. gRPC reads the variable once, when it is first imported: hence here, before
# any router module imports it.
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
