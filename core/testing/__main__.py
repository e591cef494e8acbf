"""``python -m lmplug.testing FAMILY BACKEND [-o KEY=VALUE ...] [-- PYTEST ARGS]``."""

from lmplug.testing.runner import main

if __name__ == "__main__":  # importing the module (e.g. pkgutil.walk_packages) runs nothing
    raise SystemExit(main())
