"""Attention over the paged KV cache: the per-step context and the SDPA backend (base.py),
the C++ paged kernel (paged.py), Triton and flash-attn on CUDA, latent attention (mla.py), the
choice between them (select.py), and the cache's layout in memory (kv_cache.py)."""
