"""What runs a scheduled batch on a device: the model runner, tensor-parallel rank group, decode CUDA graphs."""
