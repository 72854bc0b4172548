"""Moved to :mod:`jaxcomm.tools.testbed`: ``python -m jaxcomm.testbed`` and
``import jaxcomm.testbed`` warn, and are removed in jaxcomm 0.3.0."""

from jaxcomm.deprecated import moved_module

moved_module(__name__, old="jaxcomm.testbed", new="jaxcomm.tools.testbed")
