"""The refusal every model integration raises: a module convert() cannot change without changing what it computes."""


class ConversionError(ValueError):
    """A module that convert() cannot change without changing what it computes."""
