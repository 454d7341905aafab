"""The gRPC API (protos/kvserve/v1/kvserve.proto): the servicer over the request pipeline,
message conversion, the hook Serve's gRPC proxy calls (with the standard health service,
TLS port and exposure guard it installs), and a typed Python client."""
