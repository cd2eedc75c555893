//! CUDA code generation (issue 6). Will own: fused kernel -> CUDA C source, NVRTC compilation and the disk cache, cuBLAS calls.
