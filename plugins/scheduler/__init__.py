"""First-party schedulers. Registered through the ``lmplug.plugins`` entry point."""

from lmplug.api import hookimpl

LMPLUG_API_VERSION = 3


@hookimpl
def lmplug_register_schedulers() -> list[type]:
    from lmplug_scheduler.continuous import ContinuousScheduler
    from lmplug_scheduler.static import StaticScheduler

    return [StaticScheduler, ContinuousScheduler]
