"""Serving an engine: the gRPC worker server, its build, registration and heartbeats, KV on the wire and over the GPU link, the asyncio engine loop."""
