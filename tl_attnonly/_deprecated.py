"""Old import paths of moved modules: the warning their thin re-exports give when imported."""

import warnings


def warn_moved(old: str, new: str) -> None:
    """Warn (``DeprecationWarning``) that module ``old`` moved to ``new``, pointing at the line
    that imports ``old``. Call it from ``old``'s module body."""
    # stacklevel 3: past this function and the old module's body (importlib's frames are skipped)
    warnings.warn(f"{old} is deprecated: import from {new}.", DeprecationWarning, stacklevel=3)


__all__ = ["warn_moved"]
