"""The ``mla`` attention backend: multi-head latent attention (DeepSeek-V2/V3): PyTorch ops and a Triton decode."""
