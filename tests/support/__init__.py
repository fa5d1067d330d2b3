"""Test support code that is no test module: the fault injector (:mod:`tests.support.faults`)."""
