"""Moved to :mod:`jaxcomm.tools.simulate`: ``python -m jaxcomm.simulate`` and
``import jaxcomm.simulate`` warn, and are removed in jaxcomm 0.3.0."""

from jaxcomm.deprecated import moved_module

moved_module(__name__, old="jaxcomm.simulate", new="jaxcomm.tools.simulate")
