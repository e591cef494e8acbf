"""Helpers shared by the tests (not test files): tiny models and checkpoints, packers written from
the published formats, fake plugins, servers. On the path through pyproject's pytest
``pythonpath = ["tests"]``: ``from support.hf_models import get_model``."""
