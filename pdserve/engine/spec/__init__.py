"""Speculative decoding: guess several next tokens cheaply, score them in one target forward,
keep the prefix that rejection sampling accepts (the output's distribution is the target's).

``proposer`` is the contract between the engine and whatever guesses (an n-gram lookup in the
sequence itself, or a small draft model run beside the target), and the counters the worker
exports (vLLM's names: drafts, draft tokens, accepted tokens, accepted per position).
"""
