"""A tensor-parallel worker's ranks: rank 0 starts and steps them (group.py), the others follow
(follower.py), each step's inputs broadcast between them (step.py)."""
