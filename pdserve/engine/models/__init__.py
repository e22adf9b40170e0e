"""One module (or package) per model family, and the registry that finds them (registry.py).

A family is its module tree (built from pdserve/engine/layers at a tensor-parallel rank's
sizes), the map from checkpoint names to its parameters, and the reader of its config.json.
``decoder.py`` is the decoder most families share; docs/models.md says how to add one.
"""
