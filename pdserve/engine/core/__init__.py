"""The engine's bookkeeping, free of tensors: the scheduler and its step budget, sequences
(request state), the block manager and its tails, and what a step hands back (outputs)."""
