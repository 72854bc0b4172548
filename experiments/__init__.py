"""Reference experiments for jaxcomm."""
