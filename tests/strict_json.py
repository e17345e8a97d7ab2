"""Reading a run's JSON outputs strictly: a bare NaN or Infinity (not valid JSON) fails the test."""


def _no_constant(name):
    raise AssertionError(f"bare {name} in a JSON output")
