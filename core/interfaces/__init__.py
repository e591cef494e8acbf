"""The API's modules: one small ABC per extension point and the records they share.

Plugins import these names from ``lmplug.api`` (the versioned API, its ``__all__`` the whole
of it); the core imports the modules directly. This package imports nothing of the core above
it (import-linter holds it); building helpers live in the kit (``lmplug.kit``), the family
table in ``lmplug.families``.
"""
