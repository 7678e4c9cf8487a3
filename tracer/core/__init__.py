"""The foundation every layer uses."""
