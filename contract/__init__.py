"""The shared contract, at the bottom of the import graph: what the harness, the router, the workers and the
audit all agree on, and nothing else.

The wire (proto/q3vl.proto, its generated code via wire.py, gRPC transport, TLS and auth in transport.py and
network.py), the plain request/step types (types.py), the Qwen tokenizer, chat template and image geometry
(tokenizer.py, chat.py, vision_geometry.py), the JSON Schemas a request may ask for (json_schema.py), and the
product catalogue and MLPerf prompt that both the harness and the accuracy audit read (dataset.py, prompt.py).

It imports none of harness/, router/, workers/, audit/ (tests/test_import_graph.py checks), so each of those
can import it without pulling in another.
"""
