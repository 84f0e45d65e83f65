"""The machinery beneath the method: what makes it safe, fast and distributed. A learner trusts
these modules without reading them; the method is in the top-level files (README: the files).

This package never imports a top-level file (tests/test_imports.py)."""
