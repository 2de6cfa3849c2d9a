"""Integrations with other libraries (imported on demand, never by ``import tileattn``)."""
