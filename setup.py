"""For tools that still run ``python setup.py ...`` (or a pip too old for PEP 660 editable
installs): the metadata, extras and package data are all in ``pyproject.toml`` (PEP 621)."""

from setuptools import setup

setup()
