"""The scheduler core: every decision about requests and pages, with no I/O, no awaiting and no
clock (tests/scheduler/core/test_core_is_sans_io.py checks every module here). `scheduler.SchedulerCore`
takes events as calls and hands back actions; the drivers beside this package (scheduler/driver.py,
scheduler/offline.py) carry them out.
"""
