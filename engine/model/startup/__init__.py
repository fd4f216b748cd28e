"""What a model runner does once, as it starts: the kernels its model runs, the size of
its KV cache, and the compiled decoder and CUDA graphs warmed up and captured."""
