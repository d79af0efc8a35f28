"""What runs a kvplane process: the gRPC server, telemetry, authentication, TLS and secret files,
error mapping, ports.

Above the domain model (`common.model`) and below the store and the services; it imports neither.
"""
