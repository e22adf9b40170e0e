"""Placing and running the cluster: Ray actors for the router and the workers, and the CLI."""
