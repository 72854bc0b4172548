"""Moved to :mod:`jaxcomm.tools.launch`: ``python -m jaxcomm.launch`` and
``import jaxcomm.launch`` warn, and are removed in jaxcomm 0.3.0."""

from jaxcomm.deprecated import moved_module

moved_module(__name__, old="jaxcomm.launch", new="jaxcomm.tools.launch")
