"""The package's version, in a module of its own so that any layer can read it (``dynemb.__version__`` is this)."""

__version__ = "0.1.0"
