"""Block diffusion: the denoising select stage (``stage.py``) and its sampler (``canvas.py``)."""
