"""Moved to :mod:`jaxcomm.tools.calibration`: ``python -m jaxcomm.calibration`` and
``import jaxcomm.calibration`` warn, and are removed in jaxcomm 0.3.0."""

from jaxcomm.deprecated import moved_module

moved_module(__name__, old="jaxcomm.calibration", new="jaxcomm.tools.calibration")
