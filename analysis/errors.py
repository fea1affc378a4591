"""The one error of the run analysis."""


class CompareError(RuntimeError):
    """Nothing to compare, or an unusable input; the message says what to do."""
