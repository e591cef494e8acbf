"""Hooks go through pluggy's hook relay: wrappers are honoured, one raising plugin stays its own."""

from __future__ import annotations

from support.fake_plugins import plugin_module as _plugin

from lmplug.engine.isolation import Observers
from lmplug.hookspecs import hookimpl
from lmplug.plugins import Registry


def test_wrappers_run_around_each_plugin_and_a_raising_one_does_not_stop_the_others(caplog):
    calls: list[str] = []

    def wrap(engine, stats):
        calls.append("before")
        yield
        calls.append("after")

    def broken(engine, stats):
        raise RuntimeError("boom")

    reg = Registry(autoload=False)
    assert reg.register(_plugin(lmplug_step_finished=hookimpl(wrapper=True)(wrap)), name="wrapper")
    assert reg.register(_plugin(lmplug_step_finished=hookimpl(broken)), name="broken")
    assert reg.register(_plugin(lmplug_step_finished=hookimpl(lambda engine, stats: calls.append(stats["n"]))),
                        name="good")
    observers = Observers(reg)
    assert observers.wanted("lmplug_step_finished")
    observers.notify("lmplug_step_finished", engine=None, stats={"n": 1})
    observers.notify("lmplug_step_finished", engine=None, stats={"n": 2})
    assert calls.count(1) == 1 and calls.count(2) == 1
    assert calls.count("before") == 4 and calls.count("after") == 2  # the raising call never resumes it
    assert sum("'broken'" in r.message and "raised" in r.message for r in caplog.records) == 1


def test_registration_results_come_through_the_relay():
    from lmplug.interfaces.common import Capabilities
    from lmplug.interfaces.scheduler import Scheduler

    cls = type("Mine", (Scheduler,), {"name": "mine", "capabilities": Capabilities(),
                                      "schedule": None, "update": None})
    reg = Registry(autoload=False)
    assert reg.register(_plugin(lmplug_register_schedulers=hookimpl(lambda: [cls])), name="p",
                        distribution="d 1")
    assert reg.backends("scheduler")["mine"].distribution == "d 1"
