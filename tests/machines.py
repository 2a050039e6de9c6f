"""Settings of the state machines (``hypothesis.stateful``) that test the ring."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings


def replayed(max_examples: int, steps: int) -> settings:
    """The same sequences on every run, so that the default test run is repeatable (the
    long runs behind ``-m slow`` draw new ones: :func:`run_long`)."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


def run_long(machine: Any, max_examples: int = 400, steps: int = 40) -> None:
    """Run ``machine`` (a ``RuleBasedStateMachine`` class) on many new sequences."""
    runner = machine.TestCase("runTest")
    runner.settings = settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    runner.runTest()
