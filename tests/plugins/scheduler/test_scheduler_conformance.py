"""The first-party schedulers through the conformance suite (``lmplug.testing.SchedulerConformance``)."""

from __future__ import annotations

from lmplug.testing import SchedulerConformance

# -- schedulers -------------------------------------------------------------------------------------


class TestStaticScheduler(SchedulerConformance):
    backend = "static"


class TestContinuousScheduler(SchedulerConformance):
    backend = "continuous"
