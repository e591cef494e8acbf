"""The ``paged`` attention backend: PagedAttention: Triton kernels on GPUs, PyTorch and a C decode kernel on CPUs."""
