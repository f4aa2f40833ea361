"""Test support that ships with kvstrata: the tier conformance suite and its oracle.

* :mod:`kvstrata.testing.conformance`: :class:`~kvstrata.testing.conformance.TierConformance`,
  the tests every tier must pass; a tier of another distribution runs them by subclassing it
  in a pytest module (see that module's docstring).
* :mod:`kvstrata.testing.stateful`: the stateful Hypothesis model the suite runs on an engine.
* :mod:`kvstrata.testing.oracle`: deterministic block contents, buffers, checks, key and layout
  builders, and a tier factory over the registry.

The package needs pytest and Hypothesis (``pip install 'kvstrata[testing]'``); importing it
without them raises an :class:`ImportError` that says so.
"""

from __future__ import annotations

try:
    import hypothesis  # noqa: F401
    import pytest
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by tests/test_registry.py
    raise ImportError(
        f"kvstrata.testing (the tier conformance suite) needs pytest and hypothesis, and {exc.name} "
        "is not installed: pip install 'kvstrata[testing]'"
    ) from exc

# Plain ``assert`` statements of the suite report their operands when a test fails.
pytest.register_assert_rewrite("kvstrata.testing.conformance", "kvstrata.testing.stateful", "kvstrata.testing.oracle")
