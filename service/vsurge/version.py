"""The package's version, in a module of its own: the server, the router and the cli read it without
importing the `vsurge` package's lazy facade (which reaches every layer)."""

__version__ = "0.1.0"
