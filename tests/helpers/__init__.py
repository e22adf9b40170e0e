"""What test files share besides fixtures (those are in each folder's ``conftest.py``): request
builders, in-process worker set-ups and checks, one module per topic. A test file never imports
another test file (``tests/test_import_graph.py``)."""
