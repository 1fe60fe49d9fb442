"""What test files share: references (transformers bf16/FP8 runs, FP8 KV values), fixtures' makers (images, LoadGen
runs, router clusters, sockets) and spies, imported as tests.helpers.NAME; no test file imports another."""
