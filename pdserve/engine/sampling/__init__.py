"""Choosing the next token: sampling parameters (params.py), the sampler and its penalties,
and structured output's grammars (grammar.py, compiled off the engine thread by grammar_jobs.py)."""
