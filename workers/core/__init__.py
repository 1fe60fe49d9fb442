"""The scheduling core, tensor-free: the scheduler, the KV block manager, sequences, the encoder cache's account."""
