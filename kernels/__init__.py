"""shoal.kernels: compression math on tensors (quantizers, top-k, masks, bit packing, error feedback); no networking."""
