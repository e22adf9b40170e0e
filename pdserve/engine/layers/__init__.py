"""The building blocks of every model family: parallel linears that load their own shard
(linear.py), the embedding and LM head split by vocabulary rows (vocab.py), norms,
activations, the gated MLP, mixture-of-experts and rotary embeddings. Tensor-parallel
arithmetic lives here and in pdserve/engine/parallel.py, nowhere else."""
