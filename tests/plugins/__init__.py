"""Research code that lives outside `src/`: loorl reaches it only through `_target_` settings
(tests/test_plugins.py puts this folder's parent on PYTHONPATH)."""
