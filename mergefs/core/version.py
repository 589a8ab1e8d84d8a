"""The package version, in a leaf module so that any module can name it without importing the API."""

__version__ = "0.2.0"
