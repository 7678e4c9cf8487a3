"""The foundation every layer uses."""

__version__ = "0.1.0"  # pyproject.toml's version; results and sweeps write it
