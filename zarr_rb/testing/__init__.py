"""Tools to break a store on purpose: fault injection, a durability recorder, and a
crash workload with its checker.

They drive zarr_rb's own reliability tests (``tests/test_reliability.py``,
``tests/test_crash.py``) and the long crash run (``benchmarks/crash.py``), and
can check a deployment the same way.

Everything here works on the file operations the engine announces (see
:func:`zarr_rb.util.io.observe_io`): every write, removal, fsync and commit publish
of a store goes through it.
"""

from zarr_rb.testing.crash import (
    CrashCheck,
    CrashWorkload,
    check_crashed_store,
    count_fault_points,
    expected_rows,
    inject_io_fault,
    run_crash_writer,
    simulate_crash,
)
from zarr_rb.testing.durability import DurabilityRecorder
from zarr_rb.testing.faults import ALL_KINDS, FaultInjector
from zarr_rb.testing.kills import (
    forkserver_context,
    kill_at_each_operation_of_a_save,
    kill_randomly,
)
from zarr_rb.util.io import observe_io

__all__ = [
    "ALL_KINDS",
    "CrashCheck",
    "CrashWorkload",
    "DurabilityRecorder",
    "FaultInjector",
    "check_crashed_store",
    "count_fault_points",
    "expected_rows",
    "forkserver_context",
    "inject_io_fault",
    "kill_at_each_operation_of_a_save",
    "kill_randomly",
    "observe_io",
    "run_crash_writer",
    "simulate_crash",
]
